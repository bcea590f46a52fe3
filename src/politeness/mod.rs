//! Politeness: per proxy × target domain, a minimum interval between the starts of two
//! requests and a limit on requests in flight, declared in the rules file (`politeness:`, off
//! by default; docs/gateway.md). One state serves both ways to a proxy: the gateway's requests
//! wait for their turn ([`Politeness::turn`]) up to the entry's `maxWaitMs` (one that would wait
//! longer is refused); a lease acquired for a domain, and each outcome a holder reports, reserve
//! the start of the holder's next request ([`Politeness::reserve_start`]), which the lease API
//! answers as `notBefore`. The operator cannot hold back a lease holder's own requests, so the
//! in-flight limit counts the gateway's only; the interval spaces everyone's starts.
//!
//! A turn reserves its start time at once (later requests queue behind it), so waiting for the
//! interval needs no polling; a request waiting for a place in flight is woken when one is
//! freed. State is one entry per (proxy, domain) with requests in flight or a reserved start
//! ahead; idle ones are swept once [`MAX_TRACKED`] are kept, and beyond that bound (all busy)
//! a request goes unlimited rather than unserved.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use crate::{api::Attributes, api::ProxyKey, hashing::FastMap, outcomes::normalize_domain, sync::lock};

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
pub struct PolitenessEntry {
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

impl PolitenessEntry {
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

impl Slot {
    /// The earliest start from `now` after every one reserved so far, reserved (the next one
    /// is then `interval` later) unless it falls after `deadline`: then `Err` with that start.
    fn reserve(
        &mut self,
        now: Instant,
        interval: Duration,
        deadline: Option<Instant>,
    ) -> Result<Instant, Instant> {
        let start = self.next_start.map_or(now, |t| t.max(now));
        if deadline.is_some_and(|deadline| start > deadline) {
            return Err(start);
        }
        self.next_start = Some(start + interval);
        Ok(start)
    }
}

/// The limits and their state, shared by the gateway and the lease API; cheap to clone.
#[derive(Clone, Default)]
pub struct Politeness(Arc<Limits>);

#[derive(Default)]
struct Limits {
    entries: Vec<PolitenessEntry>,
    slots: Mutex<FastMap<(ProxyKey, String), Slot>>,
}

/// A request's place in flight; dropping it frees the place.
pub struct Turn {
    limits: Arc<Limits>,
    key: (ProxyKey, String),
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut slots = lock(&self.limits.slots);
        if let Some(slot) = slots.get_mut(&self.key) {
            slot.in_flight = slot.in_flight.saturating_sub(1);
            slot.freed.notify_one();
        }
    }
}

impl Politeness {
    /// Limits from the rules file's entries.
    pub fn new(entries: Vec<PolitenessEntry>) -> Self {
        Self(Arc::new(Limits {
            entries,
            slots: Mutex::new(FastMap::default()),
        }))
    }

    /// Whether no entry is declared (the default): nothing to wait for.
    pub fn is_off(&self) -> bool {
        self.0.entries.is_empty()
    }

    /// A turn for a request through `proxy` (with `attributes`) to `domain`: at once, after
    /// waiting within the entry's bound, or refused. `None` when no entry applies.
    pub async fn turn(
        &self,
        proxy: &ProxyKey,
        attributes: &Attributes,
        domain: Option<&str>,
    ) -> Result<Option<Turn>, NoTurn> {
        let Some(domain) = domain.map(normalize_domain) else {
            return Ok(None);
        };
        let Some(entry) = self.entry(attributes, &domain) else {
            return Ok(None);
        };
        let key = (proxy.clone(), domain);
        let domain = key.1.as_str();
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
                let mut slots = lock(&self.0.slots);
                let Some(slot) = slot_of(&mut slots, &key) else {
                    return Ok(None);
                };
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
            limits: self.0.clone(),
            key: key.clone(),
        };
        let Some(interval) = entry.min_interval else {
            return Ok(Some(turn));
        };
        let start = {
            let mut slots = lock(&self.0.slots);
            let now = Instant::now();
            let Some(slot) = slot_of(&mut slots, &key) else {
                return Ok(Some(turn));
            };
            match slot.reserve(now, interval, Some(deadline)) {
                Ok(start) => start,
                Err(start) => {
                    drop(slots);
                    drop(turn);
                    return Err(refuse(
                        format!("at most one request every {} ms", interval.as_millis()),
                        start - now,
                    ));
                }
            }
        };
        tokio::time::sleep_until(start).await;
        Ok(Some(turn))
    }

