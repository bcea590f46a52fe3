//! Reconciles at rest and after failures, in standalone mode (issue 24): N Proxies (default
//! 1,000) in a manifests folder, the standalone runner over the embedded store, the in-memory
//! provider named `local`, and tokio's paused clock (the reconciler's clock follows it), so
//! simulated minutes take seconds and the figures are counts, not timings. It prints:
//!
//! - during a burst of transient create failures (every Proxy's first `EPO_BENCH_FAILURES`
//!   creates fail, default 2): reconciles per Proxy until every create succeeded, next to the
//!   retry steps each Proxy took (target: one reconcile per retry step, ratio 1.0);
//! - once all are Healthy: reconciles per Proxy per simulated minute over
//!   `EPO_BENCH_REST_MINUTES` (default 10) (target: the resync only, one per 5 minutes = 0.20).
//!
//! `cargo bench --bench rest`; `EPO_BENCH_PROXIES` sets N. The cluster-mode figures come from
//! the real control plane (see the converge benchmark).

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use egress_proxies_operator::{
    api::ProxyKey,
    controller::{ProviderAvailability, ReconcilerConfig},
    health::{HealthControl, HealthTarget, Verdict},
    lease::{DrainStatus, LeaseControl, LeaseTarget},
    provider::{ProviderRegistry, memory::MemoryProvider},
    standalone::{Standalone, StandaloneDeps},
};
use tokio::time::Instant;

/// Passes every proxy it probes (the bench is about the controller, not the health engine).
#[derive(Default)]
struct PassingHealth(Mutex<HashSet<ProxyKey>>);

impl HealthControl for PassingHealth {
    fn upsert(&self, target: HealthTarget) {
        egress_proxies_operator::sync::lock(&self.0).insert(target.key);
    }
    fn remove(&self, key: &ProxyKey) {
        egress_proxies_operator::sync::lock(&self.0).remove(key);
    }
    fn verdict(&self, key: &ProxyKey) -> Verdict {
        if egress_proxies_operator::sync::lock(&self.0).contains(key) {
            Verdict::Passing
        } else {
            Verdict::Unknown
        }
    }
}

struct NoLeases;

impl LeaseControl for NoLeases {
    fn upsert(&self, _: LeaseTarget) {}
    fn set_admission(&self, _: &ProxyKey, _: bool) {}
    fn drain(&self, _: &ProxyKey) -> DrainStatus {
        DrainStatus::Drained
    }
    fn revoke_all(&self, _: &ProxyKey) -> usize {
        0
    }
    fn remove(&self, _: &ProxyKey) {}
    fn active(&self, _: &ProxyKey) -> usize {
        0
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs the runner as `Standalone::run` does, on the paused clock, until `done` holds or `until`.
async fn run_until(runner: &mut Standalone, until: Instant, mut done: impl FnMut(&Standalone) -> bool) {
    while Instant::now() < until && !done(runner) {
        let next = runner.step().await;
        if done(runner) {
            return;
        }
        tokio::time::sleep_until(next.map_or(until, |at| at.min(until))).await;
    }
}

fn main() {
    let n: usize = env_or("EPO_BENCH_PROXIES", 1000);
    let failures: usize = env_or("EPO_BENCH_FAILURES", 2);
    let rest_minutes: u64 = env_or("EPO_BENCH_REST_MINUTES", 10);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let dir = tempfile::tempdir().expect("temp dir");
        let (manifests, state) = (dir.path().join("manifests"), dir.path().join("state"));
        std::fs::create_dir_all(&manifests).expect("mkdir");
        for i in 0..n {
            std::fs::write(
                manifests.join(format!("p{i:05}.yaml")),
                format!(
                    "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata:\n  name: p{i:05}\nspec:\n  provider: local\n  port: {}\n",
                    20000 + i
                ),
            )
            .expect("write");
        }
        let provider = Arc::new(MemoryProvider::new("local"));
        // Every Proxy is reconciled once per retry step, in order: the first `failures × n`
        // creates are each Proxy's first `failures`.
        provider.fail_next_creates(failures * n);
        let mut providers = ProviderRegistry::new();
        providers.insert(provider.clone());
        let start = Instant::now();
        let epoch = jiff::Timestamp::constant(1_735_689_600, 0);
        let mut runner = Standalone::open(
            &manifests,
            &state,
            StandaloneDeps {
                providers,
                leases: Arc::new(NoLeases),
                health: Arc::new(PassingHealth::default()),
                availability: ProviderAvailability::default(),
                reconciler: ReconcilerConfig::default(),
            },
        )
        .expect("opens")
        .with_clock(move || epoch.checked_add(Instant::now() - start).expect("in range"));
        runner.progress().mute();

        // The failures: until every create succeeded.
        let all_created = |_: &Standalone| provider.create_calls() >= (failures + 1) * n;
        run_until(&mut runner, start + Duration::from_secs(3600), all_created).await;
        let during = runner.reconciles();
        let failed_for = Instant::now() - start;
        // Until all are Healthy.
        run_until(&mut runner, start + Duration::from_secs(7200), |r| {
            r.progress().count("healthy") == n
        })
        .await;
        let healthy_after = Instant::now() - start;
        assert_eq!(runner.progress().count("healthy"), n, "all Healthy");
        let before_rest = runner.reconciles();
        let rest_from = Instant::now();
        run_until(
            &mut runner,
            rest_from + Duration::from_secs(rest_minutes * 60),
            |_| false,
        )
        .await;
        let at_rest = runner.reconciles() - before_rest;

        let per_proxy = |count: u64| count as f64 / n as f64;
        let steps = (failures + 1) as f64;
        println!("rest benchmark: standalone mode, {n} Proxies, memory provider, simulated time");
        println!(
            "  burst: each Proxy's first {failures} creates fail; all created after {:.0} s, all Healthy after {:.0} s",
            failed_for.as_secs_f64(),
            healthy_after.as_secs_f64()
        );
        println!(
            "  during the failures: {:.2} reconciles per Proxy for {steps:.0} retry steps = {:.2} per step (target 1.00)",
            per_proxy(during),
            per_proxy(during) / steps
        );
        let per_minute = per_proxy(at_rest) / rest_minutes as f64;
        println!(
            "  at rest: {:.3} reconciles per Proxy per minute over {rest_minutes} min (target: the resync only, {:.3}); ratio {:.2}",
            per_minute,
            1.0 / 5.0,
            per_minute / 0.2
        );
    });
}
