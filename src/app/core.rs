//! [`start_core`]: the services both modes run, started in one order over a mode's adapters.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use prometheus_client::registry::Registry;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::{info, warn};

use super::AppError;
use crate::{
    api::ProxyKey,
    controller::ProviderAvailability,
    discovery::{
        self, DiscoveryConfig, DiscoveryDeps, DiscoveryMetrics, DiscoveryState, Readiness,
        auth::Authenticator,
    },
    gateway::{
        self, Gateway, GatewayConfig, GatewayDeps,
        rules::{RecycleRequests, Rules},
    },
    gc::{self, GcConfig, LiveOwners},
    health::{HealthConfig, HealthEngine, HealthHandle},
    lease::{
        LeaseStore,
        checkpoint::{CheckpointReport, CheckpointStore, MaintenanceConfig, maintenance},
        journal::Journal,
        token::LeaseSigner,
    },
    monitor::{HealthSink, Monitor},
    outcomes::Outcomes,
    politeness::Politeness,
    provider::ProviderRegistry,
    telemetry::{Metrics, admin::StatusPageSlot},
    ui::{PageInputs, ProxySource, StatusPage},
    usage::{Quotas, Usage},
};

/// How often the outcome statistics forget proxies gone from the pool.
const OUTCOMES_PRUNE_INTERVAL: Duration = Duration::from_secs(60);

/// Runs `work` every `interval` until `stopped`.
async fn every(interval: Duration, stopped: impl Future<Output = ()>, mut work: impl FnMut()) {
    let mut stopped = std::pin::pin!(stopped);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => work(),
            _ = &mut stopped => return,
        }
    }
}

/// The outcome statistics forget proxies the lease store no longer has (deleted ones), so
/// neither they nor their metrics linger.
fn forget_gone_proxies(outcomes: &Outcomes, leases: &LeaseStore) {
    let now = leases.now_ms();
    outcomes.retain(|key| leases.view_at(key, now).is_some());
}

/// How often the lease-seconds of leases that expired unreleased are counted.
const EXPIRED_LEASES_INTERVAL: Duration = Duration::from_secs(1);

/// Counts, for their holders, the lease-seconds of leases that ended at their expiry (a client
/// that never released).
fn count_expired_leases(usage: &Usage, leases: &LeaseStore) {
    for ended in leases.take_expired() {
        usage.lease_expired(&ended.holder, ended.held_ms);
    }
}

/// How long one provider-health probe may take.
const PROVIDER_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The metrics registry both modes serve, with the core's metric families registered.
pub struct CoreMetrics {
    /// Everything registered, as `/metrics` serves it.
    pub registry: Arc<Registry>,
    /// The operator's own metrics (reconciles, probes, GC, proxies per phase).
    pub metrics: Arc<Metrics>,
    /// The discovery API's metrics.
    pub discovery: DiscoveryMetrics,
    /// Lease checkpoint saves.
    pub checkpoint: CheckpointReport,
    /// Outcome statistics per proxy and target domain (the gateway's and the API's).
    pub outcomes: Outcomes,
    /// Usage per token and holder, and the quotas (the gateway's and the API's).
    pub usage: Usage,
}

impl CoreMetrics {
    /// Registers the core's families, then the mode's own (`extra`).
    pub fn register(extra: impl FnOnce(&mut Registry)) -> Self {
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        let discovery = DiscoveryMetrics::register(&mut registry);
        let checkpoint = CheckpointReport::default();
        checkpoint.register(&mut registry);
        let outcomes = Outcomes::default();
        outcomes.register(&mut registry);
        let usage = Usage::default();
        usage.register(&mut registry);
        extra(&mut registry);
        Self {
            registry: Arc::new(registry),
            metrics,
            discovery,
            checkpoint,
            outcomes,
            usage,
        }
    }
}

/// One stop signal fanned out to every task of a mode.
#[derive(Clone)]
pub struct StopSignal(Arc<watch::Sender<bool>>);

impl Default for StopSignal {
    fn default() -> Self {
        Self(Arc::new(watch::channel(false).0))
    }
}

impl StopSignal {
    /// A signal raised when `shutdown` resolves (or by [`StopSignal::stop`]).
    pub fn on(shutdown: impl Future<Output = ()> + Send + 'static) -> Self {
        let signal = Self::default();
        let raise = signal.clone();
        tokio::spawn(async move {
            shutdown.await;
            raise.stop();
        });
        signal
    }

    /// Raises it.
    pub fn stop(&self) {
        self.0.send_replace(true);
    }