    /// Reserves the start of a request through `proxy` (with `attributes`) to `domain` that
    /// the operator does not forward (a lease holder's own): the earliest start after every
    /// one reserved so far, which later requests (the gateway's too) queue behind. Answers
    /// how long from now that start is; `None` when no entry with an interval applies (the
    /// request may go at once).
    pub fn reserve_start(&self, proxy: &ProxyKey, attributes: &Attributes, domain: &str) -> Option<Duration> {
        if self.is_off() {
            return None;
        }
        let domain = normalize_domain(domain);
        let interval = self.entry(attributes, &domain)?.min_interval?;
        let mut slots = lock(&self.0.slots);
        let slot = slot_of(&mut slots, &(proxy.clone(), domain))?;
        let now = Instant::now();
        let start = slot.reserve(now, interval, None).ok()?;
        Some(start - now)
    }

    fn entry(&self, attributes: &Attributes, domain: &str) -> Option<&PolitenessEntry> {
        self.0.entries.iter().find(|e| e.applies(attributes, domain))
    }
}

/// The slot of `key`, made if needed; `None` when [`MAX_TRACKED`] busy ones are kept (the
/// request then goes unlimited rather than unserved).
fn slot_of<'a>(
    slots: &'a mut FastMap<(ProxyKey, String), Slot>,
    key: &(ProxyKey, String),
) -> Option<&'a mut Slot> {
    if !slots.contains_key(key) && slots.len() >= MAX_TRACKED {
        let now = Instant::now();
        slots.retain(|_, s| s.in_flight > 0 || s.next_start.is_some_and(|t| t > now));
        if slots.len() >= MAX_TRACKED {
            tracing::debug!(proxy = %key.0, domain = key.1, "politeness table full: unlimited");
            return None;
        }
    }
    Some(slots.entry(key.clone()).or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn polite(min_interval_ms: Option<u64>, max_concurrent: Option<u32>, max_wait_ms: u64) -> Politeness {
        Politeness::new(vec![PolitenessEntry {
            domains: vec![
                DomainPattern::Exact("shop.example".into()),
                DomainPattern::Below("news.example".into()),
            ],
            proxies: Vec::new(),
            min_interval: min_interval_ms.map(Duration::from_millis),
            max_concurrent,
            max_wait: Duration::from_millis(max_wait_ms),
        }])
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

    #[tokio::test(start_paused = true)]
    async fn lease_holders_reserve_starts_that_the_gateway_queues_behind() {
        let shared = polite(Some(1_000), None, 5_000);
        let a = ProxyKey::new("crawl", "a");
        let reserve = |domain| shared.reserve_start(&a, &none(), domain);
        assert_eq!(reserve("shop.example"), Some(Duration::ZERO));
        assert_eq!(
            reserve("SHOP.example."),
            Some(Duration::from_secs(1)),
            "one domain, however written"
        );
        assert_eq!(reserve("other.example"), None, "no entry covers it");
        let started = Instant::now();
        let turn = shared
            .turn(&a, &none(), Some("shop.example"))
            .await
            .expect("a turn");
        assert!(turn.is_some());
        assert_eq!(
            Instant::now() - started,
            Duration::from_secs(2),
            "after both reserved starts"
        );
        assert_eq!(reserve("shop.example"), Some(Duration::from_secs(1)));
        // Limits on requests in flight do not apply to requests the operator does not forward.
        let in_flight_only = polite(None, Some(1), 1_000);
        assert_eq!(in_flight_only.reserve_start(&a, &none(), "shop.example"), None);
    }
}
