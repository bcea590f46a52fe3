//! How N Proxies converge to Healthy through the real cluster-mode controller (kube-runtime
//! `Controller`, watch predicate, Event publisher, status writes) against the fake API server,
//! with the in-memory provider and a health engine that passes at once. For each N (default
//! 1,000 then 10,000 in one run) it prints:
//!
//! - the time from the first create to all Healthy, next to a baseline measured in the same run
//!   (the same API server accepting N plain creates, no controller) and their ratio;
//! - the operator's writes per Proxy on the way to Healthy (finalizer patches + status writes;
//!   target ≤ 4) and its Events per Proxy, counted **at the API server** by verb and
//!   subresource, not from the reconciler's own counters;
//! - the writes during a steady-state window after everything is Healthy (target 0);
//! - the operator's own memory (target ≤ 64 MB at 10,000): resident set (now and peak during
//!   the case) and live heap;
//!
//! and at the end the time ratio of the largest to the smallest N (target ≤ 12× for 10×).
//!
//! Memory is attributed by **process**: the bench re-executes itself as a child process
//! (`EPO_BENCH_ROLE=apiserver`) that only serves the fake API server and answers the parent's
//! commands on stdin/stdout (create N Proxies from its own client, count Healthy ones, report
//! the writes it answered, its own RSS). The parent runs the operator and nothing else (it does
//! not even list Proxies to see progress), so its RSS is the operator's. A counting global
//! allocator adds the parent's live heap, which unlike RSS does not keep the high-water mark of
//! an earlier case. The peak RSS is reset per case through `/proc/self/clear_refs`.
//!
//! `cargo bench --bench converge`. Environment:
//! - `EPO_BENCH_PROXIES`: comma-separated sizes (default `1000,10000`);
//! - `EPO_BENCH_STEADY_SECS`: the steady-state window in seconds (default 60; 0 skips it);
//! - `EPO_BENCH_ROUNDS`: rounds over the sizes (default 3); the ratio compares each size's
//!   fastest round, and the steady-state window runs in the last round only.

// The module allows its own dead code (not every user needs every hook).
#[path = "../tests/support/fake_apiserver/mod.rs"]
mod fake_apiserver;

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

use egress_proxies_operator::{
    api::Proxy,
    cluster::{ClusterDeps, run_controller},
    controller::{ProviderAvailability, ReconcilerConfig},
    effects::{DrainStatus, HealthControl, HealthTarget, HealthVerdict, LeaseControl, LeaseTarget, ProxyKey},
    provider::{Instance, Provider, ProviderRegistry, memory::MemoryProvider},
    telemetry::Metrics,
};
use fake_apiserver::FakeApiServer;
use kube::{Api, api::PostParams};
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
    fn verdict(&self, key: &ProxyKey) -> HealthVerdict {
        if self.passing.lock().unwrap().contains(key) {
            HealthVerdict::Passing
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

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

// ---------------------------------------------------------------------------------------------
// The child: the fake API server and nothing else.

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

/// Serves the fake API server; one command per stdin line, one answer per stdout line:
/// `create PREFIX N` → seconds taken; `healthy` → Proxies whose status.phase is healthy;
/// `writes` → JSON `{"verb resource[/subresource] code": count}` of the writes answered since
/// the last `clear`; `clear` → `ok`; `rss` → its resident set in bytes. EOF ends it.
async fn serve_api() {
    let server = FakeApiServer::start().await;
    let api: Api<Proxy> = Api::namespaced(server.client(), NAMESPACE);
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
    say(&server.url());
    while let Some(line) = lines.recv().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["create", prefix, n] => {
                let n = n.parse().expect("a count");
                create_all(&api, prefix, n).await.as_secs_f64().to_string()
            }
            ["healthy"] => server
                .count_json("proxies", Some(NAMESPACE), |p| {
                    p.pointer("/status/phase").and_then(Value::as_str) == Some("healthy")
                })
                .to_string(),
            ["writes"] => {
                let mut counts = BTreeMap::<String, usize>::new();
                for w in server.writes() {
                    let resource = match &w.subresource {
                        Some(sub) => format!("{}/{sub}", w.resource),
                        None => w.resource.clone(),
                    };
                    *counts
                        .entry(format!("{:?} {resource} {}", w.verb, w.code))
                        .or_default() += 1;
                }
                serde_json::to_string(&counts).expect("a map serializes")
            }
            ["clear"] => {
                server.clear_requests();
                "ok".to_owned()
            }
            ["rss"] => proc_status_bytes("self", "VmRSS").to_string(),
            _ => panic!("unknown command {line:?}"),
        };
        say(&answer);
    }
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").expect("stdout");
    out.flush().expect("stdout");
}

/// The parent's handle on a child serving the fake API server.
struct ApiProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    url: String,
}

impl ApiProcess {
    async fn start() -> Self {
        let exe = std::env::current_exe().expect("the bench's own path");
        let mut child = Command::new(exe)
            .env("EPO_BENCH_ROLE", "apiserver")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the API server process");
        let stdin = child.stdin.take().expect("piped stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let url = lines
            .next_line()
            .await
            .expect("read the child")
            .expect("the child prints its URL");
        Self {
            child,
            stdin,
            lines,
            url,
        }
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

    fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url.parse().expect("a URL"));
        kube::Client::try_from(config).expect("a client")
    }

