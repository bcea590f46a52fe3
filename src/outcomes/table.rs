//! The bounded table behind [`super::Outcomes`]: per proxy its totals and its domains' pairs,
//! each stamped with a sequence number that grows with every record. Recording a known pair is
//! two lookups and a stamp (it happens on every gateway request and outcome report); the order
//! is worked out only when something must be evicted: a proxy's least recently seen domain
//! when it has its cap's worth (a scan of at most that many), and, when the whole table is
//! full, its least recently seen tenth at once (a linear selection, paid once per a tenth of
//! the cap's new pairs).
//!
//! Bound, per pair: the [`Pair`] (statistics and a 64-sample window, under 400 bytes) in its
//! proxy's map and the domain's bytes (up to 253): at most about 700 bytes. Per proxy (never
//! more proxies than pairs): its totals (another [`Pair`]), its key and its map's header: about
//! 500 bytes. So [`Limits::default`]'s 20,000 pairs cost at most about 24 MB, and about 9 MB
//! with 20-character domains and 32 per proxy.

use super::{DomainStats, Limits, ProxyOutcomes, Stats, Tracked, window::Window};
use crate::{api::ProxyKey, hashing::FastMap};

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
    domains: FastMap<Box<str>, Pair>,
}

pub(super) struct Table {
    limits: Limits,
    proxies: FastMap<ProxyKey, ProxyEntry>,
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
            proxies: FastMap::default(),
            seq: 0,
            pairs: 0,
            evicted: 0,
        }
    }

    /// Applies `update` to the pair (`proxy`, `domain`) and to the proxy's totals, making room
    /// for a new pair first, and marks the pair the most recently seen.
    pub(super) fn record(&mut self, proxy: &ProxyKey, domain: &str, update: impl Fn(&mut Pair)) {
        self.seq += 1;
        let seq = self.seq;
        if let Some(entry) = self.proxies.get_mut(proxy)
            && let Some(pair) = entry.domains.get_mut(domain)
        {
            pair.seq = seq;
            update(pair);
            entry.total.seq = seq;
            update(&mut entry.total);
            return;
        }
        if let Some(entry) = self.proxies.get_mut(proxy)
            && entry.domains.len() >= self.limits.max_domains_per_proxy
            && let Some(oldest) = entry
                .domains
                .iter()
                .min_by_key(|(_, pair)| pair.seq)
                .map(|(d, _)| d.clone())
        {
            entry.domains.remove(&oldest);
            self.pairs -= 1;
            self.evicted += 1;
        }
        if self.pairs >= self.limits.max_pairs {
            self.evict_least_recent();
        }
        let entry = self.proxies.entry(proxy.clone()).or_default();
        let mut pair = Pair {
            seq,
            ..Pair::default()
        };
        update(&mut pair);
        entry.domains.insert(domain.into(), pair);
        self.pairs += 1;
        entry.total.seq = seq;
        update(&mut entry.total);
    }

    /// Evicts the least recently seen tenth of all pairs (at least one); a proxy left without
    /// pairs is forgotten.
    fn evict_least_recent(&mut self) {
        let mut stamps: Vec<u64> = (self.proxies.values())
            .flat_map(|entry| entry.domains.values().map(|pair| pair.seq))
            .collect();
        if stamps.is_empty() {
            return;
        }
        let count = (self.limits.max_pairs / 10).clamp(1, stamps.len());
        let (_, &mut cut, _) = stamps.select_nth_unstable(count - 1);
        let mut evicted = 0;
        self.proxies.retain(|_, entry| {
            let before = entry.domains.len();
            entry.domains.retain(|_, pair| pair.seq > cut);
            evicted += before - entry.domains.len();
            !entry.domains.is_empty()
        });
        self.pairs -= evicted;
        self.evicted += evicted as u64;
    }

    /// The proxies tracked.
    pub(super) fn proxy_keys(&self) -> Vec<ProxyKey> {
        self.proxies.keys().cloned().collect()
    }

    /// Forgets `gone` proxies and their pairs (not counted as evicted).
    pub(super) fn forget(&mut self, gone: &[ProxyKey]) {
        for proxy in gone {
            if let Some(entry) = self.proxies.remove(proxy) {
                self.pairs -= entry.domains.len();
            }
        }
    }

    pub(super) fn pair(&self, proxy: &ProxyKey, domain: &str) -> Option<Stats> {
        Some(self.proxies.get(proxy)?.domains.get(domain)?.snapshot())
    }

    pub(super) fn proxy(&self, proxy: &ProxyKey, top: usize, also: Option<&str>) -> Option<ProxyOutcomes> {
        let entry = self.proxies.get(proxy)?;
        let mut domains: Vec<(&Box<str>, &Pair)> = entry.domains.iter().collect();
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
        assert_eq!(table.tracked().pairs, 2);
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
            max_pairs in 1usize..30,
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
                    if model.len() >= max_pairs {
                        // A full table forgets its least recently seen tenth (at least one).
                        let mut by_age: Vec<((u8, u8), usize)> = model.iter().map(|(k, v)| (*k, *v)).collect();
                        by_age.sort_by_key(|(_, t)| *t);
                        for (oldest, _) in by_age.iter().take((max_pairs / 10).max(1)) {
                            model.remove(oldest);
                        }
                    }
                }
                model.insert((p, d), t);

                let tracked = table.tracked();
                prop_assert!(tracked.pairs <= max_pairs);
                prop_assert_eq!(tracked.pairs, table.proxies.values().map(|e| e.domains.len()).sum::<usize>());
                prop_assert!(tracked.proxies <= tracked.pairs);
                for entry in table.proxies.values() {
                    prop_assert!(entry.domains.len() <= max_domains);
                    prop_assert!(!entry.domains.is_empty());
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
