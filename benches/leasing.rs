//! Benchmarks of the lease store, the discovery API and the health engine, each printed with a
//! baseline measured in the same run. Run: `cargo bench --bench leasing` (all), or name parts:
//! `cargo bench --bench leasing -- store http health`. `EPO_BENCH_SECS` sets the seconds per
//! store/HTTP case (default 3), `EPO_BENCH_HEALTH_SECS` the health window (default 30).

use std::{
    convert::Infallible,
    hint::black_box,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use egress_proxies_operator::{
    api::ProxyKey,
    discovery,
    health::{HealthConfig, HealthEngine, HealthTarget},
    lease::{AcquireRequest, CompiledSelector, LeaseStore, Outcome, Selector},
    provider::Endpoint,
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

#[path = "common/mod.rs"]
mod common;

use common::{PROXIES, TOKEN, filled_store};

fn secs(var: &str, default: u64) -> Duration {
    Duration::from_secs(
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

fn thread_cpu_now() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Pairs per wall-clock second, and per CPU-second the threads got (what a dedicated core does:
/// on a machine shared with other work, the wall-clock figure understates it).
struct Rate {
    wall: f64,
    per_cpu_second: f64,
}

/// Acquire+release pairs per second over `threads` threads.
fn run_store(store: &LeaseStore, selector: &CompiledSelector, threads: usize, for_: Duration) -> Rate {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (store, selector, stop) = (store.clone(), selector.clone(), stop.clone());
            std::thread::spawn(move || {
                let cpu0 = thread_cpu_now();
                let mut pairs = 0u64;
                let req = AcquireRequest {
                    selector: &selector,
                    holder: "bench",
                    ttl: Duration::from_secs(60),
                    target_domain: None,
                    session_key: None,
                    request_id: None,
                };
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..256 {
                        let lease = store.acquire(&req).expect("10k proxies, 2 holders");
                        store
                            .release(&lease.id, lease.fencing_token, Outcome::Ok, None)
                            .expect("own lease");
                    }
                    pairs += 256;
                }
                (pairs, thread_cpu_now() - cpu0)
            })
        })
        .collect();
    std::thread::sleep(for_);
    stop.store(true, Ordering::Relaxed);
    let results: Vec<(u64, f64)> = handles
        .into_iter()
        .map(|h| h.join().expect("bench thread"))
        .collect();
    let wall = started.elapsed().as_secs_f64();
    let pairs: u64 = results.iter().map(|r| r.0).sum();
    let per_cpu_second = results.iter().map(|(p, cpu)| *p as f64 / cpu.max(1e-9)).sum();
    Rate {
        wall: pairs as f64 / wall,
        per_cpu_second,
    }
}

/// The floor: a shared `Mutex<VecDeque>` LRU (pop the front, push the back) per "pair", same
/// threads and time.
fn run_mutex_baseline(threads: usize, for_: Duration) -> Rate {
    let pool = Arc::new(Mutex::new(
        (0..PROXIES as u32).collect::<std::collections::VecDeque<_>>(),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let cpu0 = thread_cpu_now();
                let mut pairs = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..256 {
                        let id = pool.lock().expect("no panics").pop_front();
                        black_box(id);
                        if let Some(id) = id {
                            pool.lock().expect("no panics").push_back(id);
                        }
                    }
                    pairs += 256;
                }
                (pairs, thread_cpu_now() - cpu0)
            })
        })
        .collect();
    std::thread::sleep(for_);
    stop.store(true, Ordering::Relaxed);
    let results: Vec<(u64, f64)> = handles
        .into_iter()
        .map(|h| h.join().expect("bench thread"))
        .collect();
    let wall = started.elapsed().as_secs_f64();
    let pairs: u64 = results.iter().map(|r| r.0).sum();
    Rate {
        wall: pairs as f64 / wall,
        per_cpu_second: results.iter().map(|(p, cpu)| *p as f64 / cpu.max(1e-9)).sum(),
    }
}