    /// Whether it was raised.
    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once it is raised.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + Sync + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// Where the status page is served.
pub enum StatusPageAt {
    /// On the discovery API (standalone mode: one port).
    DiscoveryApi,
    /// In this slot of the admin server (cluster mode).
    Admin(StatusPageSlot),
}

/// What a mode plugs into the core.
pub struct CoreAdapters {
    /// Provider instances.
    pub providers: ProviderRegistry,
    /// The lease store, restored from the mode's checkpoint.
    pub leases: LeaseStore,
    /// Signs lease tokens.
    pub signer: LeaseSigner,
    /// Authenticates discovery API callers.
    pub auth: Arc<dyn Authenticator>,
    /// Whether the discovery API answers `/readyz` with ready.
    pub readiness: watch::Receiver<Readiness>,
    /// Where the status page reads Proxies and their audit.
    pub proxies: Arc<dyn ProxySource>,
    /// Where the status page is served.
    pub status_page: StatusPageAt,
    /// Where provider health is published.
    pub provider_health: Arc<dyn HealthSink>,
    /// Where lease checkpoints are saved every interval; `None`: only reaped (the mode
    /// checkpoints otherwise, e.g. through the journal's compaction).
    pub checkpoint: Option<Arc<dyn CheckpointStore>>,
    /// Makes lease operations durable before they are answered.
    pub journal: Option<Journal>,
    /// Orphan GC: the live owners and its settings; `None`: GC off.
    pub gc: Option<(Arc<dyn LiveOwners>, GcConfig)>,
    /// How the gateway's rules ask for a fresh instance (the mode's own path to the Proxy's
    /// recycle request).
    pub recycle: Arc<dyn RecycleRequests>,
}

/// The core's knobs.
#[derive(Clone, Debug)]
pub struct CoreFlags {
    /// The discovery API's address.
    pub discovery_listen: SocketAddr,
    /// How often each provider instance is probed.
    pub provider_probe_interval: Duration,
    /// Between two GC passes.
    pub gc_interval: Duration,
    /// The gateway and the quotas.
    pub gateway: GatewayOptions,
}

/// The gateway's options and the quotas per token, the same in both modes (the flags
/// `--gateway-listen`, `--gateway-session-idle-seconds`, `--gateway-rules` and `--quotas`).
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    /// The gateway's address; `None`: no gateway.
    pub listen: Option<SocketAddr>,
    /// How long the gateway keeps an unused session's lease.
    pub session_idle: Duration,
    /// The gateway's rules (`--gateway-rules`, validated; the default without one); their
    /// politeness entries apply to the lease API too.
    pub rules: Rules,
    /// The quotas per token (`--quotas`, validated; none without one); the lease API's acquires
    /// count against them too.
    pub quotas: Quotas,
}

impl Default for GatewayOptions {
    /// No gateway, the default rules, no quotas; a session's lease kept for a minute unused.
    fn default() -> Self {
        Self {
            listen: None,
            session_idle: Duration::from_secs(60),
            rules: Rules::default(),
            quotas: Quotas::default(),
        }
    }
}

/// The running core: what a mode's reconcile loop drives and is driven by.
pub struct Core {
    /// The health engine (the reconciler's health executor).
    pub health: HealthHandle,
    /// Provider availability as the monitor sees it.
    pub availability: ProviderAvailability,
    /// The lease store (the reconciler's lease executor).
    pub leases: LeaseStore,
    /// Where the discovery API listens.
    pub discovery_addr: SocketAddr,
    /// Where the gateway listens, if it runs.
    pub gateway_addr: Option<SocketAddr>,
    /// Proxies whose health verdict changed, or whose drain just ended: reconcile them now.
    pub triggers: mpsc::Receiver<ProxyKey>,
    /// Providers whose availability flipped: reconcile their Proxies now.
    pub provider_flips: mpsc::UnboundedReceiver<String>,
    /// The core's tasks.
    pub tasks: CoreTasks,
}

/// The core's tasks: they stop when the stop signal is raised; dropping this detaches them.
pub struct CoreTasks {
    tasks: Vec<JoinHandle<()>>,
    forward: JoinHandle<()>,
}

