//! Waiting for something a test caused to show: every helper polls and fails the test, naming
//! what it waited for, once its time is up. Needs nothing but tokio, so a test that includes
//! only some support modules can include this one too.

#![allow(dead_code)] // Each test binary waits with some of them.

use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it holds, or fails the test naming `what` once `within` has
/// passed.
pub async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `condition` every 50 ms until it holds (true) or `timeout` passes (false), for a
/// caller whose failure message says more than what it waited for.
pub async fn holds_within(timeout: Duration, mut condition: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `check` (every 100 ms) until it yields a value, which it returns, or fails the test
/// naming `what` once `within` has passed.
pub async fn wait_until<T>(within: Duration, what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
