//! [`ProxyBackend`] over the Kubernetes API: finalizers and status on the Proxy, Events as the
//! audit trail, Secrets from the label-selected cache (cloud-init) or a direct read (credentials).
//! Must not touch: what the status says (built by [`crate::controller::status`]); it only
//! writes it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::{
        events::{Event as KubeEvent, EventType},
        reflector::{ObjectRef, Store},
    },
};
use serde_json::json;

use super::events::EventPublisher;
use crate::{
    api::{Proxy, ProxyStatus, SecretKeyRef},
    controller::{
        secrets::{credentials_of, user_data_of},
        status::FINALIZER,
    },
    effects::{BackendError, ProxyBackend, SecretError},
    machine::{AuditEntry, reason},
    provider::{Credentials, UserData},
    sync::lock,
};

/// Tries of one write (status, finalizers) before it gives up on a Proxy whose other fields
/// keep changing under it (each conflict re-reads it once).
const WRITE_ATTEMPTS: usize = 3;

/// The cluster-mode backend.
#[derive(Clone)]
pub struct KubeBackend {
    client: Client,
    events: Arc<EventPublisher>,
    cloud_init_secrets: Store<Secret>,
    /// Per Proxy (hash of its UID), hashes of the last three resourceVersions our own writes of
    /// it replaced (the one read before adding the finalizer, the one the status write
    /// replaced, and the fresh one it went on top of after a conflict): see
    /// [`Self::is_superseded`]. Hashes keep this at a few dozen bytes per Proxy.
    superseded: Arc<Mutex<HashMap<u64, [u64; 3]>>>,
}

fn short_hash(text: Option<&str>) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

impl KubeBackend {
    /// A backend writing through `client`, reading cloud-init Secrets from `cloud_init_secrets`
    /// (a reflector over Secrets labelled [`CLOUD_INIT_SECRET_LABEL`](crate::api::CLOUD_INIT_SECRET_LABEL)), publishing the audit trail
    /// through `events`.
    pub fn new(client: Client, events: EventPublisher, cloud_init_secrets: Store<Secret>) -> Self {
        Self {
            client,
            events: Arc::new(events),
            cloud_init_secrets,
            superseded: Arc::default(),
        }
    }

    fn superseded(&self) -> MutexGuard<'_, HashMap<u64, [u64; 3]>> {
        lock(&self.superseded)
    }

    /// Whether `proxy` is a version our own writes of it already replaced: the cache has not
    /// received them yet, and a reconcile of it would redo transitions and end in a conflicting
    /// write. Forgets the Proxy's entry once the cache has moved on.
    pub fn is_superseded(&self, proxy: &Proxy) -> bool {
        let Some(uid) = proxy.uid() else {
            return false;
        };
        let uid = short_hash(Some(&uid));
        let version = short_hash(proxy.resource_version().as_deref());
        let mut superseded = self.superseded();
        match superseded.get(&uid) {
            Some(versions) if versions.contains(&version) => true,
            Some(_) => {
                superseded.remove(&uid);
                false
            }
            None => false,
        }
    }

    /// Remembers that our write replaced `proxy`'s version `replaced`.
    fn replaced(&self, proxy: &Proxy, replaced: Option<&str>) {
        if let Some(uid) = proxy.uid() {
            let version = short_hash(replaced);
            let mut superseded = self.superseded();
            let entry = superseded.entry(short_hash(Some(&uid))).or_insert([version; 3]);
            if entry[2] != version {
                entry.rotate_left(1);
                entry[2] = version;
            }
        }
    }

    fn proxies(&self, proxy: &Proxy) -> Api<Proxy> {
        Api::namespaced(self.client.clone(), &proxy.namespace().unwrap_or_default())
    }

    /// Sets the finalizer list to `finalizers` (`proxy`'s with ours added or removed); returns
    /// the Proxy's new resourceVersion.
    async fn set_finalizers(
        &self,
        proxy: &Proxy,
        finalizers: Vec<String>,
    ) -> Result<Option<String>, BackendError> {
        let (api, name, finalizers) = (&self.proxies(proxy), &proxy.name_any(), &finalizers);
        self.write_on_fresh(
            api,
            proxy,
            |fresh| fresh.finalizers() == proxy.finalizers(),
            move |based_on| async move {
                // The resourceVersion makes the merge patch conditional: a concurrent change
                // to the finalizer list gives a conflict instead of being overwritten.
                let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": based_on.resource_version()}});
                api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|patched| patched.resource_version())
            },
        )
        .await
    }

    /// Runs `write`, based on `proxy`; after a conflict, again on the fresh object (read through
    /// `api`, the Proxy's namespace, as the write goes) as long as
    /// `unchanged` holds for it: only other fields moved (a label, an annotation, the spec), so
    /// what the write says is still true on top of them, and the round's effects, which have
    /// happened, are not lost with it. Anything else (the object replaced, the field written
    /// by someone else) stays a conflict, and the round is derived again from the fresh object.
    /// Once written, the versions it replaced (`proxy`'s, and the fresh one it went on top of)
    /// are remembered ([`Self::is_superseded`]). Returns what `write` returned.
    async fn write_on_fresh<T, W>(
        &self,
        api: &Api<Proxy>,
        proxy: &Proxy,
        unchanged: impl Fn(&Proxy) -> bool,
        write: impl Fn(Proxy) -> W,
    ) -> Result<T, BackendError>
    where
        W: Future<Output = Result<T, kube::Error>>,
    {
        let mut based_on = proxy.clone();
        for _ in 0..WRITE_ATTEMPTS {
            match write(based_on.clone()).await.map_err(classify) {
                Ok(written) => {
                    self.replaced(proxy, proxy.metadata.resource_version.as_deref());
                    self.replaced(proxy, based_on.metadata.resource_version.as_deref());
                    return Ok(written);
                }
                Err(BackendError::Conflict(message)) => {
                    let fresh = api.get(&proxy.name_any()).await.map_err(classify)?;
                    if fresh.uid() != proxy.uid() || !unchanged(&fresh) {
                        return Err(BackendError::Conflict(message));
                    }
                    based_on = fresh;
                }
                Err(other) => return Err(other),
            }
        }
        Err(BackendError::Conflict(format!(
            "the Proxy changed under {WRITE_ATTEMPTS} writes in a row"
        )))
    }
}

