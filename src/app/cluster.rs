//! Cluster mode: leader election, then the controller, health engine, lease store (checkpointed
//! into ConfigMaps, a part per lease-store shard), discovery API, provider-health monitor and orphan GC — all only while this
//! replica leads. Losing the lease stops acting: `run_cluster` returns an error and the process
//! exits, so Kubernetes restarts it as a follower.

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{ConfigMap, Namespace, ObjectReference},
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
    runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter},
};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use super::{AppError, DiscoveryAuthOptions, discovery_authenticator};
use crate::{
    api::Proxy,
    config::ProvidersConfig,
    controller::{
        ProviderAvailability, ReconcilerConfig,
        cluster::{
            ClusterDeps,
            leader::{LeaderElector, LeaderTimings, Leadership},
            run_controller,
        },
    },
    discovery::{self, DiscoveryConfig, DiscoveryMetrics, DiscoveryState, Readiness},
    gc::{self, GcConfig, KubeLiveOwners, gc_enabled},
    health::{HealthConfig, HealthEngine},
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{
            Checkpoint, CheckpointError, CheckpointHealth, CheckpointReport, CheckpointStore,
            MaintenanceConfig, Written, decode, decode_chunks, encode_chunks, maintenance,
        },
        token::LeaseSigner,
    },
    monitor::{Monitor, kube_sink::KubeHealthSink},
    provider::{Installation, ProviderRegistry},
    telemetry::{
        Metrics,
        admin::{self, StatusPageSlot, serve_admin_with_ui},
    },
    ui::{StatusPage, cluster::ClusterFeed},
};

/// Name of the Lease used for leader election (and the prefix of the lease checkpoint's
/// ConfigMaps).
pub const LEADER_LEASE: &str = "egress-proxies-operator";

/// Options of cluster mode.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Providers config file.
    pub providers_config: PathBuf,
    /// Watch only this namespace.
    pub namespace: Option<String>,
    /// Run orphan GC even in namespace-restricted mode.
    pub gc_allow_namespaced: bool,
    /// Only log what GC would delete.
    pub gc_dry_run: bool,
    /// GC never collects an instance younger than this (its create may be in flight).
    pub gc_grace: Duration,
    /// Time between two GC passes.
    pub gc_interval: Duration,
    /// The lifecycle's timers, retry backoff and pool budgets.
    pub reconciler: ReconcilerConfig,
    /// How often the provider-health monitor probes each provider instance.
    pub provider_probe_interval: Duration,
    /// Namespace of the leader Lease and the lease checkpoint (the operator's own).
    pub system_namespace: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// This installation's name in the cluster (the operator's namespace by default): with
    /// the cluster's identity, what every instance is stamped with and GC acts on.
    pub installation_name: String,
    /// Admin server (`/healthz`, `/readyz`, `/metrics`).
    pub admin_listen: SocketAddr,
    /// Discovery API.
    pub discovery_listen: SocketAddr,
    /// Authentication of the discovery API.
    pub auth: DiscoveryAuthOptions,
    /// HMAC key signing lease tokens, shared by all replicas (a mounted Secret).
    pub signing_key: PathBuf,
    /// Parallel reconciles.
    pub concurrency: u16,
}

/// The lease checkpoint in ConfigMaps: one or more per lease-store shard, named
/// `egress-proxies-operator-leases-<shard>-<part>` and labelled
/// [`CHECKPOINT_LABEL`]`=`[`LEADER_LEASE`], each holding a self-contained checkpoint of at most
/// [`CHECKPOINT_PART_BYTES`] (JSON in the `checkpoint.json` key). A save rewrites only the
/// changed shard's parts (one server-side apply each) and deletes parts it no longer needs; a
/// load lists them by label and joins them. Before this layout the checkpoint was one ConfigMap
/// named [`LEADER_LEASE`] (a key per chunk); it is read when no part exists.
pub struct ConfigMapCheckpoint {
    api: Api<ConfigMap>,
    /// Parts each shard has in the API, as last loaded or saved: what a save may delete.
    parts: std::sync::Mutex<BTreeMap<usize, usize>>,
}

