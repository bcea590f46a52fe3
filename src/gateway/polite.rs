//! Politeness: per proxy × target domain, a minimum interval between the starts of two
//! requests and a limit on requests in flight, declared in the rules file (`politeness:`, off
//! by default; docs/gateway.md). A request waits for its turn up to the entry's `maxWaitMs`;
//! one that would wait longer is refused (429 with `Retry-After`) and its lease given back.
//!
//! A turn reserves its start time at once (later requests queue behind it), so waiting for the
//! interval needs no polling; a request waiting for a place in flight is woken when one is
//! freed. State is one entry per (proxy, domain) with requests in flight or a reserved start
//! ahead; idle ones are swept once [`MAX_TRACKED`] are kept, and beyond that bound (all busy)
//! a request goes unlimited rather than unserved.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use super::{Gateway, Refusal, held::Lent};
use crate::{api::Attributes, api::ProxyKey, sync::lock};

/// Most (proxy, domain) entries kept.
pub const MAX_TRACKED: usize = 65_536;

/// Which domains an entry applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DomainPattern {
    /// This domain.
    Exact(String),
    /// Subdomains of this one (`*.example.com`: `a.example.com`, not `example.com`).
    Below(String),
}

impl DomainPattern {
    fn matches(&self, domain: &str) -> bool {
        match self {
            Self::Exact(d) => d == domain,
            Self::Below(d) => {
                domain.len() > d.len() + 1
                    && domain.ends_with(d.as_str())
                    && domain.as_bytes()[domain.len() - d.len() - 1] == b'.'
            }
        }
    }
}

/// One `politeness:` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Politeness {
    /// Target domains it applies to (empty: every domain).
    pub domains: Vec<DomainPattern>,
    /// Only proxies with all these attributes (empty: every proxy).
    pub proxies: Vec<(String, String)>,
    /// Between the starts of two requests through one proxy to one domain.
    pub min_interval: Option<Duration>,
    /// Requests in flight through one proxy to one domain.
    pub max_concurrent: Option<u32>,
    /// How long a request may wait for its turn.
    pub max_wait: Duration,
}

impl Politeness {
    fn applies(&self, attributes: &Attributes, domain: &str) -> bool {
        (self.domains.is_empty() || self.domains.iter().any(|d| d.matches(domain)))
            && self
                .proxies
                .iter()
                .all(|(name, value)| attributes.get(name) == Some(value.as_str()))
    }
}

/// Why a request got no turn: what the gateway's 429 says.
#[derive(Debug, thiserror::Error)]
#[error("politeness towards {domain} through {proxy}: {why}; try again in {} s", .retry_after.as_secs())]
pub struct NoTurn {
    /// The proxy.
    pub proxy: ProxyKey,
    /// The domain.
    pub domain: String,
    /// Which limit.
    pub why: String,
    /// When trying again may help (whole seconds, at least one).
    pub retry_after: Duration,
}

#[derive(Default)]
struct Slot {
    in_flight: u32,
    /// The earliest start of the next request.
    next_start: Option<Instant>,
    freed: Arc<Notify>,
}

/// The limits and their state.
#[derive(Default)]
pub(super) struct Polite {
    entries: Vec<Politeness>,
    slots: Mutex<HashMap<(ProxyKey, String), Slot>>,
}

/// A request's place in flight; dropping it frees the place.
pub(super) struct Turn {
    polite: Arc<Polite>,
    key: (ProxyKey, String),
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut slots = lock(&self.polite.slots);
        if let Some(slot) = slots.get_mut(&self.key) {
            slot.in_flight = slot.in_flight.saturating_sub(1);
            slot.freed.notify_one();
        }
    }
}

