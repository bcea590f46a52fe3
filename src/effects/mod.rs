//! The executors' interfaces: each kind of side effect the engine asks for is carried out by one
//! of these, idempotently, so a crash between any two effects is safe on restart.
//!
//! - [`ProxyBackend`]: the mode-specific writes (finalizer, status, events) and reads of
//!   referenced Secrets. Cluster mode implements it with the Kubernetes API, standalone mode with
//!   its embedded store.
//! - [`LeaseControl`]: admission, drain and revocation of leases on one proxy.
//! - [`HealthControl`]: which proxies the health engine probes, and its verdicts.
//!
//! Provider effects go through [`crate::provider::Provider`] directly.

use async_trait::async_trait;

// The key, the health verdict, the lease target and the drain status are the API's, the health
// engine's and the lease store's own types, re-exported because the executors' interfaces speak
// in them (the verdict under a name that says whose it is).
use crate::{
    api::{HealthCheck, Proxy, ProxyKey, ProxyStatus, SecretKeyRef},
    machine::AuditEntry,
    provider::{Credentials, Endpoint, UserData},
};
pub use crate::{
    health::Verdict as HealthVerdict,
    lease::{DrainStatus, LeaseTarget},
};

/// Why a referenced Secret can't be used: a user error reported on the Proxy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Missing, or (for cloud-init) not labelled so the operator may read it.
    #[error("{0}")]
    NotUsable(String),
    /// The backend could not be asked; retry.
    #[error("reading the Secret failed: {0}")]
    Transient(String),
}

impl SecretError {
    /// `namespace/name` is not there (`place`: where the mode looked, e.g. " in the manifests
    /// folder", or "").
    pub fn missing(namespace: &str, name: &str, place: &str) -> Self {
        Self::NotUsable(format!("Secret {namespace}/{name} not found{place}"))
    }

    /// The cloud-init Secret `namespace/name` is not there, or not labelled for the operator.
    pub fn cloud_init_unusable(namespace: &str, name: &str, place: &str) -> Self {
        Self::NotUsable(format!(
            "Secret {namespace}/{name} not found{place} or not labelled {}=\"true\" (the operator reads only labelled Secrets)",
            crate::api::CLOUD_INIT_SECRET_LABEL
        ))
    }
}

/// A write to the backend failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    /// Someone else changed the object first; reconcile again with the fresh object.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The object no longer exists.
    #[error("gone: {0}")]
    Gone(String),
    /// Anything else; retry with backoff.
    #[error("{0}")]
    Other(String),
}

/// Mode-specific reads and writes of the reconciler.
#[async_trait]
pub trait ProxyBackend: Send + Sync {
    /// The cloud-init user-data a Proxy references.
    async fn cloud_init(&self, namespace: &str, secret: &SecretKeyRef) -> Result<UserData, SecretError>;
    /// The proxy credentials (keys `username`, `password`) of the named Secret.
    async fn credentials(&self, namespace: &str, secret_name: &str) -> Result<Credentials, SecretError>;
    /// Adds the operator's finalizer (before any instance is created). Returns the object's new
    /// resourceVersion where the backend versions objects, so a status write later in the same
    /// reconcile does not conflict with this very write.
    async fn add_finalizer(&self, proxy: &Proxy) -> Result<Option<String>, BackendError>;
    /// Removes the finalizer (after the instance is gone).
    async fn remove_finalizer(&self, proxy: &Proxy) -> Result<(), BackendError>;
    /// Replaces the status (called only when it changed).
    async fn write_status(&self, proxy: &Proxy, status: &ProxyStatus) -> Result<(), BackendError>;
    /// Records one transition of the audit trail (a Kubernetes Event in cluster mode).
    async fn record(&self, proxy: &Proxy, entry: &AuditEntry, message: &str) -> Result<(), BackendError>;
}

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

/// What the health engine probes for one proxy.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthTarget {
    /// The proxy.
    pub key: ProxyKey,
    /// The proxy's endpoint (probes go through it).
    pub endpoint: Endpoint,
    /// The check.
    pub check: HealthCheck,
    /// Credentials the proxy requires.
    pub credentials: Option<Credentials>,
}

/// The health engine's interface.
pub trait HealthControl: Send + Sync {
    /// Probe this target (upserting the same target keeps the counters).
    fn upsert(&self, target: HealthTarget);
    /// Stop probing the proxy and forget its verdict.
    fn remove(&self, key: &ProxyKey);
    /// The current verdict.
    fn verdict(&self, key: &ProxyKey) -> HealthVerdict;
}
