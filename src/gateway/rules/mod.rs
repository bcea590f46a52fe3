//! What the gateway does about a target's answer: rules from what it sees (status codes, a
//! header, a pattern in the first bytes of the body, the time to the answer) to an action that
//! escalates with repeated matches for one proxy: retry elsewhere, a rest for the domain, a
//! ban for the domain, out of rotation, a fresh instance. Documented in docs/gateway.md.
//!
//! It owns the rules file and its validation ([`config`]), matching ([`Rules::judge`]), the
//! escalation counters ([`escalation`]) and carrying out the proxy-wide steps ([`judge`]):
//! out of rotation through the health engine (the lifecycle then closes the proxy, as for a
//! failed check), a recycle through [`RecycleRequests`] (the lifecycle's `recycle_requested`,
//! within its pool's budget). Lease outcomes stay the lease store's; the forwarding code asks
//! [`judge::Judge`] and ends the lease as the verdict says.
//!
//! Without a rules file the rules are today's default: a 403 or 429 bans the proxy for the
//! target's domain, and the answer is passed on.

pub mod config;
pub mod escalation;
pub(super) mod judge;
mod recycle;

use std::time::Duration;

use hyper::{HeaderMap, StatusCode, header::HeaderName};

pub use config::RulesError;
pub use recycle::{RecycleError, RecycleRequests, recycle_value};

use crate::api::Attributes;

/// What a step of a rule's escalation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send a GET or HEAD once more through another proxy; the lease ends well (a session
    /// keeps its proxy).
    Retry,
    /// End the lease as `banned` for the target's domain for this (short) time.
    Cooldown(Duration),
    /// End the lease as `banned` for the target's domain, for this time (`None`: the lease
    /// store's ban cooldown).
    Ban(Option<Duration>),
    /// Take the proxy out of rotation for this time: the health engine holds its verdict
    /// failing, so the lifecycle closes it as for a failed check (and the lease ends as the
    /// ladder's strongest domain step says).
    OutOfRotation(Duration),
    /// Ask for a fresh instance (a new address) through the lifecycle's recycle request
    /// (and the lease ends as the ladder's strongest domain step says).
    Recycle,
}

impl Action {
    /// The step's name, as the rules file and logs say it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Cooldown(_) => "cooldown",
            Self::Ban(_) => "ban",
            Self::OutOfRotation(_) => "outOfRotation",
            Self::Recycle => "recycle",
        }
    }

    /// Whether it counts matches over all domains of the proxy (else per domain).
    pub const fn proxy_wide(self) -> bool {
        matches!(self, Self::OutOfRotation(_) | Self::Recycle)
    }
}

/// One step: `action` from the `after`-th match within the window on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Matches within the window (per domain, or per proxy for proxy-wide actions).
    pub after: u32,
    /// What it does.
    pub action: Action,
}

/// A header condition: present, and if `value` is given, a value matching it.
#[derive(Clone, Debug)]
pub struct HeaderMatch {
    /// The header.
    pub name: HeaderName,
    /// A pattern one of its values must match (anywhere in it).
    pub value: Option<regex::Regex>,
}

/// A body condition: `pattern` found in the first `bytes` of the body.
#[derive(Clone, Debug)]
pub struct BodyMatch {
    /// The pattern, over bytes.
    pub pattern: regex::bytes::Regex,
    /// How much of the body it looks at.
    pub bytes: usize,
}

/// What an answer must show for a rule to match: every condition given holds.
#[derive(Clone, Debug, Default)]
pub struct Match {
    /// One of these status codes (empty: any).
    pub statuses: Vec<u16>,
    /// A header.
    pub header: Option<HeaderMatch>,
    /// A pattern in the body's first bytes.
    pub body: Option<BodyMatch>,
    /// The answer's head came later than this after the request was sent.
    pub latency_above: Option<Duration>,
}

/// One rule.
#[derive(Clone, Debug)]
pub struct Rule {
    /// Its name (logs, recycle requests).
    pub name: std::sync::Arc<str>,
    /// Only proxies with all these attributes (empty: every proxy).
    pub proxies: Vec<(String, String)>,
    /// What matches.
    pub when: Match,
    /// Matches older than this are forgotten.
    pub window: Duration,
    /// A GET or HEAD whose answer matched is sent once more through another proxy, whatever
    /// the step; `false`: the matching answer is passed on (only a `retry` step resends).
    pub retry: bool,
    /// The escalation, by `after`.
    pub ladder: Vec<Step>,
}

