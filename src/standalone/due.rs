//! When each Proxy is next reconciled, kept by key (a reconcile moves its own time) and by time
//! (the runner asks what is due and when the next one is), so a round costs what is due rather
//! than a scan of every Proxy: a pool of 10,000 at rest has a round dozens of times a second
//! (their resyncs are spread over the period), and the two scans of every Proxy a round were
//! most of what the runner did.

use std::collections::{BTreeSet, HashMap};

use tokio::time::Instant;

use crate::api::ProxyKey;

/// Each Proxy's next reconcile.
#[derive(Default)]
pub(super) struct DueQueue {
    by_key: HashMap<ProxyKey, Instant>,
    by_time: BTreeSet<(Instant, ProxyKey)>,
}

impl DueQueue {
    /// `key` is next due at `at` (replacing any time it had).
    pub(super) fn insert(&mut self, key: ProxyKey, at: Instant) {
        if let Some(old) = self.by_key.insert(key.clone(), at) {
            self.by_time.remove(&(old, key.clone()));
        }
        self.by_time.insert((at, key));
    }

    /// `key` is not due at all (only a trigger brings it back).
    pub(super) fn remove(&mut self, key: &ProxyKey) {
        if let Some(at) = self.by_key.remove(key) {
            self.by_time.remove(&(at, key.clone()));
        }
    }

    /// The Proxies due at `now`, soonest first; they stay in the queue until moved or removed.
    pub(super) fn due_at(&self, now: Instant) -> Vec<ProxyKey> {
        self.by_time
            .iter()
            .take_while(|(at, _)| *at <= now)
            .map(|(_, key)| key.clone())
            .collect()
    }

    /// When the next Proxy is due, if any is.
    pub(super) fn next(&self) -> Option<Instant> {
        self.by_time.first().map(|(at, _)| *at)
    }
}

impl FromIterator<(ProxyKey, Instant)> for DueQueue {
    fn from_iter<I: IntoIterator<Item = (ProxyKey, Instant)>>(entries: I) -> Self {
        let mut queue = Self::default();
        for (key, at) in entries {
            queue.insert(key, at);
        }
        queue
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::api::test_key as key;

    #[test]
    fn lists_what_is_due_soonest_first_and_a_new_time_replaces_the_old() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut queue: DueQueue = [
            (key("c"), t0 + s(3)),
            (key("a"), t0 + s(1)),
            (key("b"), t0 + s(2)),
        ]
        .into_iter()
        .collect();
        assert_eq!(queue.next(), Some(t0 + s(1)));
        assert_eq!(queue.due_at(t0), Vec::<ProxyKey>::new());
        assert_eq!(queue.due_at(t0 + s(2)), [key("a"), key("b")]);
        // Listing takes nothing out: a reconcile moves or removes its own key.
        assert_eq!(queue.due_at(t0 + s(2)), [key("a"), key("b")]);
        queue.insert(key("a"), t0 + s(10));
        assert_eq!(queue.due_at(t0 + s(3)), [key("b"), key("c")]);
        assert_eq!(queue.next(), Some(t0 + s(2)));
        queue.remove(&key("b"));
        queue.remove(&key("b"));
        assert_eq!(queue.due_at(t0 + s(10)), [key("c"), key("a")]);
        // Two keys due at the same instant are both kept.
        queue.insert(key("d"), t0 + s(3));
        assert_eq!(queue.due_at(t0 + s(3)), [key("c"), key("d")]);
        for name in ["a", "c", "d"] {
            queue.remove(&key(name));
        }
        assert_eq!(queue.next(), None);
        assert!(queue.by_key.is_empty() && queue.by_time.is_empty());
    }
}
