//! The bounded table behind [`super::Outcomes`]: per proxy its totals and its domains' pairs,
//! and two recency indexes (every pair, and each proxy's own) keyed by a sequence number that
//! grows with every record, so the least recently seen pair is the first entry of a `BTreeMap`.
//!
//! Bound, per pair: the [`Pair`] (statistics and a 64-sample window, under 400 bytes) in its
//! proxy's map, an entry in each recency index, and the domain's bytes (up to 253) in one shared
//! `Arc<str>`: at most about 900 bytes. Per proxy (never more proxies than pairs): its totals
//! (another [`Pair`]), its key and its maps' headers: about 500 bytes. So [`Limits::default`]'s
//! 20,000 pairs cost at most about 28 MB, and about 10 MB with 20-character domains and 32 per
//! proxy.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use super::{DomainStats, Limits, ProxyOutcomes, Stats, Tracked, window::Window};
use crate::api::ProxyKey;

/// One pair's (or one proxy's totals') numbers.
#[derive(Clone, Debug, Default)]
pub(super) struct Pair {
    /// Counters; its `latency` stays `None` here (read from `window`).
    pub(super) stats: Stats,
    pub(super) window: Window,
    /// When it was last seen (the table's sequence number).
    seq: u64,
}

impl Pair {
    fn snapshot(&self) -> Stats {
        Stats {
            latency: self.window.quantiles(),
            ..self.stats.clone()
        }
    }
}

#[derive(Default)]
struct ProxyEntry {
    total: Pair,
    domains: HashMap<Arc<str>, Pair>,
    /// Its domains by when each was last seen.
    recency: BTreeMap<u64, Arc<str>>,
}

pub(super) struct Table {
    limits: Limits,
    proxies: HashMap<ProxyKey, ProxyEntry>,
    /// Every pair by when it was last seen.
    recency: BTreeMap<u64, (ProxyKey, Arc<str>)>,
    seq: u64,
    pairs: usize,
    evicted: u64,
}

impl Default for Table {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

impl Table {
    pub(super) fn new(limits: Limits) -> Self {
        Self {
            limits: Limits {
                max_pairs: limits.max_pairs.max(1),
                max_domains_per_proxy: limits.max_domains_per_proxy.max(1),
            },
            proxies: HashMap::new(),
            recency: BTreeMap::new(),
            seq: 0,
            pairs: 0,
            evicted: 0,
        }
    }

    /// Applies `update` to the pair (`proxy`, `domain`) and to the proxy's totals, making room
    /// for a new pair first, and marks the pair the most recently seen.
    pub(super) fn record(&mut self, proxy: &ProxyKey, domain: &str, update: impl Fn(&mut Pair)) {
        let known = self
            .proxies
            .get(proxy)
            .is_some_and(|entry| entry.domains.contains_key(domain));
        if !known {
            if self
                .proxies
                .get(proxy)
                .is_some_and(|entry| entry.domains.len() >= self.limits.max_domains_per_proxy)
            {
                self.evict_oldest_of(proxy);
            }
            if self.pairs >= self.limits.max_pairs {
                self.evict_oldest();
            }
        }
        self.seq += 1;
        let seq = self.seq;
        let entry = self.proxies.entry(proxy.clone()).or_default();
        let domain: Arc<str> = match entry.domains.get_key_value(domain) {
            Some((name, pair)) => {
                let name = name.clone();
                entry.recency.remove(&pair.seq);
                self.recency.remove(&pair.seq);
                name
            }
            None => {
                let name: Arc<str> = domain.into();
                entry.domains.insert(name.clone(), Pair::default());
                self.pairs += 1;
                name
            }
        };
        entry.recency.insert(seq, domain.clone());
        self.recency.insert(seq, (proxy.clone(), domain.clone()));
        let pair = entry
            .domains
            .get_mut(&domain)
            .expect("the pair was found or inserted just above");
        pair.seq = seq;
        update(pair);
        entry.total.seq = seq;
        update(&mut entry.total);
    }

    /// Evicts the least recently seen pair of all.
    fn evict_oldest(&mut self) {
        let Some((seq, (proxy, domain))) = self.recency.pop_first() else {
            return;
        };
        let Some(entry) = self.proxies.get_mut(&proxy) else {
            return;
        };
        entry.recency.remove(&seq);
        entry.domains.remove(&domain);
        self.pairs -= 1;
        self.evicted += 1;
        if entry.domains.is_empty() {
            self.proxies.remove(&proxy);
        }
    }

