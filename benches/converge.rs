//! How N Proxies converge to Healthy through the real cluster-mode controller (kube-runtime
//! `Controller`, watch predicate, Event publisher, status writes) against a real kube-apiserver
//! and etcd (built by `scripts/lib/control-plane.sh`, started as the tests start them), the
//! operator running as the ServiceAccount `config/default` binds, with the in-memory provider and
//! a health engine that passes at once. For each N (default
//! 1,000 then 10,000 in one run) it prints:
//!
//! - the time from the first create to all Healthy, next to a baseline measured in the same run
//!   (a fresh API server of the same build accepting N plain creates, no controller) and their
//!   ratio;
//! - the operator's writes per Proxy on the way to Healthy (finalizer patches + status writes;
//!   target ≤ 4) and its Events per Proxy, counted **by the API server** (its own
//!   `apiserver_request_total`), not from the reconciler's own counters;
//! - the writes during a steady-state window after everything is Healthy (target 0), and the
//!   reconciles the operator made in it, per Proxy per minute (target: the resync only, one per
//!   5 minutes);
//! - the reconciles per Proxy on the way to Healthy, also with `EPO_BENCH_CREATE_FAILURES=K` (a
//!   burst of transient create failures: the provider refuses the first K×N creates; target: each
//!   failure costs one reconcile, its retry step);
//! - the operator's own memory (target ≤ 64 MB at 10,000): resident set (now and peak during
//!   the case) and live heap; and, beside it, the resident sets of etcd and kube-apiserver;
//!
//! and at the end the time ratio of the largest to the smallest N (target ≤ 12× for 10×).
//!
//! Memory is attributed by **process**: the bench re-executes itself as a child process
//! (`EPO_BENCH_ROLE=client`) that plays the user: it creates N Proxies from its own client and
//! counts the Healthy ones, answering the parent's commands on stdin/stdout. The parent runs the
//! operator and nothing else (it does not even list Proxies to see progress), so its RSS is the
//! operator's. A counting global
//! allocator adds the parent's live heap, which unlike RSS does not keep the high-water mark of
//! an earlier case. The peak RSS is reset per case through `/proc/self/clear_refs`.
//!
//! `cargo bench --bench converge`. Environment:
//! - `EPO_BENCH_PROXIES`: comma-separated sizes (default `1000,10000`);
//! - `EPO_BENCH_STEADY_SECS`: the steady-state window in seconds (default 60; 0 skips it);
//! - `EPO_BENCH_ROUNDS`: rounds over the sizes (default 3); the ratio compares each size's
//!   fastest round, and the steady-state window runs in the last round only;
//! - `EPO_BENCH_CREATE_FAILURES`: transient create failures per Proxy before its create succeeds
//!   (default 0).

#[path = "../tests/support/control_plane.rs"]
mod control_plane;
#[path = "../tests/support/ports.rs"]
mod ports;
#[path = "../tests/support/process.rs"]
mod process;

use std::{
    alloc::{GlobalAlloc, Layout},
    collections::{BTreeMap, HashSet},
    process::Stdio,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use control_plane::{ControlPlane, RequestCounts};
use egress_proxies_operator::{
    api::Proxy,
    api::ProxyKey,
    cluster::{ClusterDeps, run_controller},
    controller::{ProviderAvailability, ReconcilerConfig},
    health::{HealthControl, HealthTarget, Verdict},
    lease::{DrainStatus, LeaseControl, LeaseTarget},
    provider::{Instance, Provider, ProviderRegistry, memory::MemoryProvider},
    telemetry::Metrics,
};
use kube::{
    Api,
    api::{ListParams, PostParams},
};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout, Command},
    sync::{mpsc, oneshot, watch},
};

const NAMESPACE: &str = "bench";

