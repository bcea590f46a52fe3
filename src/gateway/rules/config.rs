//! The rules file (`--gateway-rules FILE`, YAML or JSON): its shape, and its validation into
//! [`Rules`], with errors that name the rule and the field to fix. docs/gateway.md documents
//! the format.

use std::{collections::BTreeMap, path::Path, time::Duration};

use hyper::header::HeaderName;
use serde::Deserialize;

use super::{Action, BodyMatch, HeaderMatch, Match, Rule, Rules, Step};
use crate::{
    config::FileError,
    politeness::{DomainPattern, PolitenessEntry},
};

/// Most bytes of a body a body pattern may look at (per answer, held while it is judged).
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Body bytes a body pattern looks at when `bodyBytes` is not given.
pub const DEFAULT_BODY_BYTES: usize = 16 * 1024;
/// The highest `after` of a step: it bounds the strikes kept per counter.
pub const MAX_AFTER: u32 = 1000;
/// Longest window, cooldown, ban or time out of rotation (7 days).
pub const MAX_SECONDS: u64 = 7 * 24 * 3600;
/// A rule's window when it gives none.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(30 * 60);
/// Most rules (and most politeness entries) in a file.
pub const MAX_RULES: usize = 64;
/// Longest a request may wait for its politeness turn.
pub const MAX_POLITE_WAIT_MS: u64 = 60_000;
/// How long a request waits for its politeness turn when the entry does not say.
pub const DEFAULT_POLITE_WAIT_MS: u64 = 5_000;
/// Largest compiled pattern (the `regex` crate's size limit), so a file cannot make the
/// gateway build a huge automaton.
const MAX_PATTERN_SIZE: usize = 1024 * 1024;
/// The file as its errors name it.
const WHAT: &str = "gateway rules";