    async fn writes(&mut self) -> BTreeMap<String, usize> {
        serde_json::from_str(&self.ask("writes").await).expect("the child's write counts")
    }

    async fn stop(mut self) {
        drop(self.stdin);
        let _ = self.child.wait().await;
    }
}

/// Sums the counts whose `verb resource code` key satisfies `pick`.
fn sum(writes: &BTreeMap<String, usize>, pick: impl Fn(&str, &str, u16) -> bool) -> usize {
    writes
        .iter()
        .filter(|(key, _)| {
            let mut parts = key.split(' ');
            let (verb, resource, code) = (
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
                parts.next().and_then(|c| c.parse().ok()).unwrap_or(0),
            );
            pick(verb, resource, code)
        })
        .map(|(_, n)| n)
        .sum()
}

// ---------------------------------------------------------------------------------------------
// The parent: the operator.

struct Figures {
    converged: Duration,
}

async fn run_case(n: usize, steady: Duration) -> Figures {
    // Baseline: the API server accepting N creates, no controller running.
    let mut baseline_api = ApiProcess::start().await;
    let baseline: f64 = baseline_api
        .ask(&format!("create baseline {n}"))
        .await
        .parse()
        .expect("seconds");
    baseline_api.stop().await;

    // Peak RSS from here on (Linux: writing 5 to clear_refs resets VmHWM).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let mut api = ApiProcess::start().await;
    let client = api.client();
    let mut providers = ProviderRegistry::new();
    let memory = Arc::new(MemoryProvider::new("mem"));
    providers.insert(memory.clone());
    let (trigger_tx, trigger_rx) = mpsc::unbounded_channel();
    let health = Arc::new(InstantHealth {
        passing: Mutex::default(),
        triggers: trigger_tx,
    });
    let mut registry = Registry::default();
    let deps = ClusterDeps {
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

    let started = Instant::now();
    let creating: f64 = api
        .ask(&format!("create proxy {n}"))
        .await
        .parse()
        .expect("seconds");
    let converged = loop {
        let asked = Instant::now();
        let healthy: usize = api.ask("healthy").await.parse().expect("a count");
        if healthy == n {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "only {healthy}/{n} healthy after 600 s"
        );
        // Each poll scans every stored Proxy in the child, holding its store, on the cores the
        // operator uses: waiting 20x a poll's time between polls keeps that under 5 % of the
        // run at every N (a fixed interval would tax 10,000 Proxies 10x as much as 1,000).
        tokio::time::sleep((asked.elapsed() * 20).max(Duration::from_millis(50))).await;
    };
    let writes = api.writes().await;
    let finalizer = sum(&writes, |verb, resource, _| {
        resource == "proxies" && matches!(verb, "Patch" | "Update")
    });
    let status = sum(&writes, |_, resource, _| resource == "proxies/status");
    let failed = sum(&writes, |verb, resource, code| {
        resource.starts_with("proxies") && verb != "Create" && !(200..300).contains(&code)
    });
    let events = sum(&writes, |verb, resource, _| {
        resource == "events" && verb == "Create"
    });
    let series = sum(&writes, |verb, resource, _| {
        resource == "events" && verb == "Patch"
    });
    let per = |count: usize| count as f64 / n as f64;

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

    if !steady.is_zero() {
        api.ask("clear").await;
        tokio::time::sleep(steady).await;
        let writes = api.writes().await;
        let total: usize = writes.values().sum();
        let healthy: usize = api.ask("healthy").await.parse().expect("a count");
        println!(
            "converge {n}: {total} writes during {} s of steady state (target 0){}; {healthy}/{n} still Healthy",
            steady.as_secs(),
            if total == 0 {
                String::new()
            } else {
                format!(": {writes:?}")
            }
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
    let api_rss: u64 = api.ask("rss").await.parse().expect("bytes");
    println!(
        "converge {n}: operator memory: RSS {:.1} MB (anonymous {:.1} MB; peak {:.1} MB during this case), \
         live heap {:.1} MB, of which ~{:.1} MB the bench's in-memory provider's instance table (a real \
         provider keeps its instances in libvirt or the cluster); the operator's own: RSS less that \
         table ~{:.1} MB (target <= 64 MB); the fake API server's RSS (another process) {:.1} MB",
        mb(own_rss),
        mb(own_anon),
        mb(own_peak),
        mb(heap),
        mb(provider_heap),
        mb(own_rss.saturating_sub(provider_heap)),
        mb(api_rss)
    );

    if std::env::var_os("EPO_EXIT_EXPERIMENT").is_some() {
        std::process::exit(0);
    }
    let _ = stop.send(());
    controller.await.expect("controller stops");
    api.stop().await;
    Figures { converged }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if std::env::var("EPO_BENCH_ROLE").as_deref() == Ok("apiserver") {
        runtime.block_on(serve_api());
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