/// The binary's allocator (see `ALLOCATOR` in src/main.rs), so the RSS measured is the one the
/// operator would have.
static SYSTEM: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Counts the bytes allocated and not yet freed (the operator's live heap in the parent).
struct CountingAlloc;

static LIVE_HEAP: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the binary's allocator unchanged; only a counter is updated beside it.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on as is.
        let ptr = unsafe { SYSTEM.alloc(layout) };
        if !ptr.is_null() {
            LIVE_HEAP.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let ptr = unsafe { SYSTEM.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE_HEAP.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { SYSTEM.dealloc(ptr, layout) };
        LIVE_HEAP.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let new = unsafe { SYSTEM.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE_HEAP.fetch_add(new_size, Ordering::Relaxed);
            LIVE_HEAP.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

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
    fn verdict(&self, key: &ProxyKey) -> Verdict {
        if self.passing.lock().unwrap().contains(key) {
            Verdict::Passing
        } else {
            Verdict::Unknown
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
    fn revoke_all(&self, _key: &ProxyKey) -> usize {
        0
    }
    fn remove(&self, _key: &ProxyKey) {}
    fn active(&self, _key: &ProxyKey) -> usize {
        0
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `key:  N kB` lines of `/proc/self/status` (or a child's), in bytes.
fn proc_status_bytes(pid: &str, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Reconciles the operator has made so far (`epo_reconciles_total`, every result).
fn reconciles(registry: &Registry) -> f64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("metrics encode");
    text.lines()
        .filter(|line| line.starts_with("epo_reconciles_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, n| sum + n)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

// ---------------------------------------------------------------------------------------------
// The child: the user's client (creates and counts), in a process of its own.

fn proxy(name: &str) -> Proxy {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"provider": "mem", "attributes": {"pool": "bench"}},
    }))
    .expect("valid Proxy")
}

/// N creates from 16 concurrent tasks of one client (as a `kubectl apply` of many files would).
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

/// Plays the user against the API server of `EPO_BENCH_KUBECONFIG`; one command per stdin line,
/// one answer per stdout line: `create PREFIX N` → seconds taken; `healthy` → Proxies whose
/// status.phase is healthy. EOF ends it.
async fn serve_client() {
    let kubeconfig = std::env::var_os("EPO_BENCH_KUBECONFIG").expect("EPO_BENCH_KUBECONFIG");
    let client = control_plane::client_from(std::path::Path::new(&kubeconfig)).await;
    let api: Api<Proxy> = Api::namespaced(client, NAMESPACE);
    // The first write of a new resource waits for its handler (schema, CEL); a dry run takes
    // that out of the timed creates.
    api.create(
        &PostParams {
            dry_run: true,
            ..PostParams::default()
        },
        &proxy("warm-up"),
    )
    .await
    .expect("a dry-run create");
    // tokio's stdio is not among the enabled features: a thread reads stdin.
    let (line_tx, mut lines) = mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if line_tx.send(line).is_err() {
                break;
            }
        }
    });
    say("ready");
    while let Some(line) = lines.recv().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["create", prefix, n] => {
                let n = n.parse().expect("a count");
                create_all(&api, prefix, n).await.as_secs_f64().to_string()
            }
            ["healthy"] => count_healthy(&api).await.to_string(),
            _ => panic!("unknown command {line:?}"),
        };
        say(&answer);
    }
}

/// Proxies whose status.phase is healthy, listed in pages as kubectl would.
async fn count_healthy(api: &Api<Proxy>) -> usize {
    let mut healthy = 0;
    let mut params = ListParams::default().limit(1_000);
    loop {
        let page = api.list(&params).await.expect("listing Proxies");
        healthy += page
            .items
            .iter()
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| serde_json::to_value(s).ok())
                    .and_then(|s| s.get("phase").and_then(Value::as_str).map(str::to_owned))
                    .as_deref()
                    == Some("healthy")
            })
            .count();
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return healthy,
        }
    }
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").expect("stdout");
    out.flush().expect("stdout");
}