/// Why the rules file was refused.
pub type RulesError = FileError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    /// Absent: the default rule; `[]`: no rule at all.
    #[serde(default)]
    rules: Option<Vec<RuleSpec>>,
    #[serde(default)]
    politeness: Vec<PoliteSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PoliteSpec {
    #[serde(default)]
    domains: Vec<String>,
    #[serde(default)]
    proxies: BTreeMap<String, String>,
    #[serde(default)]
    min_interval_ms: Option<u64>,
    #[serde(default)]
    max_concurrent: Option<u32>,
    #[serde(default)]
    max_wait_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RuleSpec {
    #[serde(default)]
    name: String,
    /// Only proxies with all these attributes (empty: every proxy).
    #[serde(default)]
    proxies: BTreeMap<String, String>,
    #[serde(rename = "match")]
    when: MatchSpec,
    #[serde(default)]
    window_seconds: Option<u64>,
    #[serde(default)]
    retry: Option<bool>,
    #[serde(default)]
    escalation: Option<Vec<StepSpec>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct MatchSpec {
    #[serde(default)]
    status: Vec<u16>,
    #[serde(default)]
    header: Option<HeaderSpec>,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    body_bytes: Option<usize>,
    #[serde(default)]
    latency_above_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderSpec {
    name: String,
    #[serde(default)]
    value: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StepSpec {
    after: u32,
    action: ActionName,
    #[serde(default)]
    seconds: Option<u64>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
enum ActionName {
    Retry,
    Cooldown,
    Ban,
    OutOfRotation,
    Recycle,
}

impl ActionName {
    const fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Cooldown => "cooldown",
            Self::Ban => "ban",
            Self::OutOfRotation => "outOfRotation",
            Self::Recycle => "recycle",
        }
    }
}

/// The ladder a rule without `escalation` climbs: retry elsewhere, then a minute's rest for
/// the domain, a ban for the domain (the store's duration), ten minutes out of rotation, and a
/// fresh instance.
pub fn default_ladder() -> Vec<Step> {
    vec![
        Step {
            after: 1,
            action: Action::Retry,
        },
        Step {
            after: 2,
            action: Action::Cooldown(Duration::from_secs(60)),
        },
        Step {
            after: 3,
            action: Action::Ban(None),
        },
        Step {
            after: 5,
            action: Action::OutOfRotation(Duration::from_secs(600)),
        },
        Step {
            after: 8,
            action: Action::Recycle,
        },
    ]
}

impl Rules {
    /// Reads and validates a rules file.
    pub fn load(path: &Path) -> Result<Self, RulesError> {
        crate::config::load_file(WHAT, path, Self::parse)
    }

    /// Validates rules given as YAML (or JSON) text; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, RulesError> {
        let file: RulesFile = crate::config::from_yaml_file(WHAT, text, path)?;
        let too_many = |field: &str, n: usize| FileError::too_many(WHAT, path, field, n, MAX_RULES);
        if file.politeness.len() > MAX_RULES {
            return Err(too_many("politeness", file.politeness.len()));
        }
        let mut politeness = Vec::with_capacity(file.politeness.len());
        for (index, spec) in file.politeness.into_iter().enumerate() {
            politeness.push(
                compile_politeness(spec).map_err(|(field, message)| FileError::Invalid {
                    what: WHAT,
                    path: path.to_owned(),
                    entry: format!("politeness[{index}]."),
                    field,
                    message,
                })?,
            );
        }
        let Some(specs) = file.rules else {
            return Ok(Self {
                rules: Self::default_rules(),
                politeness,
            });
        };
        if specs.len() > MAX_RULES {
            return Err(too_many("rules", specs.len()));
        }
        let mut rules: Vec<Rule> = Vec::with_capacity(specs.len());
        for (index, spec) in specs.into_iter().enumerate() {
            let invalid = |rule: &str, field: &str, message: String| FileError::Invalid {
                what: WHAT,
                path: path.to_owned(),
                entry: format!("rule {rule:?} (rules[{index}]), "),
                field: field.to_owned(),
                message,
            };
            let name = spec.name.clone();
            if !crate::config::is_dns_label(&name) {
                return Err(invalid(
                    &name,
                    "name",
                    "every rule needs a name of 1-63 lowercase letters, digits or '-' \
                     (it names the rule in logs and in the recycle requests it makes)"
                        .to_owned(),
                ));
            }
            if rules.iter().any(|r| *r.name == *name) {
                return Err(invalid(&name, "name", "another rule has this name".to_owned()));
            }
            let rule = compile(spec).map_err(|(field, message)| invalid(&name, &field, message))?;
            rules.push(rule);
        }
        Ok(Self { rules, politeness })
    }
}

/// One politeness entry, or the field that is wrong and why.
fn compile_politeness(spec: PoliteSpec) -> Result<PolitenessEntry, (String, String)> {
    let mut domains = Vec::with_capacity(spec.domains.len());
    for (i, text) in spec.domains.iter().enumerate() {
        let lower = text.to_ascii_lowercase();
        let (pattern, name) = match lower.strip_prefix("*.") {
            Some(rest) => (DomainPattern::Below(rest.to_owned()), rest),
            None => (DomainPattern::Exact(lower.clone()), lower.as_str()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        if !valid {
            return Err((
                format!("domains[{i}]"),
                format!("{text:?} is no domain (a host name, or *. and a host name for its subdomains)"),
            ));
        }
        domains.push(pattern);
    }
    if spec.min_interval_ms.is_none() && spec.max_concurrent.is_none() {
        return Err((
            "minIntervalMs".into(),
            "give minIntervalMs, maxConcurrent or both".into(),
        ));
    }
    if let Some(ms) = spec.min_interval_ms
        && !(1..=3_600_000).contains(&ms)
    {
        return Err(("minIntervalMs".into(), format!("{ms} is out of range 1-3600000")));
    }
    if let Some(n) = spec.max_concurrent
        && !(1..=10_000).contains(&n)
    {
        return Err(("maxConcurrent".into(), format!("{n} is out of range 1-10000")));
    }
    let wait = spec.max_wait_ms.unwrap_or(DEFAULT_POLITE_WAIT_MS);
    if wait > MAX_POLITE_WAIT_MS {
        return Err((
            "maxWaitMs".into(),
            format!("{wait} is out of range 0-{MAX_POLITE_WAIT_MS}"),
        ));
    }
    Ok(PolitenessEntry {
        domains,
        proxies: spec.proxies.into_iter().collect(),
        min_interval: spec.min_interval_ms.map(Duration::from_millis),
        max_concurrent: spec.max_concurrent,
        max_wait: Duration::from_millis(wait),
    })
}

/// One rule, or the field that is wrong and why.
fn compile(spec: RuleSpec) -> Result<Rule, (String, String)> {
    let when = compile_match(spec.when)?;
    let window = match spec.window_seconds {
        None => DEFAULT_WINDOW,
        Some(s) if (1..=MAX_SECONDS).contains(&s) => Duration::from_secs(s),
        Some(s) => {
            return Err((
                "windowSeconds".into(),
                format!("{s} is out of range 1-{MAX_SECONDS}"),
            ));
        }
    };
    let ladder = match spec.escalation {
        None => default_ladder(),
        Some(steps) => compile_ladder(steps)?,
    };
    Ok(Rule {
        name: spec.name.into(),
        proxies: spec.proxies.into_iter().collect(),
        when,
        window,
        retry: spec.retry.unwrap_or(true),
        ladder,
    })
}

fn compile_match(spec: MatchSpec) -> Result<Match, (String, String)> {
    if let Some(status) = spec.status.iter().find(|s| !(100..=599).contains(*s)) {
        return Err((
            "match.status".into(),
            format!("{status} is no HTTP status code (100-599)"),
        ));
    }
    let header = match spec.header {
        None => None,
        Some(h) => {
            let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| {
                (
                    "match.header.name".to_owned(),
                    format!("{:?} is no header name", h.name),
                )
            })?;
            let value = h
                .value
                .map(|v| pattern(&v).map_err(|e| ("match.header.value".to_owned(), e)))
                .transpose()?;
            Some(HeaderMatch { name, value })
        }
    };
    if spec.body.is_none() && spec.body_bytes.is_some() {
        return Err((
            "match.bodyBytes".into(),
            "bodyBytes bounds what match.body looks at: give match.body too".into(),
        ));
    }
    let body = match spec.body {
        None => None,
        Some(text) => {
            let bytes = spec.body_bytes.unwrap_or(DEFAULT_BODY_BYTES);
            if !(1..=MAX_BODY_BYTES).contains(&bytes) {
                return Err((
                    "match.bodyBytes".into(),
                    format!("{bytes} is out of range 1-{MAX_BODY_BYTES}"),
                ));
            }
            let pattern = regex::bytes::RegexBuilder::new(&text)
                .size_limit(MAX_PATTERN_SIZE)
                .build()
                .map_err(|e| ("match.body".to_owned(), format!("not a valid pattern: {e}")))?;
            Some(BodyMatch { pattern, bytes })
        }
    };
    let latency_above = match spec.latency_above_ms {
        None => None,
        Some(0) => {
            return Err((
                "match.latencyAboveMs".into(),
                "must be at least 1 (milliseconds)".into(),
            ));
        }
        Some(ms) => Some(Duration::from_millis(ms)),
    };
    let when = Match {
        statuses: spec.status,
        header,
        body,
        latency_above,
    };
    if when.is_empty() {
        return Err((
            "match".into(),
            "give at least one of status, header, body, latencyAboveMs".into(),
        ));
    }
    Ok(when)
}

fn pattern(text: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(text)
        .size_limit(MAX_PATTERN_SIZE)
        .build()
        .map_err(|e| format!("not a valid pattern: {e}"))
}

fn compile_ladder(steps: Vec<StepSpec>) -> Result<Vec<Step>, (String, String)> {
    if steps.is_empty() {
        return Err((
            "escalation".into(),
            "give at least one step (or leave escalation out for the default ladder)".into(),
        ));
    }
    let mut ladder: Vec<Step> = Vec::with_capacity(steps.len());
    let mut last: Option<(u32, ActionName)> = None;
    for (i, spec) in steps.into_iter().enumerate() {
        let at = |field: &str| format!("escalation[{i}].{field}");
        if !(1..=MAX_AFTER).contains(&spec.after) {
            return Err((
                at("after"),
                format!("{} is out of range 1-{MAX_AFTER}", spec.after),
            ));
        }
        if let Some((after, action)) = last {
            if spec.after <= after {
                return Err((
                    at("after"),
                    format!("{} must be greater than the step before's ({after})", spec.after),
                ));
            }
            if spec.action <= action {
                return Err((
                    at("action"),
                    format!(
                        "{} after {}: steps escalate in the order retry, cooldown, ban, \
                         outOfRotation, recycle",
                        spec.action.as_str(),
                        action.as_str()
                    ),
                ));
            }
        }
        last = Some((spec.after, spec.action));
        let seconds = match (spec.action, spec.seconds) {
            (ActionName::Retry | ActionName::Recycle, Some(_)) => {
                return Err((
                    at("seconds"),
                    format!("{} takes no duration", spec.action.as_str()),
                ));
            }
            (_, Some(s)) if !(1..=MAX_SECONDS).contains(&s) => {
                return Err((at("seconds"), format!("{s} is out of range 1-{MAX_SECONDS}")));
            }
            (_, s) => s.map(Duration::from_secs),
        };
        let action = match spec.action {
            ActionName::Retry => Action::Retry,
            ActionName::Cooldown => Action::Cooldown(seconds.unwrap_or(Duration::from_secs(60))),
            ActionName::Ban => Action::Ban(seconds),
            ActionName::OutOfRotation => Action::OutOfRotation(seconds.unwrap_or(Duration::from_secs(600))),
            ActionName::Recycle => Action::Recycle,
        };
        ladder.push(Step {
            after: spec.after,
            action,
        });
    }
    Ok(ladder)
}

impl Match {
    fn is_empty(&self) -> bool {
        self.statuses.is_empty()
            && self.header.is_none()
            && self.body.is_none()
            && self.latency_above.is_none()
    }
}