/// What the gateway saw of an answer.
#[derive(Clone, Copy, Debug)]
pub struct Seen<'a> {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: &'a HeaderMap,
    /// From sending the request to the answer's head.
    pub latency: Duration,
    /// The first bytes of its body, if they were read.
    pub body: Option<&'a [u8]>,
}

impl Match {
    /// Whether everything but the body holds.
    fn head_holds(&self, seen: &Seen<'_>) -> bool {
        (self.statuses.is_empty() || self.statuses.contains(&seen.status.as_u16()))
            && self.header.as_ref().is_none_or(|h| {
                seen.headers.get_all(&h.name).iter().any(|value| {
                    h.value
                        .as_ref()
                        .is_none_or(|pattern| value.to_str().is_ok_and(|text| pattern.is_match(text)))
                })
            })
            && self.latency_above.is_none_or(|above| seen.latency > above)
    }

    fn holds(&self, seen: &Seen<'_>) -> bool {
        self.head_holds(seen)
            && self.body.as_ref().is_none_or(|b| {
                seen.body
                    .is_some_and(|body| b.pattern.is_match(&body[..body.len().min(b.bytes)]))
            })
    }
}

impl Rule {
    /// Whether it applies to a proxy with `attributes`.
    fn applies_to(&self, attributes: &Attributes) -> bool {
        self.proxies
            .iter()
            .all(|(name, value)| attributes.get(name) == Some(value.as_str()))
    }

    /// The step `counts` reach: the highest proxy-wide step its proxy count reaches, else the
    /// highest per-domain step its domain count reaches.
    pub fn step(&self, counts: escalation::Counts) -> Option<Step> {
        let reached = |wide: bool, count: u32| {
            self.ladder
                .iter()
                .rev()
                .find(|s| s.action.proxy_wide() == wide && s.after <= count)
                .copied()
        };
        reached(true, counts.proxy).or_else(|| reached(false, counts.domain))
    }

    /// How a proxy-wide step ends the lease: as the ladder's strongest domain step (a ban or a
    /// cooldown) does; `None`: the lease ends well.
    pub fn domain_rest(&self) -> Option<Action> {
        self.ladder
            .iter()
            .rev()
            .map(|s| s.action)
            .find(|a| matches!(a, Action::Ban(_) | Action::Cooldown(_)))
    }

    /// The most match times a counter must keep: the highest `after`.
    pub fn keep(&self) -> usize {
        self.ladder.iter().map(|s| s.after).max().unwrap_or(1) as usize
    }
}

/// The rules file: the rules, asked in order (the first that matches decides), and the
/// politeness limits (`politeness:`, none by default).
#[derive(Clone, Debug)]
pub struct Rules {
    /// The rules.
    pub rules: Vec<Rule>,
    /// The politeness limits, asked in order (the first that applies decides).
    pub politeness: Vec<crate::politeness::PolitenessEntry>,
}

impl Default for Rules {
    /// Today's behaviour: 403 and 429 ban the proxy for the domain (the store's duration) at
    /// the first match, and the answer is passed on.
    fn default() -> Self {
        Self {
            rules: Self::default_rules(),
            politeness: Vec::new(),
        }
    }
}

impl Rules {
    /// The default rule: 403 and 429 ban at once, the answer passed on.
    pub fn default_rules() -> Vec<Rule> {
        vec![Rule {
            name: "default-ban".into(),
            proxies: Vec::new(),
            when: Match {
                statuses: vec![403, 429],
                ..Match::default()
            },
            window: config::DEFAULT_WINDOW,
            retry: false,
            ladder: vec![Step {
                after: 1,
                action: Action::Ban(None),
            }],
        }]
    }

    /// The first rule (its index) that applies to a proxy with `attributes` and matches `seen`.
    pub fn judge(&self, attributes: &Attributes, seen: &Seen<'_>) -> Option<(usize, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, rule)| rule.applies_to(attributes) && rule.when.holds(seen))
    }

    /// How many body bytes to read before judging an answer whose head is `seen`: the most
    /// any rule needs whose other conditions hold, up to the first that matches without its
    /// body (0: judge on the head alone).
    pub fn body_wanted(&self, attributes: &Attributes, seen: &Seen<'_>) -> usize {
        let mut wanted = 0;
        for rule in &self.rules {
            if !rule.applies_to(attributes) || !rule.when.head_holds(seen) {
                continue;
            }
            match &rule.when.body {
                Some(body) => wanted = wanted.max(body.bytes),
                None => break,
            }
        }
        wanted
    }
}

#[cfg(test)]
mod tests;
