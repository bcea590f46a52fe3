//! Cluster mode: everything that talks to Kubernetes. Leader election first ([`leader`]); then,
//! only while this replica leads, the core ([`crate::app::start_core`]) over this mode's
//! adapters — lease checkpoints in ConfigMaps ([`checkpoint`]), `ProviderHealth` objects
//! ([`health_sink`]), live owners from the API server ([`owners`]), the status page fed from
//! the controller's cache ([`ui`]) — and the controller ([`controller`]: kube-runtime wiring, its
//! backend for finalizers, status and Events ([`backend`], [`events`]), the resync sweep
//! ([`resync`]) and the triggers it reads from its reflectors ([`triggers`])), and the gateway
//! rules' recycle requests as annotation patches ([`recycle`]). Losing the lease
//! stops acting: [`run_cluster`] returns an error and the process exits, so Kubernetes restarts
//! it as a follower.
//!
//! Owns: every Kubernetes object the operator reads or writes for itself (Proxies' status and
//! finalizers, Events, the leader Lease, checkpoint ConfigMaps, ProviderHealth, the cluster's
//! identity). Must not touch: the state folder, or anything of [`crate::standalone`]
//! (tests/mode_isolation.rs checks it); what the modes share lives in the core.

pub mod backend;
pub mod checkpoint;
pub mod controller;
pub mod events;
pub mod health_sink;
pub mod history;
pub mod leader;
pub mod owners;
pub mod recycle;
pub mod resync;
pub mod triggers;
pub mod ui;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use k8s_openapi::api::{coordination::v1::Lease, core::v1::Namespace};
use kube::{Api, Client};
use tokio::sync::watch;
use tracing::{info, warn};

pub use backend::KubeBackend;
pub use checkpoint::{CHECKPOINT_LABEL, CHECKPOINT_PART_BYTES, ConfigMapCheckpoint};
pub use controller::{CONTROLLER_NAME, ClusterDeps, run_controller};
pub use health_sink::KubeHealthSink;
use leader::{LeaderElector, LeaderTimings, Leadership};
pub use owners::KubeLiveOwners;
use ui::ClusterFeed;

use crate::{
    app::{
        AppError, CoreAdapters, CoreFlags, CoreMetrics, DiscoveryAuthOptions, GatewayOptions, StatusPageAt,
        StopSignal, discovery_authenticator, start_core,
    },
    config::ProvidersConfig,
    controller::ReconcilerConfig,
    discovery::{Readiness, auth::Authenticator},
    gc::{GcConfig, LiveOwners, gc_enabled},
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{CheckpointHealth, CheckpointStore},
        token::LeaseSigner,
    },
    provider::{Installation, ProviderRegistry},
    telemetry::admin::{self, StatusPageSlot, serve_admin_with_ui},
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
    /// The cluster's identity as given (`--cluster-id`), for an install that may not read the
    /// kube-system namespace (namespace-restricted with its Role alone); `None` reads it.
    pub cluster_id: Option<String>,
    /// Publish `ProviderHealth` objects (cluster-scoped). Off, provider health is still probed,
    /// gates provisioning and shows in metrics, `/readyz` and the logs.
    pub provider_health_objects: bool,
    /// Admin server (`/healthz`, `/readyz`, `/metrics`).
    pub admin_listen: SocketAddr,
    /// Discovery API.
    pub discovery_listen: SocketAddr,
    /// The gateway and the quotas (rules and quotas validated before start).
    pub gateway: GatewayOptions,
    /// Authentication of the discovery API.
    pub auth: DiscoveryAuthOptions,
    /// HMAC key signing lease tokens, shared by all replicas (a mounted Secret).
    pub signing_key: PathBuf,
    /// Parallel reconciles.
    pub concurrency: u16,
}

