//! Per-instance-name locks shared by the providers that act on one backend object in several
//! steps (`local`, `kvm`, `kvm2`), so two calls of one provider object never interleave the
//! steps of creating, deleting or restarting the same instance. Across processes, leader
//! election (cluster mode) or one operator per state folder (standalone) keeps one actor.
//!
//! It owns nothing else; the providers decide what a lock covers.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use crate::sync::lock;

type LockMap = Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>;

/// One async lock per instance name, dropped from the map when nobody holds or waits for it.
#[derive(Default)]
pub struct NameLocks {
    locks: Arc<LockMap>,
}

/// Holds the lock of one name until dropped. It owns what it needs, so it can be moved into a
/// blocking task that outlives the caller's wait.
pub struct NameGuard {
    locks: Arc<LockMap>,
    name: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl NameLocks {
    fn entry(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.locks).entry(name.to_owned()).or_default().clone()
    }

    fn guard(&self, name: &str, guard: tokio::sync::OwnedMutexGuard<()>) -> NameGuard {
        NameGuard {
            locks: Arc::clone(&self.locks),
            name: name.to_owned(),
            guard: Some(guard),
        }
    }

    /// Waits for and holds the lock of `name`; release by dropping the guard.
    pub async fn lock(&self, name: &str) -> NameGuard {
        let guard = self.entry(name).lock_owned().await;
        self.guard(name, guard)
    }

    /// The lock of `name` if nobody holds it now.
    pub fn try_lock(&self, name: &str) -> Option<NameGuard> {
        let guard = self.entry(name).try_lock_owned().ok()?;
        Some(self.guard(name, guard))
    }
}

impl Drop for NameGuard {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut locks = lock(&self.locks);
        // Only the map holds it now: nobody waits, so the entry can go.
        if locks.get(&self.name).is_some_and(|m| Arc::strong_count(m) == 1) {
            locks.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::NameLocks;

    #[tokio::test]
    async fn name_locks_serialise_one_name_only() {
        let locks = Arc::new(NameLocks::default());
        let held = locks.lock("a").await;
        // Another name is free...
        let other = tokio::time::timeout(Duration::from_secs(5), locks.lock("b")).await;
        assert!(other.is_ok());
        // ...the same name waits until the guard is gone.
        let locks2 = Arc::clone(&locks);
        let waiter = tokio::spawn(async move {
            let _guard = locks2.lock("a").await;
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("released")
            .expect("task");
    }

    #[tokio::test]
    async fn try_lock_fails_while_held_and_entries_go_when_released() {
        let locks = NameLocks::default();
        let held = locks.lock("a").await;
        assert!(locks.try_lock("a").is_none());
        assert!(locks.try_lock("b").is_some());
        drop(held);
        assert!(locks.try_lock("a").is_some());
        assert!(super::lock(&locks.locks).is_empty());
    }
}