    /// Evicts `proxy`'s least recently seen pair.
    fn evict_oldest_of(&mut self, proxy: &ProxyKey) {
        let Some(entry) = self.proxies.get_mut(proxy) else {
            return;
        };
        let Some((seq, domain)) = entry.recency.pop_first() else {
            return;
        };
        entry.domains.remove(&domain);
        self.recency.remove(&seq);
        self.pairs -= 1;
        self.evicted += 1;
    }

    /// The proxies tracked.
    pub(super) fn proxy_keys(&self) -> Vec<ProxyKey> {
        self.proxies.keys().cloned().collect()
    }

    /// Forgets `gone` proxies and their pairs (not counted as evicted).
    pub(super) fn forget(&mut self, gone: &[ProxyKey]) {
        for proxy in gone {
            let Some(entry) = self.proxies.remove(proxy) else {
                continue;
            };
            for seq in entry.recency.keys() {
                self.recency.remove(seq);
            }
            self.pairs -= entry.domains.len();
        }
    }

    pub(super) fn pair(&self, proxy: &ProxyKey, domain: &str) -> Option<Stats> {
        Some(self.proxies.get(proxy)?.domains.get(domain)?.snapshot())
    }

    pub(super) fn proxy(&self, proxy: &ProxyKey, top: usize, also: Option<&str>) -> Option<ProxyOutcomes> {
        let entry = self.proxies.get(proxy)?;
        let mut domains: Vec<(&Arc<str>, &Pair)> = entry.domains.iter().collect();
        domains.sort_unstable_by(|(a, x), (b, y)| {
            (y.stats.requests.cmp(&x.stats.requests)).then_with(|| a.cmp(b))
        });
        // `also` is listed after the top ones when it is not among them.
        let extra = also
            .and_then(|d| domains.iter().skip(top).find(|(name, _)| &***name == d))
            .copied();
        let other_domains = domains.len().saturating_sub(top) - usize::from(extra.is_some());
        Some(ProxyOutcomes {
            total: entry.total.snapshot(),
            domains: (domains.into_iter().take(top).chain(extra))
                .map(|(domain, pair)| DomainStats {
                    domain: domain.to_string(),
                    stats: pair.snapshot(),
                })
                .collect(),
            other_domains,
        })
    }

    pub(super) fn totals(&self) -> Vec<(ProxyKey, Stats)> {
        let mut totals: Vec<(ProxyKey, Stats)> = self
            .proxies
            .iter()
            .map(|(key, entry)| (key.clone(), entry.total.snapshot()))
            .collect();
        totals.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        totals
    }

