//! Matching, the rules file's validation and the escalation ladder, without the network
//! (tests/gateway.rs runs the rules through real Squids).

use std::time::Duration;

use hyper::{HeaderMap, StatusCode, header::HeaderValue};

use super::{escalation::Counts, *};

fn seen<'a>(status: u16, headers: &'a HeaderMap, latency_ms: u64, body: Option<&'a [u8]>) -> Seen<'a> {
    Seen {
        status: StatusCode::from_u16(status).expect("a status"),
        headers,
        latency: Duration::from_millis(latency_ms),
        body,
    }
}

fn parse(text: &str) -> Result<Rules, RulesError> {
    Rules::parse(text, "rules.yaml")
}

fn attributes(pairs: &[(&str, &str)]) -> Attributes {
    serde_json::from_value(serde_json::json!(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<std::collections::BTreeMap<_, _>>()
    ))
    .expect("attributes")
}

#[test]
fn by_default_403_and_429_ban_at_once_and_pass_the_answer_on() {
    let rules = Rules::default();
    let none = HeaderMap::new();
    let any = attributes(&[]);
    for status in [403, 429] {
        let (_, rule) = rules.judge(&any, &seen(status, &none, 1, None)).expect("matches");
        assert!(!rule.retry);
        let step = rule.step(Counts { domain: 1, proxy: 1 }).expect("a step");
        assert_eq!(step.action, Action::Ban(None));
    }
    for status in [200, 301, 404, 500, 503] {
        assert!(
            rules.judge(&any, &seen(status, &none, 1, None)).is_none(),
            "{status}"
        );
    }
    assert_eq!(rules.body_wanted(&any, &seen(403, &none, 1, None)), 0);
}

#[test]
fn every_condition_given_must_hold() {
    let rules = parse(
        r#"
rules:
  - name: captcha
    match:
      status: [200]
      header: {name: x-served-by, value: "^edge-(7|9)$"}
      body: "(?i)are you a robot"
      bodyBytes: 32
  - name: slow
    proxies: {pool: eu}
    match: {latencyAboveMs: 500}
"#,
    )
    .expect("valid");
    let any = attributes(&[]);
    let mut edge7 = HeaderMap::new();
    edge7.insert("x-served-by", HeaderValue::from_static("edge-7"));
    let robot: &[u8] = b"<html>Are You A Robot?</html>";
    let name = |s: &Seen<'_>, a: &Attributes| rules.judge(a, s).map(|(_, r)| r.name.to_string());
    assert_eq!(
        name(&seen(200, &edge7, 1, Some(robot)), &any).as_deref(),
        Some("captcha")
    );
    // The body is looked at only up to bodyBytes.
    let late = [vec![b' '; 40], robot.to_vec()].concat();
    assert_eq!(name(&seen(200, &edge7, 1, Some(&late)), &any), None);
    // Each condition alone is not enough.
    assert_eq!(name(&seen(200, &HeaderMap::new(), 1, Some(robot)), &any), None);
    assert_eq!(name(&seen(404, &edge7, 1, Some(robot)), &any), None);
    assert_eq!(name(&seen(200, &edge7, 1, Some(b"welcome")), &any), None);
    let mut edge8 = HeaderMap::new();
    edge8.insert("x-served-by", HeaderValue::from_static("edge-8"));
    assert_eq!(name(&seen(200, &edge8, 1, Some(robot)), &any), None);
    // The head decides whether the body is read, and how much.
    assert_eq!(rules.body_wanted(&any, &seen(200, &edge7, 1, None)), 32);
    assert_eq!(rules.body_wanted(&any, &seen(200, &edge8, 1, None)), 0);
    // Latency, for the proxies the rule selects only.
    let eu = attributes(&[("pool", "eu")]);
    assert_eq!(name(&seen(200, &edge8, 900, None), &eu).as_deref(), Some("slow"));
    assert_eq!(name(&seen(200, &edge8, 400, None), &eu), None);
    assert_eq!(name(&seen(200, &edge8, 900, None), &any), None);
}