/// Label on every lease checkpoint part.
pub const CHECKPOINT_LABEL: &str = "crawl.example.com/lease-checkpoint";
/// Most checkpoint JSON in one ConfigMap: half of the 1 MiB object limit, so the object (its
/// data JSON-escaped in the request) stays under it and under etcd's 1.5 MiB request limit.
pub const CHECKPOINT_PART_BYTES: usize = 512 * 1024;
const CHECKPOINT_KEY: &str = "checkpoint.json";
const SHARD_ANNOTATION: &str = "crawl.example.com/lease-checkpoint-shard";

fn part_name(shard: usize, part: usize) -> String {
    format!("{LEADER_LEASE}-leases-{shard:02}-{part}")
}

impl ConfigMapCheckpoint {
    /// In `namespace`.
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            parts: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn backend(error: kube::Error) -> CheckpointError {
        CheckpointError::Backend(error.to_string())
    }

    fn known_parts(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        self.parts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The layout before per-shard parts: one ConfigMap, a data key per chunk.
    async fn load_single(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let found = self.api.get_opt(LEADER_LEASE).await.map_err(Self::backend)?;
        let chunks: Vec<String> = found
            .and_then(|cm| cm.data)
            .map(|d| d.into_values().collect())
            .unwrap_or_default();
        decode_chunks(&chunks)
    }
}

#[async_trait]
impl CheckpointStore for ConfigMapCheckpoint {
    async fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        // Pages of a few parts: a 100,000-lease checkpoint is tens of MiB in all.
        let mut params = ListParams::default()
            .labels(&format!("{CHECKPOINT_LABEL}={LEADER_LEASE}"))
            .limit(8);
        let mut parts = Vec::new();
        let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
        loop {
            let page = self.api.list(&params).await.map_err(Self::backend)?;
            for cm in page.items {
                let shard = cm
                    .annotations()
                    .get(SHARD_ANNOTATION)
                    .and_then(|s| s.parse::<usize>().ok());
                let Some(json) = cm.data.as_ref().and_then(|d| d.get(CHECKPOINT_KEY)) else {
                    continue;
                };
                parts.push(decode(json.as_bytes())?);
                if let Some(shard) = shard {
                    *counts.entry(shard).or_insert(0) += 1;
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        if parts.is_empty() {
            return self.load_single().await;
        }
        *self.known_parts() = counts;
        Ok(Checkpoint::merge(parts))
    }

    /// The whole checkpoint as shard 0's parts: being newer, it wins over every older part
    /// when parts are merged. [`maintenance`] saves per shard instead.
    async fn save(&self, checkpoint: &Checkpoint) -> Result<Written, CheckpointError> {
        self.save_shard(0, checkpoint).await
    }

    fn per_shard(&self) -> bool {
        true
    }

    async fn save_shard(&self, shard: usize, part: &Checkpoint) -> Result<Written, CheckpointError> {
        let chunks = encode_chunks(part, CHECKPOINT_PART_BYTES)?;
        let mut written = Written::default();
        let params = PatchParams::apply(LEADER_LEASE).force();
        for (i, chunk) in chunks.iter().enumerate() {
            let name = part_name(shard, i);
            let cm = serde_json::json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": name,
                    "labels": { CHECKPOINT_LABEL: LEADER_LEASE },
                    "annotations": { SHARD_ANNOTATION: shard.to_string() },
                },
                "data": { CHECKPOINT_KEY: chunk },
            });
            self.api
                .patch(&name, &params, &Patch::Apply(&cm))
                .await
                .map_err(Self::backend)?;
            written += Written {
                objects: 1,
                bytes: chunk.len() as u64,
            };
        }
        let had = self.known_parts().get(&shard).copied().unwrap_or(0);
        // Parts past the new count hold proxies the new parts also hold (or that are gone).
        for i in chunks.len()..had {
            match self
                .api
                .delete(&part_name(shard, i), &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(Self::backend(error)),
            }
            written.objects += 1;
        }
        self.known_parts().insert(shard, chunks.len());
        Ok(written)
    }
}

