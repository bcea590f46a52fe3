//! A bounded table of counters by name: at most `cap` names; when a new one comes to a full
//! table, the least recently seen tenth is evicted at once. Seeing a known name is one lookup
//! and a store of its stamp (this is on every acquire and release); the order is only worked
//! out when evicting, once per a tenth of the table's new names. Each entry costs its name
//! plus about 100 bytes: with names of at most 128 bytes (holders) a full table of 10,000
//! stays under 3 MB.

use super::Counters;
use crate::hashing::FastMap;

struct Entry {
    counters: Counters,
    /// When it was last seen, in the table's own order (unique per entry).
    seen: u64,
}

pub(super) struct Table {
    cap: usize,
    /// Every acquire and release looks up two names ([`FastMap`]: SipHash cost about 800
    /// instructions a pair).
    entries: FastMap<Box<str>, Entry>,
    next: u64,
}

impl Table {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            entries: FastMap::default(),
            next: 0,
        }
    }

    /// Changes `name`'s counters with `change`, adding it (and evicting the least recently
    /// seen tenth when full) if it is new; it is now the most recently seen.
    pub(super) fn add(&mut self, name: &str, change: impl FnOnce(&mut Counters)) {
        self.next += 1;
        let seen = self.next;
        if let Some(entry) = self.entries.get_mut(name) {
            entry.seen = seen;
            change(&mut entry.counters);
            return;
        }
        if self.entries.len() >= self.cap {
            self.evict_least_recent();
        }
        let mut counters = Counters::default();
        change(&mut counters);
        self.entries.insert(name.into(), Entry { counters, seen });
    }

    /// Evicts the least recently seen tenth (at least one): a linear selection, paid once per
    /// that many new names rather than an ordered index kept on every sighting.
    fn evict_least_recent(&mut self) {
        let count = (self.cap / 10).clamp(1, self.entries.len());
        let mut stamps: Vec<u64> = self.entries.values().map(|e| e.seen).collect();
        let (_, &mut cut, _) = stamps.select_nth_unstable(count - 1);
        self.entries.retain(|_, e| e.seen > cut);
    }

    pub(super) fn get(&self, name: &str) -> Option<Counters> {
        self.entries.get(name).map(|e| e.counters)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&str, &Counters)> {
        self.entries.iter().map(|(k, e)| (&**k, &e.counters))
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
}
