//! The lease executor's interface, [`LeaseControl`], owned here with the store that carries it
//! out, and its implementation on the [`LeaseStore`], so the reconciler's lease effects (enable,
//! disable, drain, revoke) go straight to it. The lease store names nothing of the controller.

use super::{Admission, DrainStatus, LeaseStore, LeaseTarget};
use crate::api::ProxyKey;

/// The lease executor's interface.
pub trait LeaseControl: Send + Sync {
    /// Registers or updates a proxy (attributes and limits change in place; leases stay).
    fn upsert(&self, target: LeaseTarget);
    /// Opens (`true`) or closes admission of new leases.
    fn set_admission(&self, key: &ProxyKey, open: bool);
    /// Closes admission and reports whether leases remain.
    fn drain(&self, key: &ProxyKey) -> DrainStatus;
    /// Revokes every lease on the proxy; returns how many.
    fn revoke_all(&self, key: &ProxyKey) -> usize;
    /// Forgets the proxy.
    fn remove(&self, key: &ProxyKey);
    /// Leases held on the proxy.
    fn active(&self, key: &ProxyKey) -> usize;
}

impl LeaseControl for LeaseStore {
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