/// Maps a client error onto what the reconciler does with it.
pub fn classify(err: kube::Error) -> BackendError {
    match &err {
        kube::Error::Api(status) if status.code == 409 => BackendError::Conflict(status.message.clone()),
        kube::Error::Api(status) if status.code == 404 => BackendError::Gone(status.message.clone()),
        _ => BackendError::Other(err.to_string()),
    }
}

#[async_trait]
impl ProxyBackend for KubeBackend {
    async fn cloud_init(&self, namespace: &str, secret: &SecretKeyRef) -> Result<UserData, SecretError> {
        let found = self
            .cloud_init_secrets
            .get(&ObjectRef::new(&secret.name).within(namespace));
        let Some(found) = found else {
            return Err(SecretError::cloud_init_unusable(namespace, &secret.name, ""));
        };
        user_data_of(&found, namespace, secret)
    }

    async fn credentials(&self, namespace: &str, secret_name: &str) -> Result<Credentials, SecretError> {
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let secret = secrets
            .get_opt(secret_name)
            .await
            .map_err(|e| SecretError::Transient(e.to_string()))?
            .ok_or_else(|| SecretError::missing(namespace, secret_name, ""))?;
        credentials_of(&secret, namespace, secret_name)
    }

    async fn add_finalizer(&self, proxy: &Proxy) -> Result<Option<String>, BackendError> {
        let mut finalizers = proxy.finalizers().to_vec();
        if finalizers.iter().any(|f| f == FINALIZER) {
            return Ok(None);
        }
        finalizers.push(FINALIZER.to_owned());
        self.set_finalizers(proxy, finalizers).await
    }

    async fn remove_finalizer(&self, proxy: &Proxy) -> Result<(), BackendError> {
        let finalizers: Vec<String> = proxy
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .cloned()
            .collect();
        let result = match self.set_finalizers(proxy, finalizers).await {
            // Already gone: the finalizer is as removed as it gets.
            Err(BackendError::Gone(_)) => Ok(()),
            other => other.map(|_| ()),
        };
        // No status write follows a removal: forget the versions rather than keep them.
        if let Some(uid) = proxy.uid() {
            self.superseded().remove(&short_hash(Some(&uid)));
        }
        result
    }

    async fn write_status(&self, proxy: &Proxy, status: &ProxyStatus) -> Result<(), BackendError> {
        // A full replace (with the resourceVersion read) clears fields that became unset and
        // turns a concurrent status writer into a conflict rather than a lost update.
        let (api, name) = (&self.proxies(proxy), &proxy.name_any());
        self.write_on_fresh(
            api,
            proxy,
            |fresh| fresh.status == proxy.status,
            move |mut updated| async move {
                updated.status = Some(status.clone());
                api.replace_status(name, &PostParams::default(), &updated)
                    .await
                    .map(drop)
            },
        )
        .await
    }

    async fn record(&self, proxy: &Proxy, entry: &AuditEntry, message: &str) -> Result<(), BackendError> {
        let type_ = if reason::WARNINGS.contains(&entry.reason.as_str()) {
            EventType::Warning
        } else {
            EventType::Normal
        };
        let note = format!("{} ({}): {message}", entry.arrow(), entry.reason);
        let event = KubeEvent {
            type_,
            reason: entry.reason.clone(),
            note: Some(note.chars().take(1000).collect()),
            action: entry.event.as_str().to_owned(),
            secondary: None,
        };
        self.events
            .publish(&event, &proxy.object_ref(&()))
            .await
            .map_err(classify)
    }
}
