//! The counters behind escalation: how often a rule matched one proxy (per target domain, and
//! over all domains) within the rule's window, and which recycle requests are outstanding.
//!
//! Memory is bounded and documented in docs/gateway.md: at most [`MAX_TRACKED`] (rule, proxy)
//! entries, each with at most [`MAX_DOMAINS`] domain counters plus one over all domains, each
//! counter keeping at most the rule's highest `after` match times (at most
//! [`super::config::MAX_AFTER`]). A full table first forgets entries with no match in their
//! window, then the entry matched the longest ago. Counters of a proxy start again when its
//! endpoint changes (a fresh instance is a fresh address).

use std::collections::VecDeque;

use crate::{api::ProxyKey, hashing::FastMap};

/// Most (rule, proxy) entries kept.
pub const MAX_TRACKED: usize = 16_384;
/// Most domains counted per (rule, proxy); the one matched the longest ago makes room.
pub const MAX_DOMAINS: usize = 32;
/// How long a recycle request stays outstanding (no second request for the proxy) when its
/// endpoint does not change: long enough for a replacement held back by its pool's budget.
pub const RECYCLE_PATIENCE_MS: u64 = 30 * 60 * 1000;

/// Matches within the window, for the domain of this one and for the proxy over all domains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    /// For the target domain (requests without one count as one domain of their own).
    pub domain: u32,
    /// For the proxy, over all domains.
    pub proxy: u32,
}

/// Match times (ms), oldest first, at most `keep`.
#[derive(Default)]
struct Counter(VecDeque<u64>);

impl Counter {
    fn strike(&mut self, now: u64, window_ms: u64, keep: usize) -> u32 {
        self.forget_before(now.saturating_sub(window_ms));
        self.0.push_back(now);
        while self.0.len() > keep.max(1) {
            self.0.pop_front();
        }
        self.0.len() as u32
    }

    fn forget_before(&mut self, since: u64) {
        while self.0.front().is_some_and(|t| *t < since) {
            self.0.pop_front();
        }
    }

    fn last(&self) -> u64 {
        self.0.back().copied().unwrap_or(0)
    }
}

struct Entry {
    endpoint: String,
    window_ms: u64,
    all: Counter,
    domains: Vec<(Option<Box<str>>, Counter)>,
}

/// What a recycle request was made for.
struct Asked {
    endpoint: String,
    at_ms: u64,
}

/// The counters of every rule, and the outstanding recycle requests.
#[derive(Default)]
pub struct Strikes {
    entries: FastMap<(usize, ProxyKey), Entry>,
    recycles: FastMap<ProxyKey, Asked>,
}

impl Strikes {
    /// Counts a match of rule `rule` (window `window_ms`, counters keeping `keep` times) for
    /// `key` at `endpoint` on `domain` at `now` (ms); returns the counts with it.
    #[allow(clippy::too_many_arguments)]
    pub fn strike(
        &mut self,
        rule: usize,
        window_ms: u64,
        keep: usize,
        key: &ProxyKey,
        endpoint: &str,
        domain: Option<&str>,
        now: u64,
    ) -> Counts {
        let id = (rule, key.clone());
        if !self.entries.contains_key(&id) && self.entries.len() >= MAX_TRACKED {
            self.make_room(now);
        }
        let entry = self.entries.entry(id).or_insert_with(|| Entry {
            endpoint: endpoint.to_owned(),
            window_ms,
            all: Counter::default(),
            domains: Vec::new(),
        });
        if entry.endpoint != endpoint {
            // A fresh instance: what the old address earned is not its.
            entry.endpoint = endpoint.to_owned();
            entry.all = Counter::default();
            entry.domains.clear();
        }
        entry.window_ms = window_ms;
        let proxy = entry.all.strike(now, window_ms, keep);
        let at = match entry.domains.iter().position(|(d, _)| d.as_deref() == domain) {
            Some(at) => at,
            None => {
                if entry.domains.len() >= MAX_DOMAINS
                    && let Some(oldest) = (0..entry.domains.len()).min_by_key(|i| entry.domains[*i].1.last())
                {
                    entry.domains.swap_remove(oldest);
                }
                entry.domains.push((domain.map(Into::into), Counter::default()));
                entry.domains.len() - 1
            }
        };
        let domain = entry.domains[at].1.strike(now, window_ms, keep);
        Counts { domain, proxy }
    }

