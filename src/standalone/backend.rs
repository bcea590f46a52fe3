//! [`ProxyBackend`] over the embedded store: finalizer, status and audit trail are saved to the
//! state folder; Secrets come from the manifests folder. Must not touch: the manifests folder
//! (read by [`super::manifests`] only) or what the status says (built by
//! [`crate::controller::status`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use tracing::info;

use super::{
    progress::Progress,
    store::{AuditLine, ProxyRecord, Store},
};
use crate::{
    api::ProxyKey,
    api::{CLOUD_INIT_SECRET_LABEL, Proxy, ProxyStatus, SecretKeyRef},
    controller::secrets::{credentials_of, user_data_of},
    effects::{BackendError, ProxyBackend, SecretError},
    machine::AuditEntry,
    provider::{Credentials, UserData},
};

/// Where this mode looks for Secrets, as error messages say it.
const MANIFESTS_FOLDER: &str = " in the manifests folder";

/// Records by key, shared by the runner and the backend.
pub type Records = Arc<Mutex<HashMap<ProxyKey, ProxyRecord>>>;
/// Secrets from the manifests folder by (namespace, name).
pub type Secrets = Arc<RwLock<HashMap<(String, String), Secret>>>;

/// The standalone backend.
pub struct StandaloneBackend {
    store: Arc<Store>,
    records: Records,
    secrets: Secrets,
    progress: Arc<Progress>,
}

impl StandaloneBackend {
    /// A backend over `store`.
    pub fn new(store: Arc<Store>, records: Records, secrets: Secrets, progress: Arc<Progress>) -> Self {
        Self {
            store,
            records,
            secrets,
            progress,
        }
    }

    /// Changes the record of `key` and saves it; `Gone` if there is none.
    pub fn edit(&self, key: &ProxyKey, change: impl FnOnce(&mut ProxyRecord)) -> Result<(), BackendError> {
        let mut records = crate::sync::lock(&self.records);
        let record = records
            .get_mut(key)
            .ok_or_else(|| BackendError::Gone(key.to_string()))?;
        change(record);
        self.store
            .save(key, record)
            .map_err(|e| BackendError::Other(e.to_string()))
    }

    fn update(&self, proxy: &Proxy, change: impl FnOnce(&mut ProxyRecord)) -> Result<(), BackendError> {
        self.edit(&proxy.key(), change)
    }

    fn secret(&self, namespace: &str, name: &str) -> Option<Secret> {
        crate::sync::read(&self.secrets)
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }
}

#[async_trait]
impl ProxyBackend for StandaloneBackend {
    async fn cloud_init(&self, namespace: &str, secret: &SecretKeyRef) -> Result<UserData, SecretError> {
        let labelled = self
            .secret(namespace, &secret.name)
            .filter(|s| s.labels().get(CLOUD_INIT_SECRET_LABEL).map(String::as_str) == Some("true"));
        let Some(found) = labelled else {
            return Err(SecretError::cloud_init_unusable(
                namespace,
                &secret.name,
                MANIFESTS_FOLDER,
            ));
        };
        user_data_of(&found, namespace, secret)
    }

    async fn credentials(&self, namespace: &str, secret_name: &str) -> Result<Credentials, SecretError> {
        let secret = self
            .secret(namespace, secret_name)
            .ok_or_else(|| SecretError::missing(namespace, secret_name, MANIFESTS_FOLDER))?;
        credentials_of(&secret, namespace, secret_name)
    }

    async fn add_finalizer(&self, proxy: &Proxy) -> Result<Option<String>, BackendError> {
        self.update(proxy, |record| record.finalizer = true)
            .map(|()| None)
    }

    async fn remove_finalizer(&self, proxy: &Proxy) -> Result<(), BackendError> {
        let key = proxy.key();
        let mut records = crate::sync::lock(&self.records);
        let Some(record) = records.get_mut(&key) else {
            return Ok(());
        };
        record.finalizer = false;
        if record.deleting {
            // Like the API server: without finalizers a deleted object is gone.
            self.store
                .remove(&key)
                .map_err(|e| BackendError::Other(e.to_string()))?;
            records.remove(&key);
            info!(proxy = %key, "proxy deleted");
            Ok(())
        } else {
            self.store
                .save(&key, record)
                .map_err(|e| BackendError::Other(e.to_string()))
        }
    }

    async fn write_status(&self, proxy: &Proxy, status: &ProxyStatus) -> Result<(), BackendError> {
        self.update(proxy, |record| record.status = Some(status.clone()))
    }

    async fn record(&self, proxy: &Proxy, entry: &AuditEntry, message: &str) -> Result<(), BackendError> {
        let key = proxy.key();
        self.progress.transition(&key, entry);
        self.store
            .append_audit(
                &key,
                &AuditLine {
                    entry: entry.clone(),
                    message: message.to_owned(),
                },
            )
            .map_err(|e| BackendError::Other(e.to_string()))
    }
}
