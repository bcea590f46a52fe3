//! How long N Proxies (default 1,000) take to converge to Healthy through the real controller
//! against the in-process fake API server with the in-memory provider, and how many API writes
//! each one costs. The baseline, measured in the same run, is the time the same API server takes
//! to accept N plain creates: the ratio says what reconciling adds on top of the API itself.
//!
//! `cargo bench --bench converge` (set `EPO_BENCH_PROXIES` to change N).

// The module allows its own dead code (not every user needs every hook).
#[path = "../tests/support/fake_apiserver/mod.rs"]
mod fake_apiserver;

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use egress_proxies_operator::{
    api::Proxy,
    controller::{
        ProviderAvailability, ReconcilerConfig,
        cluster::{ClusterDeps, run_controller},
    },
    effects::{DrainStatus, HealthControl, HealthTarget, HealthVerdict, LeaseControl, LeaseTarget, ProxyKey},
    provider::{ProviderRegistry, memory::MemoryProvider},
    telemetry::Metrics,
};
use fake_apiserver::FakeApiServer;
use kube::{
    Api,
    api::{ListParams, PostParams},
};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::sync::{mpsc, oneshot, watch};

/// Health that passes as soon as a proxy is registered, and says so (like a first successful
/// probe would) by triggering a reconcile.
struct InstantHealth {
    passing: Mutex<HashSet<ProxyKey>>,
    triggers: mpsc::UnboundedSender<ProxyKey>,
}

impl HealthControl for InstantHealth {
    fn upsert(&self, target: HealthTarget) {
        if self.passing.lock().unwrap().insert(target.key.clone()) {
            let _ = self.triggers.send(target.key);
        }
    }
    fn remove(&self, key: &ProxyKey) {
        self.passing.lock().unwrap().remove(key);
    }
    fn verdict(&self, key: &ProxyKey) -> HealthVerdict {
        if self.passing.lock().unwrap().contains(key) {
            HealthVerdict::Passing { after_failing: false }
        } else {
            HealthVerdict::Unknown
        }
    }
}

/// Leases are not part of this measurement.
struct NoLeases;

impl LeaseControl for NoLeases {
    fn upsert(&self, _target: LeaseTarget) {}
    fn set_admission(&self, _key: &ProxyKey, _open: bool) {}
    fn drain(&self, _key: &ProxyKey) -> DrainStatus {
        DrainStatus::Drained
    }
    fn revoke_all(&self, _key: &ProxyKey) -> u32 {
        0
    }
    fn remove(&self, _key: &ProxyKey) {}
    fn active(&self, _key: &ProxyKey) -> u32 {
        0
    }
}

fn proxy(name: &str) -> Proxy {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {"provider": "mem", "attributes": {"pool": "bench"}},
    }))
    .expect("valid Proxy")
}

async fn create_all(api: &Api<Proxy>, prefix: &str, n: usize) -> Duration {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(n.div_ceil(16).max(1)) {
        let api = api.clone();
        let names: Vec<String> = chunk.iter().map(|i| format!("{prefix}-{i}")).collect();
        tasks.push(tokio::spawn(async move {
            for name in names {
                api.create(&PostParams::default(), &proxy(&name))
                    .await
                    .expect("created");
            }
        }));
    }
    for task in tasks {
        task.await.expect("creates");
    }
    started.elapsed()
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("EPO_BENCH_PROXIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);

    // Baseline: the API server accepting N creates, no controller running.
    let baseline_server = FakeApiServer::start().await;
    let baseline = create_all(&Api::namespaced(baseline_server.client(), "bench"), "baseline", n).await;
    drop(baseline_server);

    let server = FakeApiServer::start().await;
    let client = server.client();
    let mut providers = ProviderRegistry::new();
    providers.insert(Arc::new(MemoryProvider::new("mem")));
    let (trigger_tx, trigger_rx) = mpsc::unbounded_channel();
    let health = Arc::new(InstantHealth {
        passing: Mutex::default(),
        triggers: trigger_tx,
    });
    let mut registry = Registry::default();
    let deps = ClusterDeps {
        client: client.clone(),
        providers,
        leases: Arc::new(NoLeases),
        health,
        availability: ProviderAvailability::default(),
        reconciler: ReconcilerConfig::default(),
        namespace: None,
        concurrency: 16,
        debounce: Duration::from_millis(1),
        identity: "bench".into(),
        metrics: Arc::new(Metrics::register(&mut registry)),
        status_feed: None,
    };
    let triggers = futures::stream::unfold(
        trigger_rx,
        |mut rx| async move { rx.recv().await.map(|k| (k, rx)) },
    );
    let (ready_tx, mut ready) = watch::channel(false);
    let (stop, stopped) = oneshot::channel::<()>();
    let controller = tokio::spawn(run_controller(deps, triggers, ready_tx, async {
        let _ = stopped.await;
    }));
    ready.wait_for(|r| *r).await.expect("caches sync");

    let api: Api<Proxy> = Api::namespaced(client.clone(), "bench");
    let started = Instant::now();
    let creating = create_all(&api, "proxy", n).await;
    let converged = loop {
        let list = api.list(&ListParams::default()).await.expect("list");
        let healthy = list
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("healthy"))
            .count();
        if healthy == n {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "only {healthy}/{n} healthy after 300 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let writes = server.writes();
    let proxy_writes = writes
        .iter()
        .filter(|w| w.resource == "proxies" && w.succeeded())
        .count()
        - n;
    let events = writes.iter().filter(|w| w.resource == "events").count();
    let _ = stop.send(());
    controller.await.expect("controller stops");

    println!(
        "converge: {n} Proxies created in {creating:.2?} and Healthy after {converged:.2?} (target <= 10 s)"
    );
    println!(
        "converge: baseline {n} plain creates on an idle API server took {baseline:.2?}; convergence = {:.1}x the baseline",
        converged.as_secs_f64() / baseline.as_secs_f64()
    );
    println!(
        "converge: {:.2} operator writes to each Proxy (finalizer + status; target <= 4), plus {:.2} Events per Proxy",
        proxy_writes as f64 / n as f64,
        events as f64 / n as f64
    );
}
