//! The mode-specific executor's interface: [`ProxyBackend`] carries out the writes the engine
//! asks of a mode (finalizer, status, audit records) and reads the Secrets a Proxy references,
//! idempotently, so a crash between any two effects is safe on restart. Cluster mode implements
//! it with the Kubernetes API, standalone mode with its embedded store.
//!
//! The other executors' interfaces live with what carries them out, so that neither names the
//! controller: [`crate::lease::LeaseControl`] (admission, drain and revocation of leases) with
//! the lease store, [`crate::health::HealthControl`] (what is probed, and the verdicts) with the
//! health engine. Provider effects go through [`crate::provider::Provider`] directly.

use async_trait::async_trait;

use crate::{
    api::{Proxy, ProxyStatus, SecretKeyRef},
    machine::AuditEntry,
    provider::{Credentials, UserData},
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
