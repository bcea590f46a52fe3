//! Every lifecycle scenario of machines/scenarios/ replayed in both modes: the real reconciler
//! with the scenario's scripted provider, health, leases and Secrets, and the Proxy object kept
//! by the mode's own store and written through the mode's own backend: the embedded store with
//! `StandaloneBackend`, and a real kube-apiserver with `KubeBackend` (finalizer patches with
//! resourceVersions, status replaces, Events). Each step reads the Proxy back as the mode serves
//! it. Each mode must plan the same effects and write the same statuses as the in-memory replay
//! the snapshots show, and its audit trail (Events; the store's audit log) must hold every
//! transition.

mod support {
    pub mod control_plane;
    pub mod ports;
    pub mod process;
}

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::{Arc, Mutex},
};

use async_trait::async_trait;
use egress_proxies_operator::{
    api::ProxyKey,
    api::{Proxy, ProxySpec},
    cluster::{KubeBackend, events::EventPublisher},
    controller::simulate::{self, EPOCH, InMemory, ProxyObjects, Replay, Scenario},
    effects::BackendError,
    machine::{AuditEntry, EffectKind},
    standalone::{
        StandaloneBackend,
        progress::Progress,
        proxy_of,
        store::{ProxyRecord, Store},
    },
};
use k8s_openapi::api::events::v1::Event;
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::{events::Reporter, reflector},
};
use serde_json::json;
use support::control_plane::ControlPlane;

fn scenario_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("machines/scenarios");
    simulate::scenario_files(&dir).expect("machines/scenarios is readable")
}

fn key(proxy: &Proxy) -> ProxyKey {
    ProxyKey::new(
        &proxy.metadata.namespace.clone().expect("namespaced"),
        &proxy.metadata.name.clone().expect("named"),
    )
}

// ---- standalone: the embedded store ---------------------------------------------------------

/// The Proxy as standalone mode keeps it: a record in the embedded store (read back from disk
/// every time), edited as the manifests-folder runner edits it.
struct Embedded {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    records: Arc<Mutex<HashMap<ProxyKey, ProxyRecord>>>,
    key: Mutex<Option<ProxyKey>>,
}

impl Embedded {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Arc::new(Store::open(dir.path()).expect("store opens"));
        Self {
            _dir: dir,
            store,
            records: Arc::default(),
            key: Mutex::default(),
        }
    }

    fn key(&self) -> ProxyKey {
        self.key.lock().unwrap().clone().expect("created first")
    }

    /// Changes the record as the runner's merge of the manifests folder does.
    fn edit(&self, change: impl FnOnce(&mut ProxyRecord)) -> Result<(), BackendError> {
        self.backend().edit(&self.key(), change)
    }
}

#[async_trait]
impl ProxyObjects for Embedded {
    type Backend = StandaloneBackend;
    fn backend(&self) -> StandaloneBackend {
        StandaloneBackend::new(
            self.store.clone(),
            self.records.clone(),
            Arc::default(),
            Arc::new(Progress::default()),
        )
    }
    async fn create(&self, proxy: &Proxy) -> Result<(), BackendError> {
        let key = key(proxy);
        let record = ProxyRecord {
            uid: proxy.metadata.uid.clone().expect("uid"),
            generation: 1,
            spec: serde_json::to_value(&proxy.spec).expect("spec serializes"),
            source: "scenario.yaml".to_owned(),
            finalizer: proxy.metadata.finalizers.is_some(),
            created: EPOCH,
            status: proxy.status.clone(),
            ..ProxyRecord::default()
        };
        self.store.save(&key, &record).expect("saved");
        self.records.lock().unwrap().insert(key.clone(), record);
        *self.key.lock().unwrap() = Some(key);
        Ok(())
    }
    async fn get(&self) -> Result<Option<Proxy>, BackendError> {
        let key = self.key();
        let stored = self
            .store
            .reader()
            .get(&key)
            .map_err(|e| BackendError::Other(e.to_string()))?;
        // What the backend writes through and what is on disk never part.
        assert_eq!(stored.as_ref(), self.records.lock().unwrap().get(&key));
        Ok(stored.and_then(|record| proxy_of(&key, &record)))
    }
    async fn edit_spec(&self, spec: &ProxySpec) -> Result<(), BackendError> {
        self.edit(|record| {
            record.spec = serde_json::to_value(spec).expect("spec serializes");
            record.generation += 1;
        })
    }
    async fn delete(&self) -> Result<(), BackendError> {
        // As the runner does: a record without the finalizer goes at once.
        let key = self.key();
        if self
            .records
            .lock()
            .unwrap()
            .get(&key)
            .is_some_and(|r| !r.finalizer)
        {
            self.records.lock().unwrap().remove(&key);
            return self
                .store
                .remove(&key)
                .map_err(|e| BackendError::Other(e.to_string()));
        }
        self.edit(|record| {
            record.deleting = true;
            record.deletion_time = Some(EPOCH);
            record.generation += 1;
        })
    }
    async fn strip_finalizers(&self) -> Result<(), BackendError> {
        self.edit(|record| record.finalizer = false)
    }
    async fn annotate(&self, key: &str, value: &str) -> Result<(), BackendError> {
        // As the runner does when a manifest's annotations change: no generation moves.
        self.edit(|record| {
            record.annotations.insert(key.to_owned(), value.to_owned());
        })
    }
}

