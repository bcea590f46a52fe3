//! A bounded table of counters by name: at most `cap` names, the least recently seen evicted
//! when a new one comes. Each entry costs its name twice (the map's key and the recency
//! index's, shared through one `Arc<str>`) plus about 100 bytes: with names of at most 128
//! bytes (holders) a full table of 10,000 stays under 3 MB.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use super::Counters;

struct Entry {
    counters: Counters,
    /// When it was last seen, in the table's own order (unique per entry).
    seen: u64,
}

pub(super) struct Table {
    cap: usize,
    entries: HashMap<Arc<str>, Entry>,
    /// Names by when they were last seen: the first is the next evicted.
    recency: BTreeMap<u64, Arc<str>>,
    next: u64,
}

impl Table {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            entries: HashMap::new(),
            recency: BTreeMap::new(),
            next: 0,
        }
    }

    /// Changes `name`'s counters with `change`, adding it (and evicting the least recently
    /// seen when full) if it is new; it is now the most recently seen.
    pub(super) fn add(&mut self, name: &str, change: impl FnOnce(&mut Counters)) {
        let seen = self.next;
        self.next += 1;
        if let Some(entry) = self.entries.get_mut(name) {
            self.recency.remove(&entry.seen);
            entry.seen = seen;
            change(&mut entry.counters);
            let key = self
                .entries
                .get_key_value(name)
                .map(|(k, _)| k.clone())
                .unwrap_or_else(|| name.into());
            self.recency.insert(seen, key);
            return;
        }
        while self.entries.len() >= self.cap {
            let Some((_, oldest)) = self.recency.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
        let key: Arc<str> = name.into();
        let mut counters = Counters::default();
        change(&mut counters);
        self.entries.insert(key.clone(), Entry { counters, seen });
        self.recency.insert(seen, key);
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