/// Runs cluster mode until `shutdown` resolves (Ok) or leadership is lost (Err).
pub async fn run_cluster(
    client: Client,
    options: ClusterOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let config = ProvidersConfig::load(&options.providers_config)?;
    let installation = Installation::new(cluster_identity(&client).await?, &options.installation_name);
    info!(installation = %installation, "installation identity");
    // kubernetes provider instances create their Pods through the operator's own client.
    let providers = ProviderRegistry::for_installation(&config, Some(client.clone()), &installation)?;
    // Checked (and token files read) before leading: a misconfigured replica fails at start.
    let auth = discovery_authenticator(&options.auth, Some((&client, &options.system_namespace))).await?;
    let signing_key = std::fs::read(&options.signing_key)
        .map_err(|e| AppError::Startup(format!("reading {}: {e}", options.signing_key.display())))?;
    let signer =
        LeaseSigner::new(&signing_key).map_err(|e| AppError::Startup(format!("lease signing key: {e}")))?;

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let discovery_metrics = DiscoveryMetrics::register(&mut registry);
    let checkpoint_report = CheckpointReport::default();
    checkpoint_report.register(&mut registry);
    let registry = Arc::new(registry);

    // Shutdown fans out to every task.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
    }

    let (admin_tx, admin_rx) = watch::channel(admin::Readiness::default());
    let admin_listener = tokio::net::TcpListener::bind(options.admin_listen)
        .await
        .map_err(|e| {
            AppError::Startup(format!(
                "binding the admin server on {}: {e}",
                options.admin_listen
            ))
        })?;
    let status_page = StatusPageSlot::default();
    tokio::spawn(serve_admin_with_ui(
        admin_listener,
        admin_rx,
        registry.clone(),
        status_page.clone(),
        stopped(),
    ));

    // Leader election first: nothing acts before this replica leads.
    let (leader_tx, mut leadership) = watch::channel(Leadership::Unknown);
    let elector = LeaderElector::new(
        Api::<Lease>::namespaced(client.clone(), &options.system_namespace),
        LEADER_LEASE,
        &options.identity,
        LeaderTimings::default(),
    );
    tokio::spawn(elector.run(leader_tx, stopped()));
    info!(identity = %options.identity, "waiting for leadership");
    tokio::select! {
        _ = leadership.wait_for(|l| *l == Leadership::Leader) => {}
        _ = stopped() => return Ok(()),
    }
    info!("leading: starting the controller");

    let store = LeaseStore::new(LeaseStoreConfig::default());
    let checkpoint = Arc::new(ConfigMapCheckpoint::new(
        client.clone(),
        &options.system_namespace,
    ));
    match checkpoint.load().await {
        Ok(Some(saved)) => {
            info!(leases = saved.lease_count(), "lease checkpoint restored");
            store.restore(&saved);
        }
        Ok(None) => {}
        Err(err) => {
            warn!(error = %err, "lease checkpoint unreadable; leases are honoured by their signed tokens")
        }
    }
    let (health_handle, mut health_events) = HealthEngine::start(HealthConfig {
        probe_metrics: Some(metrics.probe_metrics()),
        ..HealthConfig::default()
    })
    .map_err(|e| AppError::Startup(e.to_string()))?;
    let availability = ProviderAvailability::default();
    let (caches_tx, mut caches_rx) = watch::channel(false);
    let (discovery_ready_tx, discovery_ready) = watch::channel(Readiness::default());
    let status_feed = ClusterFeed::default();
    let page = Arc::new(StatusPage::new(
        Arc::new(status_feed.clone()),
        store.clone(),
        health_handle.clone(),
        availability.clone(),
        providers.iter().map(|(name, _)| name.to_owned()).collect(),
        auth.clone(),
    ));
    let health_log = page.health_log();
    let _ = status_page.set(page);
    let discovery_state = DiscoveryState::new(
        store.clone(),
        signer,
        auth,
        discovery_ready,
        registry.clone(),
        discovery_metrics,
        DiscoveryConfig::default(),
    );
    let discovery_listener = tokio::net::TcpListener::bind(options.discovery_listen)
        .await
        .map_err(|e| {
            AppError::Startup(format!(
                "binding the discovery API on {}: {e}",
                options.discovery_listen
            ))
        })?;
    tokio::spawn(discovery::serve(discovery_listener, discovery_state, stopped()));
    tokio::spawn(maintenance(
        store.clone(),
        Some(checkpoint as Arc<dyn CheckpointStore>),
        MaintenanceConfig {
            report: checkpoint_report.clone(),
            ..MaintenanceConfig::default()
        },
        stopped(),
    ));
    tokio::spawn(report_checkpoint_health(
        client.clone(),
        options.system_namespace.clone(),
        options.identity.clone(),
        checkpoint_report.subscribe(),
    ));

    let (trigger_tx, trigger_rx) = mpsc::channel(1024);
    // A provider that comes back (or goes away) re-reconciles its Proxies now, rather than at
    // their next requeue.
    let (flipped_tx, flipped_rx) = mpsc::unbounded_channel::<String>();
    tokio::spawn(reconcile_providers_proxies(
        client.clone(),
        options.namespace.clone(),
        flipped_rx,
        trigger_tx.clone(),
    ));
    let monitor = Monitor::new(
        providers.clone(),
        availability.clone(),
        Arc::new(KubeHealthSink::new(client.clone())),
        Duration::from_secs(10),
    )
    .with_metrics(metrics.clone())
    .on_change(Arc::new(move |provider: &str| {
        let _ = flipped_tx.send(provider.to_owned());
    }));
    tokio::spawn(monitor.run(options.provider_probe_interval, stopped()));
    if gc_enabled(options.namespace.as_deref(), options.gc_allow_namespaced) {
        let gc_config = GcConfig {
            grace: options.gc_grace,
            dry_run: options.gc_dry_run,
            namespace: options.namespace.clone(),
        };
        info!(
            namespace = %options.namespace.as_deref().unwrap_or("(all)"),
            dry_run = options.gc_dry_run,
            grace = ?options.gc_grace,
            interval = ?options.gc_interval,
            "orphan GC enabled"
        );
        tokio::spawn(gc::run(
            providers.clone(),
            KubeLiveOwners::new(client.clone()),
            gc_config,
            options.gc_interval,
            Some(metrics.clone()),
            stopped(),
        ));
    } else {
        warn!(
            namespace = %options.namespace.as_deref().unwrap_or_default(),
            "orphan GC is disabled in namespace-restricted mode (pass --gc-allow-namespaced to enable it)"
        );
    }

    tokio::spawn(async move {
        while let Some(event) = health_events.recv().await {
            health_log.record(&event);
            if trigger_tx.send(event.key.clone()).await.is_err() {
                break;
            }
        }
    });
    let triggers = futures::stream::unfold(
        trigger_rx,
        |mut rx| async move { rx.recv().await.map(|k| (k, rx)) },
    );

    // The controller stops on shutdown or when leadership is lost.
    let mut lost = leadership.clone();
    let controller_stop = {
        let stopped = stopped();
        async move {
            tokio::select! {
                _ = stopped => {}
                _ = lost.wait_for(|l| *l != Leadership::Leader) => {}
            }
        }
    };
    let deps = ClusterDeps {
        client,
        providers,
        leases: Arc::new(store),
        health: Arc::new(health_handle),
        availability,
        reconciler: options.reconciler.clone(),
        namespace: options.namespace.clone(),
        concurrency: options.concurrency,
        debounce: Duration::from_millis(200),
        identity: options.identity.clone(),
        metrics,
        status_feed: Some(status_feed),
    };
    let controller = tokio::spawn(run_controller(deps, triggers, caches_tx, controller_stop));
    // Readiness follows the caches, the leadership and the lease checkpoint's health.
    let readiness = tokio::spawn({
        let mut leadership = leadership.clone();
        let mut checkpoint_health = checkpoint_report.subscribe();
        async move {
            // The controller may drop its caches sender once synced: the others still matter.
            let mut caches_open = true;
            loop {
                let state = admin::Readiness {
                    caches_synced: *caches_rx.borrow(),
                    leader: *leadership.borrow() == Leadership::Leader,
                    checkpoint_failing: checkpoint_health.borrow_and_update().failing.is_some(),
                };
                admin_tx.send_replace(state);
                discovery_ready_tx.send_replace(state);
                tokio::select! {
                    changed = caches_rx.changed(), if caches_open => caches_open = changed.is_ok(),
                    changed = leadership.changed() => if changed.is_err() { break },
                    changed = checkpoint_health.changed() => if changed.is_err() { break },
                }
            }
        }
    });
    let _ = controller.await;
    readiness.abort();
    let lost_leadership = *leadership.borrow() != Leadership::Leader && !*stop_tx.borrow();
    let _ = stop_tx.send(true);
    if lost_leadership {
        return Err(AppError::Startup(
            "lost leadership: stopping so a restart rejoins as a follower".to_owned(),
        ));
    }
    Ok(())
}