fn bench_store() {
    let for_ = secs("EPO_BENCH_SECS", 3);
    println!(
        "lease store: {PROXIES} proxies, acquire+release pairs, {}s per case",
        for_.as_secs()
    );
    let store = filled_store(1);
    let any = store.compile(&Selector::default());
    let eu = store.compile(&Selector::parse("region=eu").expect("valid"));
    let eu_dc = store.compile(&Selector::parse("region=eu,tier=dc").expect("valid"));
    let baseline = run_mutex_baseline(2, for_);
    let one = run_store(&store, &any, 1, for_);
    println!("  (wall: pairs per elapsed second; cpu: pairs per CPU-second each thread got, summed)");
    let mut two_any = None;
    for (name, selector) in [
        ("any proxy", &any),
        ("region=eu", &eu),
        ("region=eu,tier=dc", &eu_dc),
    ] {
        let two = run_store(&store, selector, 2, for_);
        println!(
            "  {name:<18} 2 threads: wall {:>6.2} M/s, cpu {:>6.2} M/s  ({:.2}x / {:.2}x the 5 M/s target; {:.0} % of the Mutex<VecDeque> floor)",
            two.wall / 1e6,
            two.per_cpu_second / 1e6,
            two.wall / 5e6,
            two.per_cpu_second / 5e6,
            100.0 * two.per_cpu_second / baseline.per_cpu_second
        );
        if two_any.is_none() {
            two_any = Some(two);
        }
    }
    println!(
        "  baselines: any proxy on 1 thread: wall {:.2} M/s, cpu {:.2} M/s; Mutex<VecDeque> pop+push on 2 threads: wall {:.2} M/s, cpu {:.2} M/s",
        one.wall / 1e6,
        one.per_cpu_second / 1e6,
        baseline.wall / 1e6,
        baseline.per_cpu_second / 1e6
    );
    let two = two_any.expect("the any-proxy case ran");
    println!(
        "  any proxy, 2 threads / 1 thread: wall {:.2}x ({:.2} / {:.2} M/s), cpu {:.2}x  (target: wall >= 1.6x; {})",
        two.wall / one.wall,
        two.wall / 1e6,
        one.wall / 1e6,
        two.per_cpu_second / one.per_cpu_second,
        if two.wall >= 1.6 * one.wall {
            "PASS"
        } else {
            "FAIL"
        }
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "  machine load average while measuring: {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
}

// ---------------------------------------------------------------------------------------------

struct Load {
    requests: u64,
    seconds: f64,
    latencies_us: Vec<u32>,
}

impl Load {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
    fn percentile(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us[i] as f64 / 1000.0
    }
}

/// The two fields of an acquire answer the client needs (the rest is skipped unparsed, so the
/// client spends its core on requests, not on JSON trees).
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Granted {
    lease_id: String,
    fencing_token: u64,
}

/// 64 keep-alive connections, each acquiring then releasing in a closed loop.
async fn drive(addr: std::net::SocketAddr, connections: usize, for_: Duration) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (stop, count) = (stop.clone(), count.clone());
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let _ = stream.set_nodelay(true);
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .expect("handshake");
            tokio::spawn(conn);
            let mut latencies = Vec::with_capacity(1 << 16);
            let acquire_body =
                Bytes::from_static(br#"{"holder":"bench","selector":{"tier":"dc"},"ttlSeconds":60}"#);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let req = Request::post("/v1/leases")
                    .header("host", "bench")
                    .header("authorization", format!("Bearer {TOKEN}"))
                    .body(Full::new(acquire_body.clone()))
                    .expect("valid request");
                let response = sender.send_request(req).await.expect("acquire answered");
                assert!(response.status().is_success(), "acquire: {}", response.status());
                let body = response.into_body().collect().await.expect("body").to_bytes();
                latencies.push(t.elapsed().as_micros() as u32);
                let lease: Granted = serde_json::from_slice(&body).expect("JSON");
                let id = lease.lease_id;
                let release = format!(r#"{{"fencingToken":{},"outcome":"ok"}}"#, lease.fencing_token);
                let t = Instant::now();
                let req = Request::post(format!("/v1/leases/{id}/release"))
                    .header("host", "bench")
                    .header("authorization", format!("Bearer {TOKEN}"))
                    .body(Full::new(Bytes::from(release)))
                    .expect("valid request");
                let response = sender.send_request(req).await.expect("release answered");
                assert!(response.status().is_success(), "release: {}", response.status());
                response.into_body().collect().await.expect("body");
                latencies.push(t.elapsed().as_micros() as u32);
                count.fetch_add(2, Ordering::Relaxed);
            }
            latencies
        }));
    }
    // Warm up, then measure.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start_count = count.load(Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(for_).await;
    let requests = count.load(Ordering::Relaxed) - start_count;
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut latencies_us = Vec::new();
    for t in tasks {
        latencies_us.extend(t.await.expect("client task"));
    }
    latencies_us.sort_unstable();
    Load {
        requests,
        seconds,
        latencies_us,
    }
}

fn bench_http() {
    let for_ = secs("EPO_BENCH_SECS", 3).max(Duration::from_secs(2));
    let connections = 64;
    println!(
        "discovery API: {connections} keep-alive connections, acquire then release, {}s per server",
        for_.as_secs()
    );
    // Server and client each get their own runtime, the same for both servers. By default one
    // worker thread each: on a 2-core machine that gives each side a core, so the latency
    // measured is the server's, not the OS time-slicing four busy threads over two cores.
    let threads = |var: &str| std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let (server_threads, client_threads) = (
        threads("EPO_BENCH_SERVER_THREADS"),
        threads("EPO_BENCH_CLIENT_THREADS"),
    );
    println!("  server runtime: {server_threads} worker thread(s), client runtime: {client_threads}");
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(server_threads)
        .enable_all()
        .build()
        .expect("server runtime");
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_threads)
        .enable_all()
        .build()
        .expect("client runtime");

    let bare_addr = server_rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(common::serve_bare(listener, None));
        addr
    });
    let bare = client_rt.block_on(drive(bare_addr, connections, for_));

    let store = filled_store(1);
    let api_addr = server_rt.block_on(async {
        let state = common::discovery_state(store.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(discovery::serve(listener, state, std::future::pending()));
        addr
    });
    let api = client_rt.block_on(drive(api_addr, connections, for_));
    let show = |name: &str, l: &Load| {
        println!(
            "  {name:<10} {:>8.0} req/s   p50 {:.2} ms   p99 {:.2} ms   p99.9 {:.2} ms",
            l.rate(),
            l.percentile(0.50),
            l.percentile(0.99),
            l.percentile(0.999)
        );
    };
    show("bare hyper", &bare);
    show("discovery", &api);
    println!(
        "  discovery = {:.0} % of bare hyper (targets: >= 50000 req/s, p99 < 2 ms, >= 50 %)",
        100.0 * api.rate() / bare.rate()
    );
    assert_eq!(store.active_total(), 0, "every lease was released");
    server_rt.shutdown_background();
    client_rt.shutdown_background();
}