impl CoreTasks {
    /// Waits for the core's tasks once the stop signal is raised (the discovery API drains,
    /// the last checkpoint is saved).
    pub async fn join(self) {
        self.forward.abort();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Starts the core over `adapters`; everything stops when `stop` is raised.
pub async fn start_core(
    adapters: CoreAdapters,
    flags: CoreFlags,
    metrics: &CoreMetrics,
    stop: &StopSignal,
) -> Result<Core, AppError> {
    let CoreAdapters {
        providers,
        leases,
        signer,
        auth,
        readiness,
        proxies,
        status_page,
        provider_health,
        checkpoint,
        journal,
        gc,
        recycle,
    } = adapters;
    metrics.usage.set_quotas(flags.gateway.quotas.clone());
    let (health, mut health_events) = HealthEngine::start(HealthConfig {
        probe_metrics: Some(metrics.metrics.probe_metrics()),
        ..HealthConfig::default()
    })
    .map_err(|e| AppError::Startup(e.to_string()))?;
    let availability = ProviderAvailability::default();
    let page = Arc::new(StatusPage::new(PageInputs {
        source: proxies,
        leases: leases.clone(),
        health: health.clone(),
        availability: availability.clone(),
        providers: providers
            .iter()
            .map(|(name, provider)| (name.to_owned(), provider.clone()))
            .collect(),
        auth: auth.clone(),
        outcomes: metrics.outcomes.clone(),
        usage: metrics.usage.clone(),
    }));
    let health_log = page.health_log();
    let politeness = Politeness::new(flags.gateway.rules.politeness.clone());
    let gateway_deps = GatewayDeps {
        store: leases.clone(),
        auth: auth.clone(),
        readiness: readiness.clone(),
        health: Some(health.clone()),
        recycle: Some(recycle),
        outcomes: metrics.outcomes.clone(),
        usage: metrics.usage.clone(),
        politeness: politeness.clone(),
    };
    let api = DiscoveryState::new(DiscoveryDeps {
        store: leases.clone(),
        signer,
        auth,
        readiness,
        registry: metrics.registry.clone(),
        metrics: metrics.discovery.clone(),
        outcomes: metrics.outcomes.clone(),
        usage: metrics.usage.clone(),
        politeness,
        config: DiscoveryConfig::default(),
    });
    match status_page {
        StatusPageAt::DiscoveryApi => api.set_status_page(page),
        StatusPageAt::Admin(slot) => {
            let _ = slot.set(page);
        }
    }
    if let Some(journal) = journal {
        api.set_journal(journal);
    }
    let listener = tokio::net::TcpListener::bind(flags.discovery_listen)
        .await
        .map_err(|e| {
            AppError::Startup(format!(
                "binding the discovery API on {}: {e}",
                flags.discovery_listen
            ))
        })?;
    let discovery_addr = listener
        .local_addr()
        .map_err(|e| AppError::Startup(e.to_string()))?;

    let mut tasks = Vec::new();
    let serving = discovery::serve(listener, api, stop.stopped());
    tasks.push(tokio::spawn(async move {
        if let Err(err) = serving.await {
            warn!(error = %err, "discovery API stopped with an error");
        }
    }));
    let gateway_addr = match flags.gateway.listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| AppError::Startup(format!("binding the gateway on {addr}: {e}")))?;
            let bound = listener
                .local_addr()
                .map_err(|e| AppError::Startup(e.to_string()))?;
            let config = GatewayConfig {
                session_idle: flags.gateway.session_idle,
                rules: flags.gateway.rules.clone(),
                ..GatewayConfig::default()
            };
            let serving = gateway::serve(listener, Gateway::new(gateway_deps, config), stop.stopped());
            tasks.push(tokio::spawn(async move {
                if let Err(err) = serving.await {
                    warn!(error = %err, "the gateway stopped with an error");
                }
            }));
            info!(address = %bound, "gateway listening");
            Some(bound)
        }
        None => None,
    };
    let upkeep = maintenance(
        leases.clone(),
        checkpoint,
        MaintenanceConfig {
            report: metrics.checkpoint.clone(),
            ..MaintenanceConfig::default()
        },
        stop.stopped(),
    );
    tasks.push(tokio::spawn(async move {
        if let Err(err) = upkeep.await {
            warn!(error = %err, "the last lease checkpoint failed");
        }
    }));

    let (outcomes, store) = (metrics.outcomes.clone(), leases.clone());
    tasks.push(tokio::spawn(every(
        OUTCOMES_PRUNE_INTERVAL,
        stop.stopped(),
        move || forget_gone_proxies(&outcomes, &store),
    )));
    let (usage, store) = (metrics.usage.clone(), leases.clone());
    tasks.push(tokio::spawn(every(
        EXPIRED_LEASES_INTERVAL,
        stop.stopped(),
        move || count_expired_leases(&usage, &store),
    )));

    let (flips_tx, provider_flips) = mpsc::unbounded_channel();
    let monitor = Monitor::new(
        providers.clone(),
        availability.clone(),
        provider_health,
        PROVIDER_PROBE_TIMEOUT,
    )
    .with_metrics(metrics.metrics.clone())
    .on_change(Arc::new(move |provider: &str| {
        // The mode's loop may have stopped already; then nothing needs the news.
        let _ = flips_tx.send(provider.to_owned());
    }));
    tasks.push(tokio::spawn(
        monitor.run(flags.provider_probe_interval, stop.stopped()),
    ));
    if let Some((owners, config)) = gc {
        tasks.push(tokio::spawn(gc::run(
            providers,
            owners,
            config,
            flags.gc_interval,
            Some(metrics.metrics.clone()),
            stop.stopped(),
        )));
    }

    let (trigger_tx, triggers) = mpsc::channel(1024);
    // A drain that ends moves its deletion or replacement on now, not at the round's next
    // poll. Told under a lease-store shard lock, so it never waits: with the channel full, the
    // poll is the safety net.
    let drained_tx = trigger_tx.clone();
    leases.on_drained(Arc::new(move |key: &ProxyKey| {
        let _ = drained_tx.try_send(key.clone());
    }));
    let forward = tokio::spawn(async move {
        while let Some(event) = health_events.recv().await {
            health_log.record(&event);
            if trigger_tx.send(event.key.clone()).await.is_err() {
                break;
            }
        }
    });
    Ok(Core {
        health,
        availability,
        leases,
        discovery_addr,
        gateway_addr,
        triggers,
        provider_flips,
        tasks: CoreTasks { tasks, forward },
    })
}
