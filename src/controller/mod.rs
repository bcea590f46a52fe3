//! The reconcile pipeline for one Proxy, shared by cluster and standalone mode:
//!
//! 1. **observe** (client required): read the referenced Secrets, the provider instance, the
//!    health verdict, the leases, the provider's availability; compute the spec hash
//!    ([`spec_hash`]); derive the machine's events ([`observe::derive_events`], pure).
//! 2. **decide** (no client): [`crate::machine::decide`] per event.
//! 3. **execute** (client required): carry out each effect through its executor
//!    ([`crate::effects`]); an effect's result may be a further event (a create that succeeded
//!    yields `instance_created`), decided in the same reconcile.
//! 4. **record** (client required): every transition becomes an audit entry and an Event; the
//!    status is written only if it changed ([`status::desired_status`], pure).
//!
//! Mode-specific I/O sits behind [`crate::effects::ProxyBackend`]; the Kubernetes wiring is in
//! [`cluster`].

pub mod cluster;
pub mod observe;
mod reconciler;
pub mod spec_hash;
pub mod status;

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
};

pub use reconciler::{ReconcileError, ReconcileOutcome, Reconciler, ReconcilerConfig};

/// Availability of provider instances as the provider-health monitor last saw it. Providers not
/// (yet) probed count as available: a Proxy is never held back on a guess.
#[derive(Clone, Default)]
pub struct ProviderAvailability {
    down: Arc<RwLock<HashMap<String, String>>>,
}

impl ProviderAvailability {
    /// Marks `provider` down with `reason`, or up with `None`.
    pub fn set(&self, provider: &str, down_reason: Option<String>) {
        let mut down = self.down.write().unwrap_or_else(|p| p.into_inner());
        match down_reason {
            Some(reason) => down.insert(provider.to_owned(), reason),
            None => down.remove(provider),
        };
    }

    /// Why `provider` is down, if it is.
    pub fn down_reason(&self, provider: &str) -> Option<String> {
        self.down
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(provider)
            .cloned()
    }
}
