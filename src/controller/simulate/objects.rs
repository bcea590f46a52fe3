//! Where a scenario's Proxy object lives ([`ProxyObjects`], [`InMemory`]) and what it is at the
//! start ([`sim_proxy`]).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::{EPOCH, PROVIDER};
use crate::{
    api::{Proxy, ProxySpec, ProxyStatus, SecretKeyRef},
    controller::status::FINALIZER,
    effects::{BackendError, ProxyBackend, SecretError},
    machine::AuditEntry,
    provider::{Credentials, UserData},
};

/// The scenario's Proxy: a minimal spec on the `sim` provider, with both Secrets referenced.
pub(super) fn sim_proxy() -> Proxy {
    let spec: ProxySpec = serde_json::from_value(serde_json::json!({
        "provider": PROVIDER,
        "cloudInit": {"secretRef": {"name": "sim-cloud-init"}},
        "auth": {"secretRef": {"name": "sim-auth"}},
    }))
    .unwrap_or_else(|err| unreachable!("a literal minimal spec parses: {err}"));
    Proxy {
        metadata: ObjectMeta {
            name: Some("proxy".to_owned()),
            namespace: Some("sim".to_owned()),
            uid: Some("00000000-0000-0000-0000-000000000001".to_owned()),
            generation: Some(1),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// Where a scenario's Proxy object lives: a mode's own store, and the backend that mode's
/// reconciler writes the finalizer, the status and the audit trail through. The scenario world
/// scripts the rest (provider, health, leases, Secrets). Implemented in memory here, and over
/// the embedded store and the API server by `tests/scenario_modes.rs`.
#[async_trait]
pub trait ProxyObjects: Send + Sync {
    /// The mode's backend.
    type Backend: ProxyBackend + 'static;
    /// A backend over this store.
    fn backend(&self) -> Self::Backend;
    /// Stores the scenario's Proxy (with its finalizers and status) as a new object.
    async fn create(&self, proxy: &Proxy) -> Result<(), BackendError>;
    /// The Proxy as the mode serves it now; `None` once it is gone.
    async fn get(&self) -> Result<Option<Proxy>, BackendError>;
    /// A user's edit of the spec (the generation moves).
    async fn edit_spec(&self, spec: &ProxySpec) -> Result<(), BackendError>;
    /// A user's delete (the finalizer holds the object).
    async fn delete(&self) -> Result<(), BackendError>;
    /// Someone removes every finalizer behind the operator's back.
    async fn strip_finalizers(&self) -> Result<(), BackendError>;
    /// A user (or a ban rule) sets the annotation `key` to `value` (the generation stays).
    async fn annotate(&self, key: &str, value: &str) -> Result<(), BackendError>;
}

/// The Proxy object in memory, served as an API server would.
#[derive(Clone, Default)]
pub struct InMemory(Arc<Mutex<Option<Proxy>>>);

impl InMemory {
    fn edit(&self, change: impl FnOnce(&mut Proxy)) -> Result<(), BackendError> {
        let mut object = crate::sync::lock(&self.0);
        let proxy = object
            .as_mut()
            .ok_or_else(|| BackendError::Gone("proxy".to_owned()))?;
        change(proxy);
        // Like the API server: a deleted object without finalizers is gone.
        if proxy.metadata.deletion_timestamp.is_some()
            && proxy.metadata.finalizers.as_ref().is_none_or(Vec::is_empty)
        {
            *object = None;
        }
        Ok(())
    }
}

#[async_trait]
impl ProxyObjects for InMemory {
    type Backend = InMemory;
    fn backend(&self) -> InMemory {
        self.clone()
    }
    async fn create(&self, proxy: &Proxy) -> Result<(), BackendError> {
        *crate::sync::lock(&self.0) = Some(proxy.clone());
        Ok(())
    }
    async fn get(&self) -> Result<Option<Proxy>, BackendError> {
        Ok(crate::sync::lock(&self.0).clone())
    }
    async fn edit_spec(&self, spec: &ProxySpec) -> Result<(), BackendError> {
        self.edit(|proxy| {
            proxy.spec = spec.clone();
            proxy.metadata.generation = proxy.metadata.generation.map(|g| g + 1);
        })
    }
    async fn delete(&self) -> Result<(), BackendError> {
        // Like the API server: marking an object deleted moves its generation.
        self.edit(|proxy| {
            proxy.metadata.deletion_timestamp = Some(Time(EPOCH));
            proxy.metadata.generation = proxy.metadata.generation.map(|g| g + 1);
        })
    }
    async fn strip_finalizers(&self) -> Result<(), BackendError> {
        self.edit(|proxy| proxy.metadata.finalizers = None)
    }
    async fn annotate(&self, key: &str, value: &str) -> Result<(), BackendError> {
        self.edit(|proxy| {
            (proxy.metadata.annotations.get_or_insert_default()).insert(key.to_owned(), value.to_owned());
        })
    }
}

#[async_trait]
impl ProxyBackend for InMemory {
    async fn cloud_init(&self, _: &str, _: &SecretKeyRef) -> Result<UserData, SecretError> {
        Err(SecretError::NotUsable(
            "Secrets come from the scenario's script".to_owned(),
        ))
    }
    async fn credentials(&self, _: &str, _: &str) -> Result<Credentials, SecretError> {
        Err(SecretError::NotUsable(
            "Secrets come from the scenario's script".to_owned(),
        ))
    }
    async fn add_finalizer(&self, _: &Proxy) -> Result<Option<String>, BackendError> {
        self.edit(|proxy| proxy.metadata.finalizers = Some(vec![FINALIZER.to_owned()]))
            .map(|()| None)
    }
    async fn remove_finalizer(&self, _: &Proxy) -> Result<(), BackendError> {
        self.edit(|proxy| proxy.metadata.finalizers = None)
    }
    async fn write_status(&self, _: &Proxy, status: &ProxyStatus) -> Result<(), BackendError> {
        self.edit(|proxy| proxy.status = Some(status.clone()))
    }
    async fn record(&self, _: &Proxy, _: &AuditEntry, _: &str) -> Result<(), BackendError> {
        Ok(())
    }
}
