//! The lease store and health engine behind the reconciler's executor interfaces.

use std::{collections::HashSet, net::IpAddr, sync::Mutex, time::Duration};

use crate::{
    effects::{self, DrainStatus, HealthControl, HealthVerdict, LeaseControl, ProxyKey},
    health::{self, HealthHandle, Verdict},
    lease::{self, Admission, LeaseStore},
};

fn lease_key(key: &ProxyKey) -> lease::ProxyKey {
    lease::ProxyKey::new(&key.namespace, &key.name)
}

/// [`LeaseControl`] over the lease store.
pub struct Leases(pub LeaseStore);

impl LeaseControl for Leases {
    fn upsert(&self, target: effects::LeaseTarget) {
        self.0.upsert_proxy(lease::LeaseTarget {
            key: lease_key(&target.key),
            endpoint: target.endpoint,
            attributes: target.attributes,
            policy: target.policy,
            credentials: target.credentials,
        });
    }

    fn set_admission(&self, key: &ProxyKey, open: bool) {
        let admission = if open { Admission::Open } else { Admission::Closed };
        // Not registered yet (no endpoint): nothing to open or close; the next upsert applies it.
        let _ = self.0.set_admission(&lease_key(key), admission);
    }

    fn drain(&self, key: &ProxyKey) -> DrainStatus {
        match self.0.drain(&lease_key(key)) {
            lease::DrainStatus::Drained => DrainStatus::Drained,
            lease::DrainStatus::Pending { active } => DrainStatus::Pending {
                active: u32::try_from(active).unwrap_or(u32::MAX),
            },
        }
    }

    fn revoke_all(&self, key: &ProxyKey) -> u32 {
        u32::try_from(self.0.revoke_all(&lease_key(key))).unwrap_or(u32::MAX)
    }

    fn remove(&self, key: &ProxyKey) {
        self.0.remove_proxy(&lease_key(key));
    }

    fn active(&self, key: &ProxyKey) -> u32 {
        u32::try_from(self.0.active_leases(&lease_key(key))).unwrap_or(u32::MAX)
    }
}

/// [`HealthControl`] over the health engine. It remembers which proxies were seen failing, so
/// a later pass reads as a recovery.
pub struct Health {
    handle: HealthHandle,
    failed: Mutex<HashSet<ProxyKey>>,
}

impl Health {
    /// Wraps a running engine.
    pub fn new(handle: HealthHandle) -> Self {
        Self {
            handle,
            failed: Mutex::default(),
        }
    }
}

impl HealthControl for Health {
    fn upsert(&self, target: effects::HealthTarget) {
        let check = &target.check;
        self.handle.upsert(health::HealthTarget {
            key: lease_key(&target.key),
            endpoint: target.endpoint,
            url: check.url.clone(),
            interval: Duration::from_secs(u64::try_from(check.interval_seconds).unwrap_or(30)),
            timeout: Duration::from_secs(u64::try_from(check.timeout_seconds).unwrap_or(5)),
            failure_threshold: u32::try_from(check.failure_threshold).unwrap_or(3),
            success_threshold: u32::try_from(check.success_threshold).unwrap_or(1),
            expected_egress: check
                .expected_egress_address
                .as_deref()
                .and_then(|a| a.parse::<IpAddr>().ok()),
            credentials: target.credentials,
        });
    }

    fn remove(&self, key: &ProxyKey) {
        self.handle.remove(&lease_key(key));
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }

    fn verdict(&self, key: &ProxyKey) -> HealthVerdict {
        let verdict = self
            .handle
            .snapshot(&lease_key(key))
            .map_or(Verdict::Unknown, |s| s.verdict);
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        match verdict {
            Verdict::Unknown => HealthVerdict::Unknown,
            Verdict::Failing => {
                failed.insert(key.clone());
                HealthVerdict::Failing
            }
            Verdict::Passing => HealthVerdict::Passing {
                after_failing: failed.contains(key),
            },
        }
    }
}

/// The reconciler's key for a health event's proxy.
pub fn proxy_key(key: &lease::ProxyKey) -> ProxyKey {
    ProxyKey {
        namespace: key.namespace().to_owned(),
        name: key.name().to_owned(),
    }
}