#[test]
fn the_ladder_escalates_per_domain_then_per_proxy() {
    let rules = parse("rules:\n  - name: blocked\n    match: {status: [403]}\n").expect("valid");
    let rule = &rules.rules[0];
    assert!(rule.retry);
    let step = |domain, proxy| rule.step(Counts { domain, proxy }).map(|s| s.action);
    assert_eq!(step(1, 1), Some(Action::Retry));
    assert_eq!(step(2, 2), Some(Action::Cooldown(Duration::from_secs(60))));
    assert_eq!(step(3, 3), Some(Action::Ban(None)));
    assert_eq!(step(4, 4), Some(Action::Ban(None)));
    assert_eq!(step(5, 5), Some(Action::OutOfRotation(Duration::from_secs(600))));
    assert_eq!(step(8, 8), Some(Action::Recycle));
    // Matches spread over domains: each domain escalates alone, the proxy over all of them.
    assert_eq!(step(1, 4), Some(Action::Retry));
    assert_eq!(step(1, 6), Some(Action::OutOfRotation(Duration::from_secs(600))));
    // Proxy-wide steps rest the domain as the strongest domain step does.
    assert_eq!(rule.domain_rest(), Some(Action::Ban(None)));
    assert_eq!(rule.keep(), 8);
}

#[test]
fn a_ladder_of_its_own() {
    let rules = parse(
        r#"
rules:
  - name: blocked
    windowSeconds: 60
    retry: false
    match: {status: [403]}
    escalation:
      - {after: 2, action: cooldown, seconds: 5}
      - {after: 4, action: recycle}
"#,
    )
    .expect("valid");
    let rule = &rules.rules[0];
    assert_eq!(rule.window, Duration::from_secs(60));
    assert!(!rule.retry);
    let step = |n| rule.step(Counts { domain: n, proxy: n }).map(|s| s.action);
    assert_eq!(step(1), None, "below the first step: counted, nothing done");
    assert_eq!(step(3), Some(Action::Cooldown(Duration::from_secs(5))));
    assert_eq!(step(4), Some(Action::Recycle));
    assert_eq!(rule.domain_rest(), Some(Action::Cooldown(Duration::from_secs(5))));
}

#[test]
fn a_bad_file_says_which_rule_and_field_to_fix() {
    let cases: &[(&str, &str)] = &[
        (
            "rules:\n  - name: x\n    match: {stauts: [403]}\n",
            "rules[0].match: unknown field `stauts`",
        ),
        (
            "rules:\n  - name: x\n    match: {}\n",
            "rule \"x\" (rules[0]), match: give at least one of",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [99]}\n",
            "rule \"x\" (rules[0]), match.status: 99",
        ),
        (
            "rules:\n  - name: x\n    match: {body: \"(unclosed\"}\n",
            "rule \"x\" (rules[0]), match.body: not a valid pattern",
        ),
        (
            "rules:\n  - name: x\n    match: {header: {name: \"bad header\"}}\n",
            "match.header.name: \"bad header\" is no header name",
        ),
        (
            "rules:\n  - name: x\n    match: {body: a, bodyBytes: 2000000}\n",
            "match.bodyBytes: 2000000 is out of range",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [403]}\n    escalation:\n      - {after: 2, action: ban}\n      - {after: 1, action: recycle}\n",
            "rule \"x\" (rules[0]), escalation[1].after: 1 must be greater",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [403]}\n    escalation:\n      - {after: 1, action: ban}\n      - {after: 2, action: cooldown}\n",
            "escalation[1].action: cooldown after ban",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [403]}\n    escalation:\n      - {after: 1, action: recycle, seconds: 5}\n",
            "escalation[0].seconds: recycle takes no duration",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [403]}\n    escalation:\n      - {after: 1, action: explode}\n",
            "rules[0].escalation[0].action: unknown variant `explode`",
        ),
        (
            "rules:\n  - name: Bad_Name\n    match: {status: [403]}\n",
            "rule \"Bad_Name\" (rules[0]), name:",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [403]}\n  - name: x\n    match: {status: [429]}\n",
            "rule \"x\" (rules[1]), name: another rule has this name",
        ),
        (
            "rules:\n  - name: x\n    match: {status: [403]}\n    windowSeconds: 0\n",
            "windowSeconds: 0 is out of range",
        ),
        (
            "politeness:\n  - {maxWaitMs: 100}\n",
            "politeness[0].minIntervalMs: give minIntervalMs, maxConcurrent or both",
        ),
        (
            "politeness:\n  - {minIntervalMs: 100}\n  - {domains: [shop.example, \"bad domain\"], maxConcurrent: 1}\n",
            "politeness[1].domains[1]: \"bad domain\" is no domain",
        ),
        (
            "politeness:\n  - {maxConcurrent: 0}\n",
            "politeness[0].maxConcurrent: 0 is out of range",
        ),
        (
            "politeness:\n  - {minIntervalMs: 5, maxWaitMs: 61000}\n",
            "politeness[0].maxWaitMs: 61000 is out of range",
        ),
        (
            "politeness:\n  - {minIntervalMs: 5, every: 3}\n",
            "politeness[0]: unknown field `every`",
        ),
    ];
    for (text, expected) in cases {
        let error = parse(text).expect_err(text).to_string();
        assert!(
            error.starts_with("the gateway rules rules.yaml: ") && error.contains(expected),
            "{text}\ngave: {error}\nexpected: {expected}"
        );
    }
}