/// Runs cluster mode until `shutdown` resolves (Ok) or leadership is lost (Err).
pub async fn run_cluster(
    client: Client,
    options: ClusterOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let config = ProvidersConfig::load(&options.providers_config)?;
    let metrics = CoreMetrics::register(|_| {});
    let stop = StopSignal::on(shutdown);
    // Serving /healthz while the identity is awaited: a replica waiting for RBAC is alive.
    let admin = start_admin(options.admin_listen, &metrics, &stop).await?;
    let cluster_id = match &options.cluster_id {
        Some(id) => id.clone(),
        None => wait_for_cluster_identity(&client, &stop).await?,
    };
    let installation = Installation::new(cluster_id, &options.installation_name);
    info!(installation = %installation, "installation identity");
    // kubernetes provider instances create their Pods through the operator's own client.
    let providers = ProviderRegistry::for_installation(&config, Some(client.clone()), &installation)?;
    // Checked (and token files read) before leading: a misconfigured replica fails at start.
    let auth = discovery_authenticator(&options.auth, Some((&client, &options.system_namespace))).await?;
    let signer = read_signer(&options.signing_key)?;

    // Leader election first: nothing acts before this replica leads.
    let Some(leadership) = lead(&client, &options, &stop).await else {
        return Ok(());
    };
    info!("leading: starting the controller");
    let replica = Replica {
        client,
        options,
        providers,
        auth,
        signer,
        metrics,
        admin,
    };
    act(replica, &leadership, &stop).await?;
    // The core's tasks stop on the signal; a follower's checkpoint is not waited for.
    let lost_leadership = *leadership.borrow() != Leadership::Leader && !stop.is_stopped();
    stop.stop();
    if lost_leadership {
        return Err(AppError::Startup(
            "lost leadership: stopping so a restart rejoins as a follower".to_owned(),
        ));
    }
    Ok(())
}

/// What a replica has set up before it leads.
struct Replica {
    client: Client,
    options: ClusterOptions,
    providers: ProviderRegistry,
    auth: Arc<dyn Authenticator>,
    signer: LeaseSigner,
    metrics: CoreMetrics,
    admin: Admin,
}

/// The leader's work: the core over cluster mode's adapters and the controller, until the
/// controller stops (shutdown, or leadership lost).
async fn act(
    replica: Replica,
    leadership: &watch::Receiver<Leadership>,
    stop: &StopSignal,
) -> Result<(), AppError> {
    let (client, options) = (&replica.client, &replica.options);
    let (leases, checkpoint) = restore_leases(client, &options.system_namespace).await;
    let (discovery_ready_tx, discovery_ready) = watch::channel(Readiness::default());
    let status_feed = ClusterFeed::default();
    tokio::spawn(seed_status_feed(
        client.clone(),
        options.namespace.clone(),
        status_feed.clone(),
    ));
    let adapters = CoreAdapters {
        providers: replica.providers.clone(),
        leases,
        signer: replica.signer,
        auth: replica.auth,
        readiness: discovery_ready,
        proxies: Arc::new(status_feed.clone()),
        status_page: StatusPageAt::Admin(replica.admin.status_page),
        provider_health: if options.provider_health_objects {
            Arc::new(KubeHealthSink::new(client.clone()))
        } else {
            Arc::new(crate::monitor::LogSink)
        },
        checkpoint: Some(checkpoint),
        journal: None,
        gc: gc_adapter(client, options),
        recycle: Arc::new(recycle::KubeRecycle::new(client.clone())),
    };
    let flags = CoreFlags {
        discovery_listen: options.discovery_listen,
        provider_probe_interval: options.provider_probe_interval,
        gc_interval: options.gc_interval,
        gateway: options.gateway.clone(),
    };
    let core = start_core(adapters, flags, &replica.metrics, stop).await?;
    tokio::spawn(checkpoint::report_checkpoint_health(
        client.clone(),
        options.system_namespace.clone(),
        options.identity.clone(),
        replica.metrics.checkpoint.subscribe(),
    ));

    let (caches_tx, caches_rx) = watch::channel(false);
    let deps = ClusterDeps {
        client: client.clone(),
        providers: replica.providers,
        leases: Arc::new(core.leases),
        health: Arc::new(core.health),
        availability: core.availability,
        reconciler: options.reconciler.clone(),
        namespace: options.namespace.clone(),
        concurrency: options.concurrency,
        debounce: Duration::from_millis(200),
        identity: options.identity.clone(),
        metrics: replica.metrics.metrics.clone(),
        status_feed: Some(status_feed),
        provider_flips: Some(core.provider_flips),
    };
    let triggers =
        futures::stream::unfold(
            core.triggers,
            |mut rx| async move { rx.recv().await.map(|k| (k, rx)) },
        );
    let controller = tokio::spawn(run_controller(
        deps,
        triggers,
        caches_tx,
        while_leading(stop, leadership),
    ));
    let readiness = tokio::spawn(follow_readiness(
        caches_rx,
        leadership.clone(),
        replica.metrics.checkpoint.subscribe(),
        replica.admin.readiness,
        discovery_ready_tx,
    ));
    let _ = controller.await;
    readiness.abort();
    Ok(())
}

