//! What the page remembers per proxy: the last audit entries and health verdict changes.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
};

use jiff::Timestamp;

use super::AUDIT_ENTRIES_SHOWN;
use crate::{
    health::{HealthEvent, Verdict},
    machine::audit::AuditEntry,
};

/// One audit entry as the page shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    /// When the transition was decided.
    pub at: Timestamp,
    /// `from --event--> to`.
    pub arrow: String,
    /// The row's reason.
    pub reason: String,
    /// The cause or message (never secret content).
    pub message: String,
}

impl AuditRow {
    /// The row of an audit entry.
    pub fn from_entry(entry: &AuditEntry, message: &str) -> Self {
        let message = if message.is_empty() {
            entry.cause.clone().unwrap_or_default()
        } else {
            message.to_owned()
        };
        Self {
            at: entry.at,
            arrow: entry.arrow(),
            reason: entry.reason.clone(),
            message,
        }
    }
}

/// A Proxy's namespace and name.
type NameKey = (String, String);

/// The last entries per proxy (by namespace and name), at most [`AUDIT_ENTRIES_SHOWN`] each;
/// cheap to clone (clones share the entries).
pub struct Recent<T> {
    entries: Arc<Mutex<HashMap<NameKey, VecDeque<T>>>>,
}

impl<T> Clone for Recent<T> {
    fn clone(&self) -> Self {
        Self {
            entries: self.entries.clone(),
        }
    }
}

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Self {
            entries: Arc::default(),
        }
    }
}

impl<T: Clone> Recent<T> {
    /// Appends `items` to `namespace/name`'s entries, dropping the oldest beyond the limit.
    pub fn push(&self, namespace: &str, name: &str, items: impl IntoIterator<Item = T>) {
        let mut all = crate::sync::lock(&self.entries);
        let trail = all.entry((namespace.to_owned(), name.to_owned())).or_default();
        for item in items {
            if trail.len() == AUDIT_ENTRIES_SHOWN {
                trail.pop_front();
            }
            trail.push_back(item);
        }
    }

    /// Forgets a Proxy that is gone.
    pub fn forget(&self, namespace: &str, name: &str) {
        self.retain(|ns, n| (ns, n) != (namespace, name));
    }

    /// Keeps the entries of the Proxies `keep` accepts (by namespace and name).
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let mut all = crate::sync::lock(&self.entries);
        all.retain(|(namespace, name), _| keep(namespace, name));
    }

    /// The last `n` entries of `namespace/name`, oldest first.
    pub fn last(&self, namespace: &str, name: &str, n: usize) -> Vec<T> {
        let all = crate::sync::lock(&self.entries);
        all.get(&(namespace.to_owned(), name.to_owned()))
            .map(|trail| {
                trail
                    .iter()
                    .skip(trail.len().saturating_sub(n))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The last audit entries per proxy, kept in memory as the reconciler produces them (cluster
/// mode, whose audit otherwise lives only in Events and logs).
pub type AuditLog = Recent<AuditRow>;

impl AuditLog {
    /// Records the entries a reconcile of `namespace/name` produced.
    pub fn record<'a>(&self, namespace: &str, name: &str, entries: impl IntoIterator<Item = &'a AuditEntry>) {
        self.push(
            namespace,
            name,
            entries.into_iter().map(|entry| AuditRow::from_entry(entry, "")),
        );
    }

    /// Puts `older` rows (from before this process, any order) in front of `namespace/name`'s
    /// trail: only those older than its first row (a transition this process recorded may also
    /// be among them, published after it was decided), keeping the last [`AUDIT_ENTRIES_SHOWN`].
    pub fn seed(&self, namespace: &str, name: &str, mut older: Vec<AuditRow>) {
        let mut all = crate::sync::lock(&self.entries);
        let trail = all.entry((namespace.to_owned(), name.to_owned())).or_default();
        if let Some(first) = trail.front() {
            older.retain(|row| row.at < first.at);
        }
        older.sort_by_key(|row| row.at);
        for row in older.into_iter().rev() {
            if trail.len() == AUDIT_ENTRIES_SHOWN {
                break;
            }
            trail.push_front(row);
        }
    }
}

/// A change of a proxy's health verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthChange {
    /// When the verdict changed.
    pub at: Timestamp,
    /// The new verdict.
    pub verdict: Verdict,
    /// The last probe's error, when failing.
    pub error: Option<String>,
}

/// The health engine's last verdict changes per proxy (both modes record them as the engine
/// reports them; the engine itself keeps only the current verdict).
pub type HealthLog = Recent<HealthChange>;

impl HealthLog {
    /// Records one verdict change.
    pub fn record(&self, event: &HealthEvent) {
        self.push(
            event.key.namespace(),
            event.key.name(),
            [HealthChange {
                at: event.at,
                verdict: event.verdict,
                error: event.last_error.clone(),
            }],
        );
    }
}