// ---- cluster: the API server ----------------------------------------------------------------

/// The Proxy as cluster mode keeps it: an object in the API server, read with a real
/// `kube::Client`, edited as `kubectl` would.
struct ApiServer {
    client: Client,
}

impl ApiServer {
    /// Namespace `sim` of the API server as a fresh scenario expects it: no Proxy (its
    /// finalizer stripped if a scenario left one), no Events.
    async fn cleared(client: &Client) -> Self {
        let api = Self {
            client: client.clone(),
        };
        if api.get().await.expect("reading the Proxy").is_some() {
            let _ = api.strip_finalizers().await;
            let _ = api.delete().await;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while api.get().await.expect("reading the Proxy").is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "the last scenario's Proxy is not gone"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let events: Api<Event> = Api::namespaced(client.clone(), "sim");
        events
            .delete_collection(&DeleteParams::default(), &Default::default())
            .await
            .expect("deleting the last scenario's Events");
        api
    }

    fn proxies(&self) -> Api<Proxy> {
        Api::namespaced(self.client.clone(), "sim")
    }

    /// Every Event about the Proxy: reason → how many times it was observed.
    async fn event_counts(&self) -> BTreeMap<String, i32> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), "sim");
        let mut counts = BTreeMap::new();
        for event in events.list(&Default::default()).await.expect("events list") {
            let reason = event.reason.clone().expect("an Event has a reason");
            *counts.entry(reason).or_default() += event.series.map_or(1, |s| s.count);
        }
        counts
    }
}

fn kube_error(err: kube::Error) -> BackendError {
    BackendError::Other(err.to_string())
}