/// Puts the trails earlier leaders left in Events on the status page (best effort: the page
/// works without them).
async fn seed_status_feed(client: Client, namespace: Option<String>, feed: ClusterFeed) {
    match history::read(&client, namespace.as_deref()).await {
        Ok(rows) => {
            info!(
                rows = rows.len(),
                "status page: audit trail read back from Events"
            );
            feed.seed(rows.into_iter().map(|r| (r.namespace, r.name, r.row)));
        }
        Err(err) => warn!(error = %err, "status page: reading the audit trail from Events failed"),
    }
}

/// The HMAC key signing lease tokens, shared by all replicas.
fn read_signer(path: &std::path::Path) -> Result<LeaseSigner, AppError> {
    let key =
        std::fs::read(path).map_err(|e| AppError::Startup(format!("reading {}: {e}", path.display())))?;
    LeaseSigner::new(&key).map_err(|e| AppError::Startup(format!("lease signing key: {e}")))
}

/// The admin server's handles: its readiness and the status page's slot.
struct Admin {
    readiness: watch::Sender<admin::Readiness>,
    status_page: StatusPageSlot,
}

/// Serves `/healthz`, `/readyz`, `/metrics` (and `/ui` once leading) from the start, also on
/// a follower.
async fn start_admin(
    listen: SocketAddr,
    metrics: &CoreMetrics,
    stop: &StopSignal,
) -> Result<Admin, AppError> {
    let (readiness, readiness_rx) = watch::channel(admin::Readiness::default());
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| AppError::Startup(format!("binding the admin server on {listen}: {e}")))?;
    let status_page = StatusPageSlot::default();
    tokio::spawn(serve_admin_with_ui(
        listener,
        readiness_rx,
        metrics.registry.clone(),
        status_page.clone(),
        stop.stopped(),
    ));
    Ok(Admin {
        readiness,
        status_page,
    })
}

/// Runs the leader election and waits until this replica leads; `None` if stopped first.
async fn lead(
    client: &Client,
    options: &ClusterOptions,
    stop: &StopSignal,
) -> Option<watch::Receiver<Leadership>> {
    let (leader_tx, mut leadership) = watch::channel(Leadership::Unknown);
    let elector = LeaderElector::new(
        Api::<Lease>::namespaced(client.clone(), &options.system_namespace),
        LEADER_LEASE,
        &options.identity,
        LeaderTimings::default(),
    );
    tokio::spawn(elector.run(leader_tx, stop.stopped()));
    info!(identity = %options.identity, "waiting for leadership");
    let leading = tokio::select! {
        _ = leadership.wait_for(|l| *l == Leadership::Leader) => true,
        _ = stop.stopped() => false,
    };
    leading.then_some(leadership)
}