impl Polite {
    /// Limits from the rules file's entries.
    pub(super) fn new(entries: Vec<Politeness>) -> Self {
        Self {
            entries,
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// A turn for a request through `proxy` (with `attributes`) to `domain`: at once, after
    /// waiting within the entry's bound, or refused. `None` when no entry applies.
    pub(super) async fn turn(
        self: &Arc<Self>,
        proxy: &ProxyKey,
        attributes: &Attributes,
        domain: Option<&str>,
    ) -> Result<Option<Turn>, NoTurn> {
        let Some(domain) = domain else {
            return Ok(None);
        };
        let Some(entry) = self.entries.iter().find(|e| e.applies(attributes, domain)) else {
            return Ok(None);
        };
        let key = (proxy.clone(), domain.to_owned());
        let deadline = Instant::now() + entry.max_wait;
        let refuse = |why: String, retry_after: Duration| NoTurn {
            proxy: proxy.clone(),
            domain: domain.to_owned(),
            why,
            // Whole seconds, rounded up, as `Retry-After` says them.
            retry_after: Duration::from_secs(retry_after.as_millis().div_ceil(1000).max(1) as u64),
        };
        // A place in flight first, then a start time: a request that got a place but whose
        // start is too far off gives the place back.
        loop {
            let freed = {
                let mut slots = lock(&self.slots);
                if !slots.contains_key(&key) && slots.len() >= MAX_TRACKED {
                    let now = Instant::now();
                    slots.retain(|_, s| s.in_flight > 0 || s.next_start.is_some_and(|t| t > now));
                    if slots.len() >= MAX_TRACKED {
                        tracing::debug!(proxy = %proxy, domain, "politeness table full: unlimited");
                        return Ok(None);
                    }
                }
                let slot = slots.entry(key.clone()).or_default();
                match entry.max_concurrent {
                    Some(max) if slot.in_flight >= max => slot.freed.clone(),
                    _ => {
                        slot.in_flight += 1;
                        break;
                    }
                }
            };
            let max = entry.max_concurrent.unwrap_or(u32::MAX);
            if tokio::time::timeout_at(deadline, freed.notified()).await.is_err() {
                return Err(refuse(
                    format!("{max} request(s) in flight, at most {max}"),
                    entry.min_interval.unwrap_or(Duration::from_secs(1)),
                ));
            }
        }
        let turn = Turn {
            polite: self.clone(),
            key: key.clone(),
        };
        let Some(interval) = entry.min_interval else {
            return Ok(Some(turn));
        };
        let start = {
            let mut slots = lock(&self.slots);
            let now = Instant::now();
            let slot = slots.entry(key).or_default();
            let start = slot.next_start.map_or(now, |t| t.max(now));
            if start > deadline {
                let wait = start - now;
                drop(slots);
                drop(turn);
                return Err(refuse(
                    format!("at most one request every {} ms", interval.as_millis()),
                    wait,
                ));
            }
            slot.next_start = Some(start + interval);
            start
        };
        tokio::time::sleep_until(start).await;
        Ok(Some(turn))
    }
}

impl Gateway {
    /// `lent` once its request's politeness turn came (the turn is held as long as the lease
    /// is lent); a 429 `politeness_limit` with `Retry-After` when it would wait too long (the
    /// lease goes back).
    pub(super) async fn polite(&self, lent: Lent, domain: Option<&str>) -> Result<Lent, Refusal> {
        if self.polite.entries.is_empty() {
            // Off (the default): nothing to wait for on the request's path.
            return Ok(lent);
        }
        let proxy = lent.proxy().clone();
        match self.polite.turn(&proxy.key, &proxy.attributes, domain).await {
            Ok(turn) => Ok(lent.with_turn(turn)),
            Err(no_turn) => {
                let mut refusal = Refusal::new(
                    hyper::StatusCode::TOO_MANY_REQUESTS,
                    "politeness_limit",
                    no_turn.to_string(),
                );
                refusal.retry_after = Some(no_turn.retry_after);
                Err(refusal)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn polite(min_interval_ms: Option<u64>, max_concurrent: Option<u32>, max_wait_ms: u64) -> Arc<Polite> {
        Arc::new(Polite::new(vec![Politeness {
            domains: vec![
                DomainPattern::Exact("shop.example".into()),
                DomainPattern::Below("news.example".into()),
            ],
            proxies: Vec::new(),
            min_interval: min_interval_ms.map(Duration::from_millis),
            max_concurrent,
            max_wait: Duration::from_millis(max_wait_ms),
        }]))
    }

    fn none() -> Attributes {
        Attributes::default()
    }

    #[test]
    fn domain_patterns() {
        let below = DomainPattern::Below("example.com".into());
        assert!(below.matches("a.example.com") && below.matches("a.b.example.com"));
        assert!(!below.matches("example.com") && !below.matches("badexample.com"));
        assert!(DomainPattern::Exact("example.com".into()).matches("example.com"));
    }

    #[tokio::test(start_paused = true)]
    async fn starts_are_spaced_by_the_interval_within_the_wait_bound() {
        let polite = polite(Some(1_000), None, 2_500);
        let a = ProxyKey::new("crawl", "a");
        let started = Instant::now();
        let mut starts = Vec::new();
        for _ in 0..3 {
            let turn = polite
                .turn(&a, &none(), Some("shop.example"))
                .await
                .expect("a turn");
            assert!(turn.is_some());
            starts.push(Instant::now() - started);
        }
        assert_eq!(
            starts,
            [0, 1_000, 2_000].map(Duration::from_millis),
            "one start a second"
        );
        // Other proxies, other domains and domains no entry names are not held back: an entry's
        // turn (`Some`), or no entry to take a turn of (`None`), at once.
        let b = ProxyKey::new("crawl", "b");
        for (proxy, domain, has_entry) in [
            (&b, Some("shop.example"), true),
            (&a, Some("x.news.example"), true),
            (&a, Some("other.example"), false),
            (&a, None, false),
        ] {
            let turn = polite.turn(proxy, &none(), domain).await.expect("turn");
            assert_eq!(turn.is_some(), has_entry, "{proxy:?} for {domain:?}");
        }
        assert_eq!(Instant::now() - started, Duration::from_millis(2_000));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_would_wait_too_long_is_refused_at_once() {
        let polite = polite(Some(10_000), None, 2_000);
        let a = ProxyKey::new("crawl", "a");
        let _first = polite
            .turn(&a, &none(), Some("shop.example"))
            .await
            .expect("a turn");
        let before = Instant::now();
        let refused = polite
            .turn(&a, &none(), Some("shop.example"))
            .await
            .err()
            .expect("refused");
        assert_eq!(Instant::now(), before, "refused without waiting");
        assert_eq!(refused.retry_after, Duration::from_secs(10));
        assert!(
            refused.to_string().contains("at most one request every 10000 ms"),
            "{refused}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn requests_in_flight_wait_for_a_place() {
        let polite = polite(None, Some(2), 1_000);
        let a = ProxyKey::new("crawl", "a");
        let first = polite
            .turn(&a, &none(), Some("shop.example"))
            .await
            .expect("turn");
        let _second = polite
            .turn(&a, &none(), Some("shop.example"))
            .await
            .expect("turn");
        // The third waits for a place; none is freed within the bound.
        let refused = polite
            .turn(&a, &none(), Some("shop.example"))
            .await
            .err()
            .expect("refused");
        assert!(refused.to_string().contains("in flight, at most 2"), "{refused}");
        // A place freed while it waits lets it through.
        let waiting = {
            let polite = polite.clone();
            let a = a.clone();
            tokio::spawn(async move {
                polite
                    .turn(&a, &none(), Some("shop.example"))
                    .await
                    .map(|t| t.is_some())
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(first);
        assert!(waiting.await.expect("joined").expect("a turn"));
    }
}
