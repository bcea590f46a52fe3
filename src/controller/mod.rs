//! The reconcile pipeline for one Proxy, shared by cluster and standalone mode. One reconcile
//! runs rounds of:
//!
//! 1. **observe** ([`observe`], client required): the referenced Secrets and the spec hash (once
//!    per reconcile), then each round the provider's `get`, the health verdict, the leases, the
//!    provider's availability and the pool's budgets ([`pool`]); turned into the table's facts
//!    (no client required).
//! 2. **derive** ([`crate::machine::derive()`], no client): the first event the facts raise that
//!    the state handles, read from the table.
//! 3. **decide** ([`crate::machine::decide`], no client): the generated machine picks the row.
//! 4. **plan** ([`plan`], no client): the row's effects with their parameters, as a value.
//! 5. **execute** ([`execute`], client required): one executor per effect; the events they raise
//!    (a failed create, a confirmed delete) are decided next, in the same round.
//!
//! Rounds repeat until no event is derived. Then the **status** ([`status`], pure) is written
//! once, only if it changed, and the reconciler says when to look again ([`plan::next_wake`]).
//! Mode-specific I/O sits behind [`crate::effects::ProxyBackend`]: this module names neither
//! mode. The Kubernetes wiring is in [`crate::cluster`], the folder-and-store runner in
//! [`crate::standalone`].

pub mod credentials;
mod error;
pub mod execute;
pub mod observe;
pub mod plan;
pub mod pool;
mod reconciler;
pub mod secrets;
pub mod simulate;
pub mod spec_hash;
pub mod status;

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
};

pub use error::{ReconcileError, error_backoff};
pub use reconciler::{ReconcileOutcome, Reconciler, ReconcilerConfig};

/// Availability of provider instances as the provider-health monitor last saw it. Providers not
/// (yet) probed count as available: a Proxy is never held back on a guess.
#[derive(Clone, Default)]
pub struct ProviderAvailability {
    down: Arc<RwLock<HashMap<String, String>>>,
}

impl ProviderAvailability {
    /// Marks `provider` down with `reason`, or up with `None`.
    pub fn set(&self, provider: &str, down_reason: Option<String>) {
        let mut down = crate::sync::write(&self.down);
        match down_reason {
            Some(reason) => down.insert(provider.to_owned(), reason),
            None => down.remove(provider),
        };
    }

    /// Why `provider` is down, if it is.
    pub fn down_reason(&self, provider: &str) -> Option<String> {
        crate::sync::read(&self.down).get(provider).cloned()
    }
}
