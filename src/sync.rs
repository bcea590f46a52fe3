//! Poison-tolerant locking of std's `Mutex` and `RwLock`, the one helper every module uses.
//!
//! A panic inside a critical section poisons the lock; the operator's critical sections keep
//! their data structurally valid before anything in them can panic (single inserts, removes,
//! counter updates, list relinks), so the data is still usable and poisoning is ignored rather
//! than turning one panic into a panic on every later access.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `mutex`, continuing past poisoning.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Read-locks `rwlock`, continuing past poisoning.
pub fn read<T>(rwlock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    rwlock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Write-locks `rwlock`, continuing past poisoning.
pub fn write<T>(rwlock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    rwlock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}
