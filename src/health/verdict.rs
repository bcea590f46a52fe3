//! A proxy's verdict from its probes: the counters a probe result moves, the thresholds that
//! turn them into `Passing` or `Failing`, and the bounded error text a snapshot keeps. Pure:
//! the engine ([`super`]) calls it under its table's lock.

use std::time::Duration;

use super::{HealthSnapshot, HealthTarget, MAX_ERROR_LEN, ProbeError, Verdict};

/// Updates counters and verdict; returns the old and new verdict if it changed. While `held`
/// (the reason), the verdict stays `Failing` and the last error says why.
pub(super) fn apply(
    snapshot: &mut HealthSnapshot,
    target: &HealthTarget,
    result: Result<Duration, ProbeError>,
    held: Option<&str>,
    now: jiff::Timestamp,
) -> Option<(Verdict, Verdict)> {
    snapshot.probes += 1;
    snapshot.last_probe_at = Some(now);
    match result {
        Ok(latency) => {
            snapshot.consecutive_successes = snapshot.consecutive_successes.saturating_add(1);
            snapshot.consecutive_failures = 0;
            snapshot.last_latency = Some(latency);
            snapshot.last_error = None;
        }
        Err(error) => {
            snapshot.consecutive_failures = snapshot.consecutive_failures.saturating_add(1);
            snapshot.consecutive_successes = 0;
            snapshot.last_error = Some(bounded(error.to_string()));
        }
    }
    let mut next = next_verdict(
        snapshot.verdict,
        snapshot.consecutive_successes,
        snapshot.consecutive_failures,
        target.success_threshold,
        target.failure_threshold,
    );
    let old = snapshot.verdict;
    if let Some(reason) = held {
        next = Verdict::Failing;
        snapshot.last_error = Some(bounded(reason.to_owned()));
    }
    (next != old).then(|| {
        snapshot.verdict = next;
        snapshot.verdict_since = Some(now);
        snapshot.recovered = old == Verdict::Failing && next == Verdict::Passing;
        (old, next)
    })
}

/// `text` cut to [`MAX_ERROR_LEN`] bytes.
pub(super) fn bounded(mut text: String) -> String {
    if text.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The verdict after a probe, from the one before and the consecutive passes and failures so
/// far: `success_threshold` passes in a row make it `Passing`, `failure_threshold` failures in a
/// row `Failing` (a threshold of 0 counts as 1). The scenario world applies the same rule.
pub fn next_verdict(
    verdict: Verdict,
    consecutive_successes: u32,
    consecutive_failures: u32,
    success_threshold: u32,
    failure_threshold: u32,
) -> Verdict {
    match verdict {
        Verdict::Unknown | Verdict::Failing if consecutive_successes >= success_threshold.max(1) => {
            Verdict::Passing
        }
        Verdict::Unknown | Verdict::Passing if consecutive_failures >= failure_threshold.max(1) => {
            Verdict::Failing
        }
        v => v,
    }
}