// ---------------------------------------------------------------------------------------------

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn process_cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn thread_cpu_seconds(clocks: &[libc::clockid_t]) -> f64 {
    clocks
        .iter()
        .map(|c| {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime writes only `ts`; the clock ids belong to live threads.
            unsafe { libc::clock_gettime(*c, &mut ts) };
            ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
        })
        .sum()
}

fn bench_health() {
    let window = secs("EPO_BENCH_HEALTH_SECS", 30);
    let interval = Duration::from_secs(30);
    println!(
        "health engine: {PROXIES} proxies every {}s, measured over {}s (through a loopback proxy that answers 204)",
        interval.as_secs(),
        window.as_secs()
    );
    // The stand-in proxy runs on its own runtime: its CPU is not the engine's.
    let proxy_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("proxy runtime");
    let proxy_addr = proxy_rt.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|_req: Request<hyper::body::Incoming>| async {
                        let mut r = Response::new(Full::new(Bytes::new()));
                        *r.status_mut() = hyper::StatusCode::NO_CONTENT;
                        Ok::<_, Infallible>(r)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        addr
    });
    let clocks: Arc<Mutex<Vec<libc::clockid_t>>> = Arc::new(Mutex::new(Vec::new()));
    let engine_rt = {
        let clocks = clocks.clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(4)
            .on_thread_start(move || {
                let mut clock: libc::clockid_t = 0;
                // SAFETY: asks for the CPU clock of the calling thread.
                if unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) } == 0 {
                    clocks.lock().expect("no panics").push(clock);
                }
            })
            .enable_all()
            .build()
            .expect("engine runtime")
    };
    let rss_before = rss_kib();
    let (probes, wall, engine_cpu, process_cpu, rss_after) = engine_rt.block_on(async {
        let (handle, mut events) = HealthEngine::start(HealthConfig::default()).expect("engine");
        let passing = Arc::new(AtomicU64::new(0));
        let counter = passing.clone();
        tokio::spawn(async move {
            while events.recv().await.is_some() {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        });
        let cpu0 = thread_cpu_seconds(&clocks.lock().expect("no panics"));
        let process0 = process_cpu_seconds();
        let started = Instant::now();
        for i in 0..PROXIES {
            handle.upsert(HealthTarget {
                key: ProxyKey::new("bench", &format!("p{i}")),
                endpoint: Endpoint {
                    host: proxy_addr.ip().to_string(),
                    port: proxy_addr.port(),
                },
                url: "http://connectivitycheck.example/generate_204".to_owned(),
                interval,
                timeout: Duration::from_secs(5),
                failure_threshold: 3,
                success_threshold: 1,
                expected_egress: None,
                credentials: None,
            });
        }
        tokio::time::sleep(window).await;
        let wall = started.elapsed().as_secs_f64();
        let cpu = thread_cpu_seconds(&clocks.lock().expect("no panics")) - cpu0;
        let process = process_cpu_seconds() - process0;
        let probes: u64 = (0..PROXIES)
            .filter_map(|i| handle.snapshot(&ProxyKey::new("bench", &format!("p{i}"))))
            .map(|s| s.probes)
            .sum();
        (probes, wall, cpu, process, rss_kib())
    });
    println!(
        "  {probes} probes in {wall:.1}s ({:.0}/s); engine threads {:.3} cores ({:.1} µs CPU per probe); whole process incl. the stand-in proxy {:.3} cores",
        probes as f64 / wall,
        engine_cpu / wall,
        1e6 * engine_cpu / probes.max(1) as f64,
        process_cpu / wall
    );
    println!(
        "  process RSS {:.1} MB (+{:.1} MB for the engine and its 10k targets)  (targets: <= 0.5 cores, <= 100 MB)",
        rss_after as f64 / 1024.0,
        rss_after.saturating_sub(rss_before) as f64 / 1024.0
    );
    engine_rt.shutdown_background();
    proxy_rt.shutdown_background();
}

fn main() {
    // `cargo bench` passes `--bench`; everything else names parts to run.
    let parts: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let wants = |p: &str| parts.is_empty() || parts.iter().any(|a| a == p);
    // Health first: its memory figure is the growth of a process that has not allocated yet.
    if wants("health") {
        bench_health();
    }
    if wants("store") {
        bench_store();
    }
    if wants("http") {
        bench_http();
    }
}
