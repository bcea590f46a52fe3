//! Holding a proxy's verdict `Failing` for a while, whatever its probes say: how something
//! that sees traffic the probes do not (the gateway's rules: a target keeps refusing the
//! proxy) takes it out of rotation. The verdict change goes out as any other, so the lifecycle
//! closes the proxy as for a failed check (degraded) and opens it again once the hold is over
//! and its probes pass `success_threshold` times in a row.

use std::time::Duration;

use tokio::time::Instant;

use super::{HealthEvent, HealthHandle, Verdict, verdict::bounded};
use crate::api::ProxyKey;

/// A hold: until when, and why (the snapshot's last error while it lasts).
pub(super) struct Hold {
    until: Instant,
    reason: String,
}

impl Hold {
    /// A hold until `until`, for `reason`.
    pub(super) fn until(until: Instant, reason: String) -> Self {
        Self { until, reason }
    }
}

/// The reason of `hold` while it lasts; an expired hold is dropped.
pub(super) fn active(hold: &mut Option<Hold>) -> Option<&str> {
    if hold.as_ref().is_some_and(|h| h.until <= Instant::now()) {
        *hold = None;
    }
    hold.as_ref().map(|h| h.reason.as_str())
}

impl HealthHandle {
    /// Holds `key`'s verdict `Failing` for `time` (from now; a later hold replaces it), with
    /// `reason` as its last error. Sends the verdict change if it was not failing. A proxy not
    /// probed is left alone; a new endpoint (a fresh instance) ends the hold.
    pub async fn hold_failing(&self, key: &ProxyKey, time: Duration, reason: String) {
        let now = jiff::Timestamp::now();
        let event = {
            let mut table = self.state().table();
            let Some(entry) = table.entries.get_mut(key) else {
                return;
            };
            entry.snapshot.last_error = Some(bounded(reason.clone()));
            // Passes during the hold still count, so that it ends like any recovery.
            entry.hold = Some(Hold::until(Instant::now() + time, reason));
            let snapshot = &mut entry.snapshot;
            (snapshot.verdict != Verdict::Failing).then(|| {
                snapshot.verdict = Verdict::Failing;
                snapshot.verdict_since = Some(now);
                snapshot.recovered = false;
                HealthEvent {
                    key: key.clone(),
                    verdict: Verdict::Failing,
                    at: now,
                    recovered: false,
                    last_error: snapshot.last_error.clone(),
                }
            })
        };
        if let Some(event) = event {
            tracing::info!(proxy = %key, verdict = ?event.verdict, "health verdict held failing");
            // A closed receiver means nobody listens any more.
            let _ = self.state().events.send(event).await;
        }
    }
}
