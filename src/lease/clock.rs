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
            Clock::System => coarse_now_ms(),
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

/// The coarse wall clock (a few ms resolution, read without a system call on Linux): lease
/// times are seconds long, and the full-resolution clock costs more than a whole acquire.
#[cfg(target_os = "linux")]
fn coarse_now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given; the clock id is valid on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
        ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
    } else {
        precise_now_ms()
    }
}

#[cfg(not(target_os = "linux"))]
fn coarse_now_ms() -> u64 {
    precise_now_ms()
}

fn precise_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Milliseconds since the epoch as an RFC 3339 timestamp.
pub fn rfc3339(ms: u64) -> String {
    jiff::Timestamp::from_millisecond(ms as i64)
        .map(|t| t.to_string())
        .unwrap_or_default()
}