    /// Frees a slot: entries without a match in their window go, else the one matched the
    /// longest ago. Runs only when the table is full.
    fn make_room(&mut self, now: u64) {
        self.entries
            .retain(|_, e| e.all.last() >= now.saturating_sub(e.window_ms));
        if self.entries.len() >= MAX_TRACKED
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.all.last())
                .map(|(id, _)| id.clone())
        {
            self.entries.remove(&oldest);
        }
        let patience = now.saturating_sub(RECYCLE_PATIENCE_MS);
        self.recycles.retain(|_, asked| asked.at_ms >= patience);
    }

    /// Whether a recycle request for `key` at `endpoint` may be made now: none is outstanding
    /// (one for this endpoint, younger than [`RECYCLE_PATIENCE_MS`]). If so it is recorded as
    /// outstanding.
    pub fn may_recycle(&mut self, key: &ProxyKey, endpoint: &str, now: u64) -> bool {
        if let Some(asked) = self.recycles.get(key)
            && asked.endpoint == endpoint
            && now.saturating_sub(asked.at_ms) < RECYCLE_PATIENCE_MS
        {
            return false;
        }
        if self.recycles.len() >= MAX_TRACKED {
            let patience = now.saturating_sub(RECYCLE_PATIENCE_MS);
            self.recycles.retain(|_, asked| asked.at_ms >= patience);
            if self.recycles.len() >= MAX_TRACKED {
                return false;
            }
        }
        self.recycles.insert(
            key.clone(),
            Asked {
                endpoint: endpoint.to_owned(),
                at_ms: now,
            },
        );
        true
    }

    /// The recycle request for `key` could not be made: a later match may try again.
    pub fn recycle_failed(&mut self, key: &ProxyKey) {
        self.recycles.remove(key);
    }

    /// (rule, proxy) entries kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::test_key as key;

    #[test]
    fn counts_per_domain_and_per_proxy_within_the_window() {
        let mut strikes = Strikes::default();
        let a = key("a");
        let expected = [
            ("x.example", 0, Counts { domain: 1, proxy: 1 }),
            ("x.example", 100, Counts { domain: 2, proxy: 2 }),
            ("y.example", 200, Counts { domain: 1, proxy: 3 }),
            // 1,050 ms: the match at 0 left the window.
            ("x.example", 1_050, Counts { domain: 2, proxy: 3 }),
            // Long after: everything left it.
            ("y.example", 10_000, Counts { domain: 1, proxy: 1 }),
        ];
        for (domain, now, counts) in expected {
            let got = strikes.strike(0, 1_000, 10, &a, "h:1", Some(domain), now);
            assert_eq!(got, counts, "{domain} at {now} ms");
        }
    }

    #[test]
    fn rules_and_proxies_count_apart_and_a_new_endpoint_starts_again() {
        let mut strikes = Strikes::default();
        let (a, b) = (key("a"), key("b"));
        strikes.strike(0, 60_000, 10, &a, "h:1", Some("d"), 0);
        assert_eq!(strikes.strike(0, 60_000, 10, &a, "h:1", Some("d"), 1).proxy, 2);
        assert_eq!(strikes.strike(1, 60_000, 10, &a, "h:1", Some("d"), 2).proxy, 1);
        assert_eq!(strikes.strike(0, 60_000, 10, &b, "h:2", Some("d"), 3).proxy, 1);
        assert_eq!(
            strikes.strike(0, 60_000, 10, &a, "h:9", Some("d"), 4),
            Counts { domain: 1, proxy: 1 },
            "a fresh instance starts with nothing"
        );
    }

    #[test]
    fn memory_is_bounded() {
        let mut strikes = Strikes::default();
        let a = key("a");
        // A counter keeps at most `keep` times: the count saturates there.
        for now in 0..100 {
            strikes.strike(0, 60_000, 5, &a, "h:1", Some("d"), now);
        }
        let counts = strikes.strike(0, 60_000, 5, &a, "h:1", Some("d"), 100);
        assert_eq!(counts, Counts { domain: 5, proxy: 5 });
        // Domains beyond MAX_DOMAINS push out the one matched the longest ago.
        for i in 0..(MAX_DOMAINS as u64 + 10) {
            strikes.strike(0, 60_000, 5, &a, "h:1", Some(&format!("d{i}")), 200 + i);
        }
        let entry = strikes.entries.get(&(0, a.clone())).expect("kept");
        assert_eq!(entry.domains.len(), MAX_DOMAINS);
        assert!(entry.domains.iter().all(|(d, _)| d.as_deref() != Some("d0")));
        // Proxies beyond MAX_TRACKED: the table stays at its bound.
        for i in 0..(MAX_TRACKED + 10) {
            strikes.strike(
                0,
                60_000,
                5,
                &key(&format!("p{i}")),
                "h:1",
                Some("d"),
                1_000 + i as u64,
            );
        }
        assert_eq!(strikes.len(), MAX_TRACKED);
    }

    #[test]
    fn one_outstanding_recycle_request_per_proxy() {
        let mut strikes = Strikes::default();
        let a = key("a");
        assert!(strikes.may_recycle(&a, "h:1", 0));
        assert!(!strikes.may_recycle(&a, "h:1", 1_000), "outstanding");
        // Failed: the next match may ask again.
        strikes.recycle_failed(&a);
        assert!(strikes.may_recycle(&a, "h:1", 2_000));
        // Acted on (a new endpoint), or not within the patience: asked again.
        assert!(strikes.may_recycle(&a, "h:2", 3_000));
        assert!(!strikes.may_recycle(&a, "h:2", 4_000));
        assert!(strikes.may_recycle(&a, "h:2", 3_000 + RECYCLE_PATIENCE_MS));
    }
}
