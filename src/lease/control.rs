//! The lease executor's interface ([`effects::LeaseControl`]) on the lease store, so the
//! reconciler's lease effects (enable, disable, drain, revoke) go straight to it.

use super::{Admission, DrainStatus, LeaseStore, LeaseTarget, ProxyKey};
use crate::effects;

impl From<&effects::ProxyKey> for ProxyKey {
    fn from(key: &effects::ProxyKey) -> Self {
        ProxyKey::new(&key.namespace, &key.name)
    }
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl effects::LeaseControl for LeaseStore {
    fn upsert(&self, target: effects::LeaseTarget) {
        self.upsert_proxy(LeaseTarget {
            key: (&target.key).into(),
            endpoint: target.endpoint,
            attributes: target.attributes,
            policy: target.policy,
            credentials: target.credentials,
        });
    }

    fn set_admission(&self, key: &effects::ProxyKey, open: bool) {
        let admission = if open { Admission::Open } else { Admission::Closed };
        // A proxy the store does not know has nothing to open or close; the reconciler
        // upserts before it enables.
        if LeaseStore::set_admission(self, &key.into(), admission).is_err() {
            tracing::debug!(proxy = %key, "admission change for a proxy the lease store does not know");
        }
    }

    fn drain(&self, key: &effects::ProxyKey) -> effects::DrainStatus {
        match LeaseStore::drain(self, &key.into()) {
            DrainStatus::Drained => effects::DrainStatus::Drained,
            DrainStatus::Pending { active } => effects::DrainStatus::Pending {
                active: count(active),
            },
        }
    }

    fn revoke_all(&self, key: &effects::ProxyKey) -> u32 {
        count(LeaseStore::revoke_all(self, &key.into()))
    }

    fn remove(&self, key: &effects::ProxyKey) {
        self.remove_proxy(&key.into());
    }

    fn active(&self, key: &effects::ProxyKey) -> u32 {
        // What the lifecycle's `leases_active` means: leases a drain must wait for.
        count(self.leases_to_wait_for(&key.into()))
    }
}
