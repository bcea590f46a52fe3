//! The cluster-mode lease checkpoint at 10,000 and 100,000 active leases, against the
//! in-process fake API server (real HTTP, real `kube::Client`, a real cluster's size limits):
//! bytes and objects written per second under steady renew traffic, and restore time on a
//! leader change. Run: `cargo bench --bench lease_checkpoint`; `EPO_BENCH_SECS` sets the seconds
//! of renew traffic per case (default 5).
//!
//! Baselines, measured in the same run: writes are compared with rewriting the whole checkpoint
//! every interval (what the one-ConfigMap layout did, while it fit), restore with decoding and
//! restoring the same checkpoint from one in-memory JSON document (no API server).

#[path = "../tests/support/fake_apiserver/mod.rs"]
mod fake_apiserver;
#[allow(dead_code)]
#[path = "../tests/support/leases.rs"]
mod leases;

use std::time::{Duration, Instant};

use egress_proxies_operator::{
    cluster::ConfigMapCheckpoint,
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{self, CheckpointReport, CheckpointSaver, CheckpointStore},
    },
};
use fake_apiserver::FakeApiServer;

fn bench_secs() -> u64 {
    std::env::var("EPO_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

/// Renewals per second under steady traffic: every lease renewed once a minute (a 3-minute TTL
/// renewed at a third of it), the pattern the Python client follows.
fn steady_rate(leases: usize) -> usize {
    leases / 60
}

/// Written per checkpoint interval (1 s), i.e. per second.
struct Rates {
    bytes_per_s: f64,
    objects_per_s: f64,
}

/// Renews `rate` leases per second (round-robin, in 10 ms batches) for `secs` checkpoint
/// intervals of 1 s, saving what changed at each as the maintenance loop does.
async fn renew_traffic(
    store: &LeaseStore,
    held: &mut [leases::Held],
    sink: &dyn CheckpointStore,
    rate: usize,
    secs: u64,
) -> Rates {
    let report = CheckpointReport::default();
    let mut saver = CheckpointSaver::default();
    // Start clean: the first full save is not steady state.
    saver.save(store, sink, &report).await.expect("initial save");
    let start_written = report.written();
    let start = Instant::now();
    let mut next = 0;
    let mut renewed = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut last_save = Instant::now();
    let mut saves = 0u32;
    while saves < secs as u32 {
        tick.tick().await;
        let due = (start.elapsed().as_secs_f64() * rate as f64) as usize;
        while renewed < due {
            let (id, token) = &mut held[next];
            *token = store.renew(id, *token, None).expect("renewable").fencing_token;
            next = (next + 1) % held.len();
            renewed += 1;
        }
        if last_save.elapsed() >= Duration::from_secs(1) {
            last_save = Instant::now();
            saver.save(store, sink, &report).await.expect("save");
            saves += 1;
        }
    }
    let written = report.written();
    Rates {
        bytes_per_s: (written.bytes - start_written.bytes) as f64 / f64::from(saves),
        objects_per_s: (written.objects - start_written.objects) as f64 / f64::from(saves),
    }
}

async fn case(leases: usize, secs: u64) {
    let server = FakeApiServer::start().await;
    let (store, mut held) = leases::filled_store(leases);
    let sink = ConfigMapCheckpoint::new(server.client(), "default");
    let whole = checkpoint::encode(&store.checkpoint()).len() as f64;
    println!(
        "{leases} active leases ({} MiB of checkpoint JSON):",
        fmt_mib(whole)
    );
    for (what, rate) in [
        ("steady renew traffic", steady_rate(leases)),
        ("sparse traffic", 1),
    ] {
        let rates = renew_traffic(&store, &mut held, &sink, rate, secs).await;
        println!(
            "  {what} ({rate} renewals/s): {} MiB/s and {:.1} objects/s written; {:.2}x the bytes of rewriting the whole checkpoint every second",
            fmt_mib(rates.bytes_per_s),
            rates.objects_per_s,
            rates.bytes_per_s / whole,
        );
    }

    // Leader change: a new process lists the parts and restores every lease.
    let start = Instant::now();
    let loaded = ConfigMapCheckpoint::new(server.client(), "default")
        .load()
        .await
        .expect("load")
        .expect("saved");
    let successor = LeaseStore::new(LeaseStoreConfig::default());
    successor.restore(&loaded);
    let restore = start.elapsed();
    assert_eq!(successor.active_total(), leases);
    let json = checkpoint::encode(&store.checkpoint());
    let start = Instant::now();
    let local = LeaseStore::new(LeaseStoreConfig::default());
    local.restore(&checkpoint::decode(&json).expect("decodes"));
    let baseline = start.elapsed();
    assert_eq!(local.active_total(), leases);
    println!(
        "  restore on leader change: {:.0} ms from the API server ({:.1}x decoding and restoring one in-memory document: {:.0} ms)",
        restore.as_secs_f64() * 1e3,
        restore.as_secs_f64() / baseline.as_secs_f64(),
        baseline.as_secs_f64() * 1e3,
    );
}

fn fmt_mib(bytes: f64) -> String {
    format!("{:.2}", bytes / (1024.0 * 1024.0))
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let secs = bench_secs();
    runtime.block_on(async {
        for leases in [10_000, 100_000] {
            case(leases, secs).await;
        }
    });
}