/// Publishes an Event on the leader Lease when lease checkpoint saves start failing (Warning
/// `LeaseCheckpointFailed`, with the error) and when they succeed again (Normal
/// `LeaseCheckpointRecovered`): the metric and `/readyz` say it too, the Event says it where
/// `kubectl describe lease` looks.
async fn report_checkpoint_health(
    client: Client,
    namespace: String,
    identity: String,
    mut health: watch::Receiver<CheckpointHealth>,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: LEADER_LEASE.to_owned(),
            instance: Some(identity),
        },
    );
    let lease = ObjectReference {
        api_version: Some("coordination.k8s.io/v1".to_owned()),
        kind: Some("Lease".to_owned()),
        name: Some(LEADER_LEASE.to_owned()),
        namespace: Some(namespace),
        ..ObjectReference::default()
    };
    let mut failing = false;
    while health.changed().await.is_ok() {
        let now = health.borrow_and_update().clone();
        let event = match (&now.failing, failing) {
            (Some(error), false) => KubeEvent {
                type_: EventType::Warning,
                reason: "LeaseCheckpointFailed".to_owned(),
                // Errors name objects and limits, never credentials: checkpoints hold none.
                note: Some(
                    format!("saving the lease checkpoint failed (retrying every second): {error}")
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "SaveLeaseCheckpoint".to_owned(),
                secondary: None,
            },
            (None, true) => KubeEvent {
                type_: EventType::Normal,
                reason: "LeaseCheckpointRecovered".to_owned(),
                note: Some("the lease checkpoint is saved again".to_owned()),
                action: "SaveLeaseCheckpoint".to_owned(),
                secondary: None,
            },
            _ => continue,
        };
        failing = now.failing.is_some();
        if let Err(error) = recorder.publish(&event, &lease).await {
            warn!(%error, "publishing the lease checkpoint Event failed");
        }
    }
}