fn proxy(name: &str, port: u16) -> crate::lease::ProxyInfo {
    crate::lease::ProxyInfo::new(&crate::lease::LeaseTarget {
        key: crate::api::ProxyKey::new("crawl", name),
        endpoint: crate::provider::Endpoint {
            host: "127.0.0.1".into(),
            port,
        },
        attributes: attributes(&[]),
        policy: crate::api::LeasePolicy {
            max_concurrent: 1,
            cooldown_seconds: 0,
            max_ttl_seconds: 600,
        },
        credentials: None,
    })
}

#[test]
fn a_judge_counts_and_says_how_the_lease_ends() {
    use super::judge::{Judge, LeaseEnd};
    let rules = parse(
        r#"
rules:
  - name: blocked
    retry: false
    match: {status: [403]}
    escalation:
      - {after: 1, action: retry}
      - {after: 2, action: cooldown, seconds: 5}
      - {after: 3, action: ban}
      - {after: 4, action: recycle}
"#,
    )
    .expect("valid");
    let judge = Judge::new(rules, None, None);
    let none = HeaderMap::new();
    let a = proxy("a", 1);
    let verdicts: Vec<(Action, bool, LeaseEnd)> = (0..4)
        .map(|i| {
            let v = judge
                .decide(&a, Some("shop.example"), &seen(403, &none, 1, None), || 1_000 + i)
                .expect("matches");
            (v.action, v.resend, v.lease)
        })
        .collect();
    assert_eq!(
        verdicts,
        [
            (Action::Retry, true, LeaseEnd::Keep),
            (
                Action::Cooldown(Duration::from_secs(5)),
                false,
                LeaseEnd::Banned(Some(Duration::from_secs(5)))
            ),
            (Action::Ban(None), false, LeaseEnd::Banned(None)),
            // Proxy-wide: the lease ends as the strongest domain step says.
            (Action::Recycle, false, LeaseEnd::Banned(None)),
        ]
    );
    // Another proxy, and a fresh instance (a new endpoint) of the first, start from nothing.
    let first = |p: &crate::lease::ProxyInfo| {
        judge
            .decide(p, Some("shop.example"), &seen(403, &none, 1, None), || 2_000)
            .expect("matches")
            .action
    };
    assert_eq!(first(&proxy("b", 2)), Action::Retry);
    assert_eq!(first(&proxy("a", 3)), Action::Retry);
    // A 200 is no match, and is not counted.
    assert!(
        judge
            .decide(&a, Some("shop.example"), &seen(200, &none, 1, None), || 2_001)
            .is_none()
    );
}

#[test]
fn the_example_in_the_docs_is_valid() {
    let doc = include_str!("../../../docs/gateway.md");
    let section = doc
        .split_once("### The rules file")
        .map(|(_, rest)| rest)
        .expect("docs/gateway.md has the section");
    let example = section
        .split_once("```yaml\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(yaml, _)| yaml)
        .expect("a YAML example");
    let rules = parse(example).expect("the documented example is valid");
    assert_eq!(rules.rules.len(), 1);
    let rule = &rules.rules[0];
    assert_eq!(&*rule.name, "captcha");
    assert_eq!(
        rule.ladder,
        config::default_ladder(),
        "the example shows the default ladder"
    );
}

#[test]
fn a_file_of_politeness_alone_keeps_the_default_rule() {
    use crate::politeness::DomainPattern;
    let rules = parse(
        "politeness:\n  - {domains: [Shop.Example, \"*.news.example\"], proxies: {pool: eu}, minIntervalMs: 500, maxConcurrent: 2}\n",
    )
    .expect("valid");
    assert_eq!(rules.rules.len(), 1);
    assert_eq!(&*rules.rules[0].name, "default-ban");
    let polite = &rules.politeness[0];
    assert_eq!(
        polite.domains,
        [
            DomainPattern::Exact("shop.example".into()),
            DomainPattern::Below("news.example".into())
        ]
    );
    assert_eq!(polite.proxies, [("pool".to_owned(), "eu".to_owned())]);
    assert_eq!(polite.min_interval, Some(Duration::from_millis(500)));
    assert_eq!(polite.max_concurrent, Some(2));
    assert_eq!(polite.max_wait, Duration::from_secs(5));
    // `rules: []`: no rule at all.
    assert!(parse("rules: []\n").expect("valid").rules.is_empty());
}
