//! The store's clock: wall-clock milliseconds since the Unix epoch, or a manual clock for tests.
//!
//! Lease expiries and cooldowns are wall-clock times because they are persisted and must mean
//! the same thing to the next process (or the next leader).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// Where the store reads the time from.
#[derive(Clone, Debug, Default)]
pub enum Clock {
    /// The system's wall clock.
    #[default]
    System,
    /// A clock that moves only when told to (tests, scenario replays).
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// A manual clock starting at `start_ms` milliseconds since the epoch.
    pub fn manual(start_ms: u64) -> Self {
        Self::Manual(Arc::new(AtomicU64::new(start_ms)))
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            Clock::Manual(ms) => ms.load(Ordering::Relaxed),
        }
    }

    /// Moves a manual clock forward; no effect on the system clock.
    pub fn advance(&self, by: Duration) {
        if let Clock::Manual(ms) = self {
            ms.fetch_add(by.as_millis() as u64, Ordering::Relaxed);
        }
    }
}

/// Milliseconds since the epoch as an RFC 3339 timestamp.
pub fn rfc3339(ms: u64) -> String {
    jiff::Timestamp::from_millisecond(ms as i64)
        .map(|t| t.to_string())
        .unwrap_or_default()
}
