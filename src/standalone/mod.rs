//! Standalone mode: the whole operator on one host without Kubernetes. Desired state is a folder
//! of the same `Proxy` manifests (and the Secrets they reference); status, identity and the
//! audit trail live in the embedded store ([`store`]); the same reconciler, executors, health
//! engine and lease store run as in a cluster, started by [`crate::app::start_core`].
//!
//! Owns: the manifests folder ([`manifests`]), the embedded store ([`store`]), the runner that
//! plays the API server's part ([`runner`], with each Proxy's next reconcile in `due`), the
//! reconciler's backend over the store ([`StandaloneBackend`]), the live owners for GC ([`owners`]), the state folder's files
//! (installation ID, lease checkpoint and journal, signing key, tokens), the gateway rules'
//! recycle requests ([`recycle`]) and this mode's assembly ([`mode`]). Must not touch: Kubernetes, or anything of [`crate::cluster`]
//! (tests/mode_isolation.rs checks it).

mod backend;
mod due;
pub mod manifests;
pub mod mode;
pub mod owners;
pub mod progress;
pub mod recycle;
pub mod runner;
pub mod status;
pub mod store;
pub mod ui;

pub use backend::StandaloneBackend;
pub use mode::{StandaloneOptions, run_standalone};
pub use runner::{Standalone, StandaloneDeps, StandaloneError, proxy_of};
