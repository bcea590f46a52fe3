//! Cluster mode: leader election, then the controller, health engine, lease store (checkpointed
//! into a ConfigMap), discovery API, provider-health monitor and orphan GC — all only while this
//! replica leads. Losing the lease stops acting: `run_cluster` returns an error and the process
//! exits, so Kubernetes restarts it as a follower.

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{ConfigMap, Namespace},
};
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, ObjectMeta, PostParams},
};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use super::{AppError, DiscoveryAuthOptions, discovery_authenticator, proxy_key};
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
            Checkpoint, CheckpointError, CheckpointStore, MaintenanceConfig, decode_chunks, encode_chunks,
            maintenance,
        },
        token::LeaseSigner,
    },
    monitor::{Monitor, kube_sink::KubeHealthSink},
    provider::{Installation, ProviderRegistry},
    telemetry::{
        Metrics,
        admin::{self, serve_admin},
    },
};

/// Name of the Lease used for leader election and of the ConfigMap holding the lease checkpoint.
pub const LEADER_LEASE: &str = "egress-proxies-operator";
/// ConfigMap data values stay well under the 1 MiB object limit.
const CHECKPOINT_CHUNK_BYTES: usize = 256 * 1024;

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

/// The lease checkpoint in a ConfigMap (one data key per chunk).
pub struct ConfigMapCheckpoint {
    api: Api<ConfigMap>,
}

impl ConfigMapCheckpoint {
    /// In `namespace`, named [`LEADER_LEASE`].
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
        }
    }
}

#[async_trait]
impl CheckpointStore for ConfigMapCheckpoint {
    async fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let found = self
            .api
            .get_opt(LEADER_LEASE)
            .await
            .map_err(|e| CheckpointError::Backend(e.to_string()))?;
        let chunks: Vec<String> = found
            .and_then(|cm| cm.data)
            .map(|d| d.into_values().collect())
            .unwrap_or_default();
        decode_chunks(&chunks)
    }

    async fn save(&self, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
        let chunks = encode_chunks(checkpoint, CHECKPOINT_CHUNK_BYTES)?;
        let data: BTreeMap<String, String> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, c)| (format!("chunk-{i:04}"), c))
            .collect();
        let existing = self
            .api
            .get_opt(LEADER_LEASE)
            .await
            .map_err(|e| CheckpointError::Backend(e.to_string()))?;
        let result = match existing {
            Some(mut cm) => {
                cm.data = Some(data);
                self.api.replace(LEADER_LEASE, &PostParams::default(), &cm).await
            }
            None => {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(LEADER_LEASE.to_owned()),
                        ..ObjectMeta::default()
                    },
                    data: Some(data),
                    ..ConfigMap::default()
                };
                self.api.create(&PostParams::default(), &cm).await
            }
        };
        result
            .map(|_| ())
            .map_err(|e| CheckpointError::Backend(e.to_string()))
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
    tokio::spawn(serve_admin(admin_listener, admin_rx, registry.clone(), stopped()));

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
        MaintenanceConfig::default(),
        stopped(),
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
    tokio::spawn(monitor.run(Duration::from_secs(30), stopped()));
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
            if trigger_tx.send(proxy_key(&event.key)).await.is_err() {
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
    };
    let controller = tokio::spawn(run_controller(deps, triggers, caches_tx, controller_stop));
    // Readiness follows the caches and the leadership.
    let readiness = tokio::spawn({
        let mut leadership = leadership.clone();
        async move {
            loop {
                let state = admin::Readiness {
                    caches_synced: *caches_rx.borrow(),
                    leader: *leadership.borrow() == Leadership::Leader,
                };
                admin_tx.send_replace(state);
                discovery_ready_tx.send_replace(Readiness {
                    synced: state.caches_synced,
                    leader: state.leader,
                });
                tokio::select! {
                    changed = caches_rx.changed() => if changed.is_err() { break },
                    changed = leadership.changed() => if changed.is_err() { break },
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
            let key = crate::effects::ProxyKey {
                namespace: proxy.namespace().unwrap_or_default(),
                name: proxy.name_any(),
            };
            if triggers.send(key).await.is_err() {
                return;
            }
        }
    }
}