#[async_trait]
impl ProxyObjects for ApiServer {
    type Backend = KubeBackend;
    fn backend(&self) -> KubeBackend {
        let reporter = Reporter {
            controller: "egress-proxies-operator".to_owned(),
            instance: Some("scenario".to_owned()),
        };
        let (cloud_init_secrets, _writer) = reflector::store();
        KubeBackend::new(
            self.client.clone(),
            EventPublisher::new(self.client.clone(), reporter),
            cloud_init_secrets,
        )
    }
    async fn create(&self, proxy: &Proxy) -> Result<(), BackendError> {
        let mut object = proxy.clone();
        object.status = None;
        let created = self
            .proxies()
            .create(&PostParams::default(), &object)
            .await
            .map_err(kube_error)?;
        if let Some(status) = &proxy.status {
            let mut with_status = created;
            with_status.status = Some(status.clone());
            self.proxies()
                .replace_status("proxy", &PostParams::default(), &with_status)
                .await
                .map_err(kube_error)?;
        }
        Ok(())
    }
    async fn get(&self) -> Result<Option<Proxy>, BackendError> {
        self.proxies().get_opt("proxy").await.map_err(kube_error)
    }
    async fn edit_spec(&self, spec: &ProxySpec) -> Result<(), BackendError> {
        self.proxies()
            .patch(
                "proxy",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": spec})),
            )
            .await
            .map(drop)
            .map_err(kube_error)
    }
    async fn delete(&self) -> Result<(), BackendError> {
        self.proxies()
            .delete("proxy", &DeleteParams::default())
            .await
            .map(drop)
            .map_err(kube_error)
    }
    async fn strip_finalizers(&self) -> Result<(), BackendError> {
        let patch = json!({"metadata": {"finalizers": null}});
        self.proxies()
            .patch("proxy", &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map(drop)
            .map_err(kube_error)
    }
    async fn annotate(&self, key: &str, value: &str) -> Result<(), BackendError> {
        // As `kubectl annotate` does.
        let patch = json!({"metadata": {"annotations": {key: value}}});
        self.proxies()
            .patch("proxy", &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map(drop)
            .map_err(kube_error)
    }
}

// ---- the comparison -------------------------------------------------------------------------

/// Asserts that `replay` (in `mode`) did what the in-memory `reference` did: the same
/// transitions, plans, status writes (field by field) and final status.
fn assert_same(stem: &str, mode: &str, reference: &Replay, replay: &Replay) {
    let trail = reference.render();
    assert_eq!(
        replay.render(),
        trail,
        "{stem}: the {mode} trail differs from the in-memory one"
    );
    assert_eq!(
        replay.steps.len(),
        reference.steps.len(),
        "{stem} ({mode}): steps"
    );
    for (ours, theirs) in replay.steps.iter().zip(&reference.steps) {
        let at = ours.at;
        assert_eq!(
            ours.outcome.audit, theirs.outcome.audit,
            "{stem} ({mode}) +{at}s: transitions"
        );
        assert_eq!(
            ours.outcome.plans, theirs.outcome.plans,
            "{stem} ({mode}) +{at}s: plans"
        );
        assert_eq!(
            ours.written, theirs.written,
            "{stem} ({mode}) +{at}s: status write"
        );
    }
    assert_eq!(
        replay.status, reference.status,
        "{stem} ({mode}): final status\n{trail}"
    );
    assert_eq!(replay.creates, reference.creates, "{stem} ({mode}): create calls");
}

/// The transitions whose row records them (`record_event`): the persisted audit trail.
fn recorded(replay: &Replay) -> impl Iterator<Item = &AuditEntry> {
    replay
        .audit()
        .filter(|entry| entry.effects.contains(&EffectKind::RecordEvent))
}

/// The recorded transitions of the replay, by reason.
fn recorded_counts(replay: &Replay) -> BTreeMap<String, i32> {
    let mut counts = BTreeMap::new();
    for entry in recorded(replay) {
        *counts.entry(entry.reason.clone()).or_default() += 1;
    }
    counts
}

#[tokio::test]
async fn every_scenario_plans_and_writes_the_same_in_standalone_mode() {
    let files = scenario_files();
    assert!(files.len() >= 25, "the scenarios ship");
    for path in files {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let scenario = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let reference = scenario.replay_in(&InMemory::default()).await.unwrap();
        let embedded = Embedded::new();
        let replay = scenario
            .replay_in(&embedded)
            .await
            .unwrap_or_else(|e| panic!("{stem} in standalone mode: {e}"));
        assert_same(&stem, "standalone", &reference, &replay);
        // The store's audit log holds every transition its row records, in order (a deleted
        // Proxy's log goes with it).
        let key = ProxyKey::new("sim", "proxy");
        if embedded.store.reader().get(&key).unwrap().is_some() {
            let logged: Vec<_> = embedded
                .store
                .reader()
                .audit(&key)
                .unwrap()
                .into_iter()
                .map(|line| line.entry)
                .collect();
            let audit: Vec<_> = recorded(&replay).cloned().collect();
            assert_eq!(logged, audit, "{stem}: the stored audit log");
        }
    }
}

#[tokio::test]
async fn every_scenario_plans_and_writes_the_same_in_cluster_mode() {
    let (_plane, client) = ControlPlane::with_crds(&["sim"]).await;
    for path in scenario_files() {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let scenario = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let reference = scenario.replay_in(&InMemory::default()).await.unwrap();
        let api = ApiServer::cleared(&client).await;
        let replay = scenario
            .replay_in(&api)
            .await
            .unwrap_or_else(|e| panic!("{stem} in cluster mode: {e}"));
        assert_same(&stem, "cluster", &reference, &replay);
        // Every transition its row records is an Event (repeats folded into a series, as
        // client-go does).
        assert_eq!(
            api.event_counts().await,
            recorded_counts(&replay),
            "{stem}: Events by reason\n{}",
            replay.render()
        );
    }
}