/// The cluster's identity: the UID of its `kube-system` namespace, which lives as long as the
/// cluster and differs between clusters (needs `get` on namespaces).
pub async fn cluster_identity(client: &Client) -> Result<String, AppError> {
    let namespace = Api::<Namespace>::all(client.clone())
        .get("kube-system")
        .await
        .map_err(|err| {
            AppError::Startup(format!(
                "reading the cluster identity (the kube-system namespace's UID) failed: {err} \
                 (the operator needs get on namespaces, see config/rbac/role.yaml)"
            ))
        })?;
    namespace
        .metadata
        .uid
        .filter(|uid| !uid.is_empty())
        .ok_or_else(|| AppError::Startup("the kube-system namespace has no UID".to_owned()))
}

/// Sends the key of every Proxy (in `namespace`, if restricted) on a provider whose availability
/// flipped (names arrive on `flipped`, e.g. from [`Monitor::on_change`]) to the controller.
pub async fn reconcile_providers_proxies(
    client: Client,
    namespace: Option<String>,
    mut flipped: mpsc::UnboundedReceiver<String>,
    triggers: mpsc::Sender<crate::effects::ProxyKey>,
) {
    let api: Api<Proxy> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    while let Some(provider) = flipped.recv().await {
        let proxies = match api.list(&ListParams::default()).await {
            Ok(list) => list.items,
            // The Proxies still requeue on their own timers.
            Err(err) => {
                warn!(provider = %provider, error = %err, "listing Proxies after a provider flip failed");
                continue;
            }
        };
        for proxy in proxies.iter().filter(|p| p.spec.provider == provider) {
            let key =
                crate::effects::ProxyKey::new(&proxy.namespace().unwrap_or_default(), &proxy.name_any());
            if triggers.send(key).await.is_err() {
                return;
            }
        }
    }
}