    pub(super) fn tracked(&self) -> Tracked {
        Tracked {
            pairs: self.pairs,
            proxies: self.proxies.len(),
            evicted: self.evicted,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap as Model, HashSet};

    use proptest::prelude::*;

    use super::*;

    fn key(n: u8) -> ProxyKey {
        ProxyKey::new("crawl", &format!("p{n}"))
    }

    fn count(pair: &mut Pair) {
        pair.stats.requests += 1;
    }

    #[test]
    fn a_pair_stays_small() {
        // The byte bound in the module's doc (and docs/gateway.md) counts on it.
        assert!(
            std::mem::size_of::<Pair>() <= 400,
            "{}",
            std::mem::size_of::<Pair>()
        );
    }

    #[test]
    fn the_least_recently_seen_pair_goes_first() {
        let mut table = Table::new(Limits {
            max_pairs: 3,
            max_domains_per_proxy: 2,
        });
        table.record(&key(1), "a.example", count);
        table.record(&key(1), "b.example", count);
        // Seen again: now the most recent of p1's.
        table.record(&key(1), "a.example", count);
        // A third domain for p1 evicts p1's least recent, b.example.
        table.record(&key(1), "c.example", count);
        assert!(table.pair(&key(1), "b.example").is_none());
        assert_eq!(table.pair(&key(1), "a.example").map(|s| s.requests), Some(2));
        // Totals keep what was evicted.
        assert_eq!(table.proxy(&key(1), 5, None).map(|p| p.total.requests), Some(4));
        // A third pair fits; a fourth evicts the oldest of all (p1's a.example).
        table.record(&key(2), "a.example", count);
        table.record(&key(3), "a.example", count);
        assert!(table.pair(&key(1), "a.example").is_none());
        assert!(table.pair(&key(1), "c.example").is_some());
        assert_eq!(
            table.tracked(),
            Tracked {
                pairs: 3,
                proxies: 3,
                evicted: 2
            }
        );
        // p1's last pair goes: p1 is forgotten.
        table.record(&key(4), "a.example", count);
        assert!(table.proxy(&key(1), 5, None).is_none());
        assert_eq!(table.tracked().proxies, 3);
        // A proxy gone from the pool is forgotten with its pairs, and room is made.
        table.forget(&[key(2), key(9)]);
        assert!(table.pair(&key(2), "a.example").is_none());
        assert_eq!((table.tracked().pairs, table.recency.len()), (2, 2));
        table.record(&key(5), "a.example", count);
        assert!(table.pair(&key(3), "a.example").is_some(), "nothing evicted");
    }

    #[test]
    fn a_domain_asked_for_is_listed_after_the_top_ones() {
        let mut table = Table::default();
        for (domain, n) in [("a.example", 3), ("b.example", 2), ("c.example", 1)] {
            for _ in 0..n {
                table.record(&key(1), domain, count);
            }
        }
        let listed = |also| {
            let p = table.proxy(&key(1), 1, also).expect("tracked");
            let names: Vec<String> = p.domains.into_iter().map(|d| d.domain).collect();
            (names, p.other_domains)
        };
        assert_eq!(listed(None), (vec!["a.example".to_owned()], 2));
        assert_eq!(
            listed(Some("c.example")),
            (vec!["a.example".to_owned(), "c.example".to_owned()], 1)
        );
        assert_eq!(listed(Some("a.example")), (vec!["a.example".to_owned()], 2));
        assert_eq!(listed(Some("z.example")), (vec!["a.example".to_owned()], 2));
    }

    proptest! {
        /// Whatever is recorded, the caps hold, the indexes agree with the pairs, and what is
        /// tracked is exactly the most recently seen pairs a model keeping the same rule keeps.
        #[test]
        fn caps_hold_and_the_most_recent_pairs_stay(
            max_pairs in 1usize..12,
            max_domains in 1usize..5,
            records in prop::collection::vec((0u8..6, 0u8..8), 0..200),
        ) {
            let mut table = Table::new(Limits { max_pairs, max_domains_per_proxy: max_domains });
            // The model: each pair's last time; eviction by the same rule, done naively.
            let mut model: Model<(u8, u8), usize> = Model::new();
            for (t, &(p, d)) in records.iter().enumerate() {
                table.record(&key(p), &format!("d{d}.example"), count);
                if !model.contains_key(&(p, d)) {
                    let of_p: Vec<((u8, u8), usize)> =
                        model.iter().filter(|((q, _), _)| *q == p).map(|(k, v)| (*k, *v)).collect();
                    if of_p.len() >= max_domains
                        && let Some((oldest, _)) = of_p.iter().min_by_key(|(_, t)| *t)
                    {
                        model.remove(oldest);
                    }
                    if model.len() >= max_pairs
                        && let Some((&oldest, _)) = model.iter().min_by_key(|(_, t)| **t)
                    {
                        model.remove(&oldest);
                    }
                }
                model.insert((p, d), t);

                let tracked = table.tracked();
                prop_assert!(tracked.pairs <= max_pairs);
                prop_assert_eq!(tracked.pairs, table.recency.len());
                prop_assert!(tracked.proxies <= tracked.pairs);
                for entry in table.proxies.values() {
                    prop_assert!(entry.domains.len() <= max_domains);
                    prop_assert!(!entry.domains.is_empty());
                    prop_assert_eq!(entry.domains.len(), entry.recency.len());
                }
            }
            let tracked: HashSet<(u8, u8)> = (0..6u8)
                .flat_map(|p| (0..8u8).map(move |d| (p, d)))
                .filter(|&(p, d)| table.pair(&key(p), &format!("d{d}.example")).is_some())
                .collect();
            let expected: HashSet<(u8, u8)> = model.keys().copied().collect();
            prop_assert_eq!(tracked, expected);
        }
    }
}
