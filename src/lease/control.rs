//! The lease executor's interface ([`effects::LeaseControl`]) on the lease store, so the
//! reconciler's lease effects (enable, disable, drain, revoke) go straight to it.

use super::{Admission, DrainStatus, LeaseStore, LeaseTarget, ProxyKey};
use crate::effects;

impl effects::LeaseControl for LeaseStore {
    fn upsert(&self, target: LeaseTarget) {
        self.upsert_proxy(target);
    }

    fn set_admission(&self, key: &ProxyKey, open: bool) {
        let admission = if open { Admission::Open } else { Admission::Closed };
        // A proxy the store does not know has nothing to open or close; the reconciler
        // upserts before it enables.
        if LeaseStore::set_admission(self, key, admission).is_err() {
            tracing::debug!(proxy = %key, "admission change for a proxy the lease store does not know");
        }
    }

    fn drain(&self, key: &ProxyKey) -> DrainStatus {
        LeaseStore::drain(self, key)
    }

    fn revoke_all(&self, key: &ProxyKey) -> usize {
        LeaseStore::revoke_all(self, key)
    }

    fn remove(&self, key: &ProxyKey) {
        self.remove_proxy(key);
    }

    fn active(&self, key: &ProxyKey) -> usize {
        // What the lifecycle's `leases_active` means: leases a drain must wait for.
        self.leases_to_wait_for(key)
    }
}
