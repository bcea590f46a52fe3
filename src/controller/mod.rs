//! The reconcile pipeline for one Proxy, shared by cluster and standalone mode. One reconcile
//! ([`Reconciler::reconcile`], in `reconciler.rs`) reads as its sequence of calls:
//!
//! 1. **resolve** ([`observe`], client required): the referenced Secrets and the spec hash, once
//!    per reconcile.
//! 2. **observe** ([`observe`], client required): every round, the provider's `get`, its
//!    availability, the health verdict, the leases, the credentials book and the pool's budgets
//!    ([`pool`]). All the reconcile's reads are here.
//! 3. **facts** ([`observe::facts`], no client): the table's facts, computed once per round.
//! 4. **derive** ([`crate::machine::derive()`], no client): the first event the facts raise that
//!    the state handles, read from the table.
//! 5. **decide** ([`crate::machine::decide`], no client): the generated machine picks the row.
//! 6. **plan** ([`plan`], no client): the row's effects with their parameters, as a value.
//! 7. **execute** ([`execute`], client required): an `Executors` value owning the Proxy's
//!    context, one function per effect; the events they raise (a failed create, a confirmed
//!    delete) are decided next, in the same round.
//!
//! Rounds repeat until no event is derived. Then the **status** ([`status`], pure) is written
//! once, only if it changed, and the reconciler says when to look again ([`plan::next_wake`]).
//! Imports run one way: `reconciler` → `execute` → `observe` → `status`, `pool`, `credentials`.
//! Mode-specific I/O sits behind [`crate::effects::ProxyBackend`]: this module names neither
//! mode. The Kubernetes wiring is in [`crate::cluster`], the folder-and-store runner in
//! [`crate::standalone`].

mod availability;
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

pub use availability::ProviderAvailability;
pub use error::{ReconcileError, error_backoff};
pub use reconciler::{ReconcileOutcome, Reconciler, ReconcilerConfig};