/// The lease store restored from the checkpoint ConfigMaps in `namespace`, and that checkpoint.
async fn restore_leases(client: &Client, namespace: &str) -> (LeaseStore, Arc<dyn CheckpointStore>) {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    let checkpoint = Arc::new(ConfigMapCheckpoint::new(client.clone(), namespace));
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
    (store, checkpoint)
}

/// Orphan GC's live owners and settings, unless namespace-restricted mode turns it off.
fn gc_adapter(client: &Client, options: &ClusterOptions) -> Option<(Arc<dyn LiveOwners>, GcConfig)> {
    if !gc_enabled(options.namespace.as_deref(), options.gc_allow_namespaced) {
        warn!(
            namespace = %options.namespace.as_deref().unwrap_or_default(),
            "orphan GC is disabled in namespace-restricted mode (pass --gc-allow-namespaced to enable it)"
        );
        return None;
    }
    info!(
        namespace = %options.namespace.as_deref().unwrap_or("(all)"),
        dry_run = options.gc_dry_run,
        grace = ?options.gc_grace,
        interval = ?options.gc_interval,
        "orphan GC enabled"
    );
    let config = GcConfig {
        grace: options.gc_grace,
        dry_run: options.gc_dry_run,
        namespace: options.namespace.clone(),
    };
    Some((Arc::new(KubeLiveOwners::new(client.clone())), config))
}

/// Resolves on shutdown or when leadership is lost: the controller stops acting.
fn while_leading(
    stop: &StopSignal,
    leadership: &watch::Receiver<Leadership>,
) -> impl std::future::Future<Output = ()> + Send + Sync + 'static {
    let stopped = stop.stopped();
    let mut lost = leadership.clone();
    async move {
        tokio::select! {
            _ = stopped => {}
            _ = lost.wait_for(|l| *l != Leadership::Leader) => {}
        }
    }
}

/// Keeps `/readyz` (admin server and discovery API) following the caches, the leadership and
/// the lease checkpoint's health.
async fn follow_readiness(
    mut caches: watch::Receiver<bool>,
    mut leadership: watch::Receiver<Leadership>,
    mut checkpoint_health: watch::Receiver<CheckpointHealth>,
    admin: watch::Sender<admin::Readiness>,
    discovery: watch::Sender<Readiness>,
) {
    // The controller may drop its caches sender once synced: the others still matter.
    let mut caches_open = true;
    loop {
        let state = admin::Readiness {
            caches_synced: *caches.borrow(),
            leader: *leadership.borrow() == Leadership::Leader,
            checkpoint_failing: checkpoint_health.borrow_and_update().failing.is_some(),
        };
        admin.send_replace(state);
        discovery.send_replace(state);
        tokio::select! {
            changed = caches.changed(), if caches_open => caches_open = changed.is_ok(),
            changed = leadership.changed() => if changed.is_err() { break },
            changed = checkpoint_health.changed() => if changed.is_err() { break },
        }
    }
}

/// [`cluster_identity`], retried (1 s doubling to 30 s) until it succeeds or `stop` is raised:
/// a refusal (a missing RBAC rule, an API server still starting) is logged in the server's own
/// words and waited out, instead of exiting into a crash loop.
async fn wait_for_cluster_identity(client: &Client, stop: &StopSignal) -> Result<String, AppError> {
    let mut delay = Duration::from_secs(1);
    loop {
        match cluster_identity(client).await {
            Ok(uid) => return Ok(uid),
            Err(err) => warn!(error = %err, retry_in = ?delay, "cannot read the cluster identity yet"),
        }
        tokio::select! {
            () = stop.stopped() => {
                return Err(AppError::Startup(
                    "stopped before the cluster identity could be read".to_owned(),
                ));
            }
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(30));
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
                 (the operator needs get on namespaces/kube-system, see config/rbac/role.yaml; \
                 an install that may not read it passes the UID as --cluster-id, see config/namespaced)"
            ))
        })?;
    namespace
        .metadata
        .uid
        .filter(|uid| !uid.is_empty())
        .ok_or_else(|| AppError::Startup("the kube-system namespace has no UID".to_owned()))
}
