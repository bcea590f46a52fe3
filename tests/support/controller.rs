//! The cluster-mode controller started in-process, as tests and the converge benchmark run it:
//! [`ControllerSetup`] names the parts (a client, providers, lease and health stand-ins), and
//! [`ControllerSetup::start`] returns once the controller's caches are synced.
//!
//! Include with `mod support { pub mod controller; }` (tests) or
//! `#[path = "../tests/support/controller.rs"] mod controller;` (benches).

#![allow(dead_code)]

use std::{sync::Arc, time::Duration};

use egress_proxies_operator::{
    api::ProxyKey,
    cluster::{ClusterDeps, run_controller},
    controller::{ProviderAvailability, ReconcilerConfig},
    health::HealthControl,
    lease::LeaseControl,
    provider::ProviderRegistry,
    telemetry::Metrics,
};
use kube::Client;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot, watch};

/// How long the caches may take to sync.
const READY_DEADLINE: Duration = Duration::from_secs(30);
/// How long a stop, or an awaited number of reconciles, may take.
const STOP_DEADLINE: Duration = Duration::from_secs(15);

/// What a controller runs with: the controller's own [`ClusterDeps`] (public, to adjust) with
/// the knobs tests want (2 workers, a 10 ms debounce), and the registry its metrics are in.
pub struct ControllerSetup {
    pub deps: ClusterDeps,
    registry: Registry,
}

impl ControllerSetup {
    /// A setup watching every namespace.
    pub fn new(
        client: Client,
        providers: ProviderRegistry,
        leases: Arc<dyn LeaseControl>,
        health: Arc<dyn HealthControl>,
    ) -> Self {
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        Self {
            deps: ClusterDeps {
                client,
                providers,
                leases,
                health,
                availability: ProviderAvailability::default(),
                reconciler: ReconcilerConfig::default(),
                namespace: None,
                concurrency: 2,
                debounce: Duration::from_millis(10),
                identity: "test-operator".into(),
                metrics,
                status_feed: None,
                provider_flips: None,
            },
            registry,
        }
    }

    /// Starts the controller and waits until its caches are synced (panics past a deadline).
    pub async fn start(self) -> RunningController {
        let (triggers, trigger_rx) = mpsc::channel(1024);
        let (stop, stopped) = oneshot::channel::<()>();
        let (ready_tx, mut ready) = watch::channel(false);
        let trigger_stream =
            futures::stream::unfold(
                trigger_rx,
                |mut rx| async move { rx.recv().await.map(|k| (k, rx)) },
            );
        let task = tokio::spawn(run_controller(self.deps, trigger_stream, ready_tx, async {
            let _ = stopped.await;
        }));
        tokio::time::timeout(READY_DEADLINE, ready.wait_for(|r| *r))
            .await
            .unwrap_or_else(|_| panic!("the controller's caches did not sync within {READY_DEADLINE:?}"))
            .expect("the controller stopped before its caches synced");
        RunningController {
            triggers,
            stop: Some(stop),
            task,
            registry: Arc::new(self.registry),
        }
    }
}

/// A running controller; [`RunningController::stop`] shuts it down gracefully (dropping it
/// stops it too, without waiting).
pub struct RunningController {
    /// Reconcile requests, as health events would send them.
    pub triggers: mpsc::Sender<ProxyKey>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    /// The registry its metrics are in.
    pub registry: Arc<Registry>,
}

impl RunningController {
    /// Asks for a reconcile of `key`.
    pub async fn trigger(&self, key: ProxyKey) {
        self.triggers.send(key).await.expect("controller running");
    }

    /// Stops the controller and waits until it has (panics past a deadline).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(STOP_DEADLINE, &mut self.task)
            .await
            .unwrap_or_else(|_| panic!("the controller did not stop within {STOP_DEADLINE:?}"))
            .expect("the controller task ended without panicking");
    }

    /// The metrics in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("metrics encode");
        text
    }

    /// Reconciles finished so far (any result), from the controller's own metrics.
    pub fn reconciles(&self) -> u64 {
        self.metric_sum("epo_reconciles_total", "")
    }

    /// The sum of counter `name`'s series whose labels contain `label` (`""`: all of them).
    pub fn metric_sum(&self, name: &str, label: &str) -> u64 {
        let series = format!("{name}{{");
        self.metrics_text()
            .lines()
            .filter(|l| l.starts_with(&series) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Waits until at least `at_least` reconciles finished (panics past a deadline).
    pub async fn wait_reconciles(&self, at_least: u64) {
        let deadline = tokio::time::Instant::now() + STOP_DEADLINE;
        while self.reconciles() < at_least {
            assert!(
                tokio::time::Instant::now() < deadline,
                "reconciles stuck at {} (waiting for {at_least})",
                self.reconciles()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for RunningController {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