/// The parent's handle on the child playing the user.
struct UserProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl UserProcess {
    async fn start(kubeconfig: &std::path::Path) -> Self {
        let exe = std::env::current_exe().expect("the bench's own path");
        let mut child = Command::new(exe)
            .env("EPO_BENCH_ROLE", "client")
            .env("EPO_BENCH_KUBECONFIG", kubeconfig)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the client process");
        let stdin = child.stdin.take().expect("piped stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let ready = lines.next_line().await.expect("read the child");
        assert_eq!(ready.as_deref(), Some("ready"));
        Self { child, stdin, lines }
    }

    async fn ask(&mut self, command: &str) -> String {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .expect("write to the child");
        self.lines
            .next_line()
            .await
            .expect("read the child")
            .expect("the child answers")
    }

    async fn stop(mut self) {
        drop(self.stdin);
        let _ = self.child.wait().await;
    }
}

/// A control plane with `config/default` installed (CRDs, RBAC, the operator's ServiceAccount)
/// and the bench namespace, and a kubeconfig for the user (the admin).
async fn control_plane() -> ControlPlane {
    let plane = ControlPlane::start().await;
    plane.install_default().await;
    plane.create_namespace(NAMESPACE).await;
    plane
}

/// Requests since `before`, per `verb resource[/subresource] code`, for what `pick` keeps.
fn requests_since(
    after: &RequestCounts,
    before: &RequestCounts,
    pick: impl Fn(&str, &str, &str) -> bool,
) -> f64 {
    after
        .0
        .iter()
        .filter(|((verb, resource, subresource, _), _)| pick(verb, resource, subresource))
        .map(|(key, n)| n - before.0.get(key).copied().unwrap_or(0.0))
        .fold(0.0, |sum, n| sum + n)
}

/// The writes in `after` and not in `before`, by `verb resource[/subresource] code`.
fn writes_by_kind(after: &RequestCounts, before: &RequestCounts) -> BTreeMap<String, f64> {
    after
        .0
        .iter()
        .filter(|((verb, ..), _)| matches!(verb.as_str(), "POST" | "PUT" | "PATCH" | "DELETE" | "APPLY"))
        .filter_map(|((verb, resource, subresource, code), n)| {
            let key = (verb.clone(), resource.clone(), subresource.clone(), code.clone());
            let delta = n - before.0.get(&key).copied().unwrap_or(0.0);
            let name = if subresource.is_empty() {
                resource.clone()
            } else {
                format!("{resource}/{subresource}")
            };
            (delta > 0.0).then(|| (format!("{verb} {name} {code}"), delta))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The parent: the operator.

struct Figures {
    converged: Duration,
}

async fn run_case(n: usize, steady: Duration) -> Figures {
    // Baseline: a fresh API server of the same build accepting N creates, no controller running.
    let baseline_plane = control_plane().await;
    let mut user = UserProcess::start(baseline_plane.admin_kubeconfig()).await;
    let baseline: f64 = user
        .ask(&format!("create baseline {n}"))
        .await
        .parse()
        .expect("seconds");
    user.stop().await;
    drop(baseline_plane);

    let plane = control_plane().await;
    // Peak RSS from here on (Linux: writing 5 to clear_refs resets VmHWM).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let client = plane.operator_client().await;
    let mut user = UserProcess::start(plane.admin_kubeconfig()).await;
    let mut providers = ProviderRegistry::new();
    let memory = Arc::new(MemoryProvider::new("mem"));
    let failures_per_proxy: usize = env_or("EPO_BENCH_CREATE_FAILURES", 0);
    memory.fail_next_creates(failures_per_proxy * n);
    providers.insert(memory.clone());
    let (trigger_tx, trigger_rx) = mpsc::unbounded_channel();
    let health = Arc::new(InstantHealth {
        passing: Mutex::default(),
        triggers: trigger_tx,
    });
    let mut registry = Registry::default();
    let mut deps = ClusterDeps {
        client,
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
        provider_flips: None,
    };
    // Default timers but a retry that starts at 1 s: a failure burst then takes seconds to
    // recover, and the count of reconciles per retry step is the same.
    if failures_per_proxy > 0 {
        deps.reconciler.backoff.initial = Duration::from_secs(1);
    }
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

    let before = plane.request_counts().await;
    let started = Instant::now();
    let creating: f64 = user
        .ask(&format!("create proxy {n}"))
        .await
        .parse()
        .expect("seconds");
    let converged = loop {
        let asked = Instant::now();
        let healthy: usize = user.ask("healthy").await.parse().expect("a count");
        if healthy == n {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(1_200),
            "only {healthy}/{n} healthy after 1,200 s"
        );
        // Each poll lists every Proxy, on the cores the API server and the operator use:
        // waiting 20x a poll's time between polls keeps that under 5 % of the run at every N
        // (a fixed interval would tax 10,000 Proxies 10x as much as 1,000).
        tokio::time::sleep((asked.elapsed() * 20).max(Duration::from_millis(50))).await;
    };
    let after = plane.request_counts().await;
    let is_write = |verb: &str| matches!(verb, "PUT" | "PATCH" | "APPLY");
    let finalizer = requests_since(&after, &before, |verb, resource, sub| {
        resource == "proxies" && sub.is_empty() && is_write(verb)
    });
    let status = requests_since(&after, &before, |verb, resource, sub| {
        resource == "proxies" && sub == "status" && is_write(verb)
    });
    let failed: f64 = after
        .0
        .iter()
        .filter(|((verb, resource, _, code), _)| {
            resource == "proxies" && is_write(verb) && !code.starts_with('2')
        })
        .map(|(key, n)| n - before.0.get(key).copied().unwrap_or(0.0))
        .fold(0.0, |sum, n| sum + n);
    let events = requests_since(&after, &before, |verb, resource, _| {
        resource == "events" && verb == "POST"
    });
    let series = requests_since(&after, &before, |verb, resource, _| {
        resource == "events" && verb == "PATCH"
    });
    let per = |count: f64| count / n as f64;
    let reconciled = reconciles(&registry);

    println!(
        "converge {n}: {n} Proxies created in {creating:.2} s, all Healthy after {:.2} s; \
         baseline {n} plain creates {baseline:.2} s; convergence = {:.1}x the baseline",
        converged.as_secs_f64(),
        converged.as_secs_f64() / baseline
    );
    println!(
        "converge {n}: {:.2} operator writes per Proxy to Healthy (finalizer {:.2} + status {:.2}, \
         of which failed {:.2}; target <= 4), {:.2} Events per Proxy (+ {:.2} series patches)",
        per(finalizer + status),
        per(finalizer),
        per(status),
        per(failed),
        per(events),
        per(series),
    );

    println!(
        "converge {n}: {:.2} reconciles per Proxy to Healthy, with {failures_per_proxy} failed creates each \
         (target: each failure costs one reconcile more than a run without failures)",
        per(reconciled),
    );

    if !steady.is_zero() {
        let before = plane.request_counts().await;
        let reconciles_before = reconciles(&registry);
        tokio::time::sleep(steady).await;
        let rest = reconciles(&registry) - reconciles_before;
        println!(
            "converge {n}: {:.3} reconciles per Proxy per minute during {} s of steady state (target: the \
             5-minute resync only, 0.200)",
            per(rest) * 60.0 / steady.as_secs_f64(),
            steady.as_secs()
        );
        let writes = writes_by_kind(&plane.request_counts().await, &before);
        // kube-apiserver renews its own identity Lease every 10 s; the operator here takes none.
        let (own, operator): (BTreeMap<_, _>, BTreeMap<_, _>) = writes
            .into_iter()
            .partition(|(kind, _)| kind.contains(" leases "));
        let total: f64 = operator.values().fold(0.0, |sum, n| sum + n);
        let healthy: usize = user.ask("healthy").await.parse().expect("a count");
        println!(
            "converge {n}: {total} operator writes during {} s of steady state (target 0){}; \
             {healthy}/{n} still Healthy; the API server's own Lease renewals beside them: {}",
            steady.as_secs(),
            if total == 0.0 {
                String::new()
            } else {
                format!(": {operator:?}")
            },
            own.values().fold(0.0, |sum, n| sum + n)
        );
    }

    // The in-memory provider keeps every instance in this process, where a real one keeps them
    // in libvirt or the cluster: its share is estimated as the heap a copy of its table takes.
    let before = LIVE_HEAP.load(Ordering::Relaxed);
    let table: BTreeMap<String, Instance> = memory
        .list()
        .await
        .expect("the in-memory provider lists")
        .into_iter()
        .map(|i| (i.id.native_id.clone(), i))
        .collect();
    let provider_heap = LIVE_HEAP.load(Ordering::Relaxed).saturating_sub(before) as u64;
    drop(table);
    let own_rss = proc_status_bytes("self", "VmRSS");
    let own_anon = proc_status_bytes("self", "RssAnon");
    let own_peak = proc_status_bytes("self", "VmHWM");
    let heap = LIVE_HEAP.load(Ordering::Relaxed) as u64;
    let (etcd_rss, apiserver_rss) = plane.resident_bytes();
    println!(
        "converge {n}: operator memory: RSS {:.1} MB (anonymous {:.1} MB; peak {:.1} MB during this case), \
         live heap {:.1} MB, of which ~{:.1} MB the bench's in-memory provider's instance table (a real \
         provider keeps its instances in libvirt or the cluster); the operator's own: RSS less that \
         table ~{:.1} MB (target <= 64 MB); beside it (other processes) kube-apiserver {:.1} MB and etcd {:.1} MB",
        mb(own_rss),
        mb(own_anon),
        mb(own_peak),
        mb(heap),
        mb(provider_heap),
        mb(own_rss.saturating_sub(provider_heap)),
        mb(apiserver_rss),
        mb(etcd_rss)
    );

    if std::env::var_os("EPO_EXIT_EXPERIMENT").is_some() {
        std::process::exit(0);
    }
    let _ = stop.send(());
    controller.await.expect("controller stops");
    user.stop().await;
    Figures { converged }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if std::env::var("EPO_BENCH_ROLE").as_deref() == Ok("client") {
        runtime.block_on(serve_client());
        return;
    }
    let sizes: Vec<usize> = std::env::var("EPO_BENCH_PROXIES")
        .unwrap_or_else(|_| "1000,10000".to_owned())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("EPO_BENCH_PROXIES: comma-separated counts")
        })
        .collect();
    let steady = Duration::from_secs(env_or("EPO_BENCH_STEADY_SECS", 60));
    let rounds = env_or("EPO_BENCH_ROUNDS", 3).max(1);
    // Rounds alternate the sizes so that both see the same machine; the ratio compares each
    // size's fastest round (other work on a shared machine only ever slows a round down). The
    // steady-state window runs in the last round only.
    let mut best: Vec<(usize, Duration)> = sizes.iter().map(|&n| (n, Duration::MAX)).collect();
    for round in 1..=rounds {
        let steady = if round == rounds { steady } else { Duration::ZERO };
        for (n, fastest) in &mut best {
            println!("converge: round {round}/{rounds}, {n} Proxies");
            let figures = runtime.block_on(run_case(*n, steady));
            *fastest = (*fastest).min(figures.converged);
        }
    }
    if let (Some((small, first)), Some((large, last))) = (best.first(), best.last())
        && large > small
    {
        println!(
            "converge: {large} Proxies took {:.1}x the time of {small} ({:.0}x the Proxies; target <= {:.0}x), \
             fastest of {rounds} rounds each: {:.2} s and {:.2} s",
            last.as_secs_f64() / first.as_secs_f64(),
            *large as f64 / *small as f64,
            1.2 * *large as f64 / *small as f64,
            last.as_secs_f64(),
            first.as_secs_f64(),
        );
    }
}
