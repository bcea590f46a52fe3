//! The health executor's interface ([`effects::HealthControl`]) on the health engine.

use std::time::Duration;

use super::{HealthHandle, HealthTarget, ProxyKey, Verdict};
use crate::effects;

fn seconds(s: i32) -> Duration {
    Duration::from_secs(s.max(1) as u64)
}

impl effects::HealthControl for HealthHandle {
    fn upsert(&self, target: effects::HealthTarget) {
        let check = &target.check;
        HealthHandle::upsert(
            self,
            HealthTarget {
                key: target.key,
                endpoint: target.endpoint,
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
                credentials: target.credentials,
            },
        );
    }

    fn remove(&self, key: &ProxyKey) {
        HealthHandle::remove(self, key);
    }

    fn verdict(&self, key: &ProxyKey) -> Verdict {
        self.snapshot(key).map_or(Verdict::Unknown, |s| s.verdict)
    }
}
