//! The health executor's interface, [`HealthControl`], owned here with the engine that carries
//! it out, and its implementation on the engine's [`HealthHandle`]. The reconciler asks through
//! it (and tests and benchmarks script it); the health engine names nothing of the controller.

use std::time::Duration;

use super::{HealthHandle, HealthTarget, Verdict};
use crate::{
    api::{HealthCheck, ProxyKey},
    provider::{Credentials, Endpoint},
};

/// The health executor's interface: which proxies the health engine probes, and its verdicts.
pub trait HealthControl: Send + Sync {
    /// Probe this target (upserting the same target keeps the counters).
    fn upsert(&self, target: HealthTarget);
    /// Stop probing the proxy and forget its verdict.
    fn remove(&self, key: &ProxyKey);
    /// The current verdict.
    fn verdict(&self, key: &ProxyKey) -> Verdict;
    /// Why the last probe failed (`None` after a pass, or where nothing probes).
    fn last_error(&self, _key: &ProxyKey) -> Option<String> {
        None
    }
}

/// A whole number of seconds from the API, at least one (a zero or negative interval would
/// probe in a busy loop; the schema already refuses them).
fn seconds(s: i32) -> Duration {
    Duration::from_secs(s.max(1) as u64)
}

impl HealthTarget {
    /// The target for a Proxy's `spec.health`, probed through `endpoint` with `credentials`.
    pub fn from_check(
        key: ProxyKey,
        endpoint: Endpoint,
        check: &HealthCheck,
        credentials: Option<Credentials>,
    ) -> Self {
        Self {
            key,
            endpoint,
            url: check.url.clone(),
            interval: seconds(check.interval_seconds),
            timeout: seconds(check.timeout_seconds),
            failure_threshold: check.failure_threshold.max(1) as u32,
            success_threshold: check.success_threshold.max(1) as u32,
            // The schema's CEL rule makes it an IP address; anything else is ignored.
            expected_egress: check
                .expected_egress_address
                .as_deref()
                .and_then(|a| a.parse().ok()),
            credentials,
        }
    }
}

impl HealthControl for HealthHandle {
    fn upsert(&self, target: HealthTarget) {
        HealthHandle::upsert(self, target);
    }

    fn remove(&self, key: &ProxyKey) {
        HealthHandle::remove(self, key);
    }

    fn verdict(&self, key: &ProxyKey) -> Verdict {
        self.snapshot(key).map_or(Verdict::Unknown, |s| s.verdict)
    }

    fn last_error(&self, key: &ProxyKey) -> Option<String> {
        self.snapshot(key)?.last_error
    }
}
