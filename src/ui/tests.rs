use hyper::HeaderMap;

use super::{render::esc, *};

#[test]
fn every_html_special_character_is_escaped() {
    assert_eq!(
        esc(r#"<script>alert("x&'y")</script>"#),
        "&lt;script&gt;alert(&quot;x&amp;&apos;y&quot;)&lt;/script&gt;"
    );
}

#[test]
fn ages_read_like_kubectl() {
    let t0 = Timestamp::UNIX_EPOCH;
    let at = |s: i64| Timestamp::from_second(s).unwrap();
    assert_eq!(age(at(42), t0), "42s");
    assert_eq!(age(at(600), t0), "10m");
    assert_eq!(age(at(3 * 3600), t0), "3h");
    assert_eq!(age(at(5 * 86_400), t0), "5d");
}

#[test]
fn a_token_comes_from_bearer_or_the_basic_password() {
    let with = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("header"),
        );
        presented_token(&headers)
    };
    assert_eq!(with("Bearer abc").as_deref(), Some("abc"));
    // "ui:tok:en" — the password may hold a colon; the user name is ignored.
    assert_eq!(with("Basic dWk6dG9rOmVu").as_deref(), Some("tok:en"));
    assert_eq!(with("Basic !!!"), None);
    assert_eq!(with("Digest x"), None);
    assert_eq!(presented_token(&HeaderMap::new()), None);
}

#[test]
fn the_audit_log_keeps_the_last_entries_per_proxy() {
    let log = AuditLog::default();
    let entry = |reason: &str| AuditEntry {
        at: Timestamp::UNIX_EPOCH,
        from: crate::machine::table::Phase::Healthy,
        event: crate::machine::table::Event::HealthFailed,
        to: crate::machine::table::Phase::Degraded,
        guard: Vec::new(),
        effects: Vec::new(),
        reason: reason.to_owned(),
        note: String::new(),
        cause: Some(format!("cause of {reason}")),
    };
    let entries: Vec<_> = (0..AUDIT_ENTRIES_SHOWN + 3)
        .map(|i| entry(&format!("R{i}")))
        .collect();
    log.record("crawl", "web-1", &entries);
    log.record("crawl", "web-2", &entries[..1]);
    let last = log.last("crawl", "web-1", 2);
    let reasons: Vec<_> = last.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            format!("R{}", AUDIT_ENTRIES_SHOWN + 1),
            format!("R{}", AUDIT_ENTRIES_SHOWN + 2)
        ]
    );
    assert_eq!(last[0].message, format!("cause of R{}", AUDIT_ENTRIES_SHOWN + 1));
    assert_eq!(log.last("crawl", "web-1", 100).len(), AUDIT_ENTRIES_SHOWN);
    log.forget("crawl", "web-1");
    assert!(log.last("crawl", "web-1", 100).is_empty());
    assert_eq!(log.last("crawl", "web-2", 100).len(), 1);
}

#[test]
fn user_input_on_the_page_is_escaped_and_every_section_renders() {
    let hostile = "<script>alert(1)</script>";
    let view = StatusView {
        mode: "standalone",
        now: Timestamp::from_second(1_000).expect("time"),
        providers: vec![ProviderRow {
            name: "kvm".to_owned(),
            down_reason: Some(format!("probe failed: {hostile}")),
            proxies: 1,
        }],
        proxies: vec![ProxyRow {
            state: ProxyState {
                namespace: "crawl".to_owned(),
                name: "web-\"1\"".to_owned(),
                provider: "kvm".to_owned(),
                phase: "degraded".to_owned(),
                deleting: true,
                endpoint: Some("10.0.0.7:3128".to_owned()),
                ready: Some(("HealthCheckFailed".to_owned(), hostile.to_owned())),
                created: Some(Timestamp::from_second(400).expect("time")),
            },
            leases: None,
            health: None,
            health_history: vec![HealthChange {
                at: Timestamp::from_second(900).expect("time"),
                verdict: Verdict::Failing,
                error: Some(hostile.to_owned()),
            }],
            audit: vec![AuditRow {
                at: Timestamp::from_second(900).expect("time"),
                arrow: "healthy --health_failed--> degraded".to_owned(),
                reason: "HealthCheckFailed".to_owned(),
                message: hostile.to_owned(),
            }],
        }],
    };
    let html = render::page(&view);
    assert!(!html.contains("<script"), "{html}");
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{html}");
    assert!(html.contains("data-proxy=\"crawl/web-&quot;1&quot;\""), "{html}");
    for shown in [
        "degraded (deleting)",
        "10.0.0.7:3128",
        "unavailable",
        "not in rotation",
        "not probed",
        "healthy --health_failed--&gt; degraded",
        "10m",
    ] {
        assert!(html.contains(shown), "{shown} missing: {html}");
    }
}
