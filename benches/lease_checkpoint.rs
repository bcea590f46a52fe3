//! The cluster-mode lease checkpoint at 10,000 and 100,000 active leases, against a real
//! kube-apiserver and etcd (built by `scripts/lib/control-plane.sh`; etcd syncing every write to
//! disk, as in production): bytes and objects written per second under steady renew traffic,
//! what etcd itself wrote (its WAL bytes and database size), and restore time on a leader change. Run: `cargo bench --bench lease_checkpoint`; `EPO_BENCH_SECS` sets the seconds
//! of renew traffic per case (default 5).
//!
//! Baselines, measured in the same run: writes are compared with rewriting the whole checkpoint
//! every interval (what the one-ConfigMap layout did, while it fit), restore with decoding and
//! restoring the same checkpoint from one in-memory JSON document (no API server).

#[path = "../tests/support/control_plane.rs"]
mod control_plane;
#[allow(dead_code)]
#[path = "../tests/support/leases.rs"]
mod leases;
#[path = "../tests/support/ports.rs"]
mod ports;
#[path = "../tests/support/process.rs"]
mod process;

use std::time::{Duration, Instant};

use control_plane::{ControlPlane, Options};
use egress_proxies_operator::{
    cluster::ConfigMapCheckpoint,
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{self, CheckpointReport, CheckpointSaver, CheckpointStore},
    },
};

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
    /// What etcd appended to its write-ahead log.
    etcd_wal_bytes_per_s: f64,
}

/// Renews `rate` leases per second (round-robin, in 10 ms batches) for `secs` checkpoint
/// intervals of 1 s, saving what changed at each as the maintenance loop does.
async fn renew_traffic(
    plane: &ControlPlane,
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
    let wal_before = etcd_metric(&plane.etcd_metrics().await, WAL_BYTES);
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
    let wal = etcd_metric(&plane.etcd_metrics().await, WAL_BYTES) - wal_before;
    Rates {
        bytes_per_s: (written.bytes - start_written.bytes) as f64 / f64::from(saves),
        objects_per_s: (written.objects - start_written.objects) as f64 / f64::from(saves),
        etcd_wal_bytes_per_s: wal / f64::from(saves),
    }
}

const WAL_BYTES: &str = "etcd_disk_wal_write_bytes_total";

/// A counter or gauge from etcd's metrics text (0 when absent).
fn etcd_metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .sum()
}

async fn case(leases: usize, secs: u64) {
    let plane = ControlPlane::start_with(Options {
        etcd_fsync: true,
        ..Options::default()
    })
    .await;
    let (store, mut held) = leases::filled_store(leases);
    // Crawlers renew in no particular order: renewals in acquire order would touch a few
    // proxies' shards for seconds on end.
    fastrand::Rng::with_seed(7).shuffle(&mut held);
    let sink = ConfigMapCheckpoint::new(plane.client().await, "default");
    let whole = checkpoint::encode(&store.checkpoint()).len() as f64;
    println!(
        "{leases} active leases ({} MiB of checkpoint JSON):",
        fmt_mib(whole)
    );
    for (what, rate) in [
        ("steady renew traffic", steady_rate(leases)),
        ("sparse traffic", 1),
    ] {
        let rates = renew_traffic(&plane, &store, &mut held, &sink, rate, secs).await;
        println!(
            "  {what} ({rate} renewals/s): {} MiB/s and {:.1} objects/s written; {:.2}x the bytes of rewriting the whole checkpoint every second; etcd's WAL took {} MiB/s",
            fmt_mib(rates.bytes_per_s),
            rates.objects_per_s,
            rates.bytes_per_s / whole,
            fmt_mib(rates.etcd_wal_bytes_per_s),
        );
    }

    // Leader change: a new process lists the parts and restores every lease.
    let start = Instant::now();
    let loaded = ConfigMapCheckpoint::new(plane.client().await, "default")
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
    let metrics = plane.etcd_metrics().await;
    let (etcd_rss, apiserver_rss) = plane.resident_bytes();
    println!(
        "  etcd afterwards: database {} MiB ({} MiB in use; history is compacted by kube-apiserver every 5 min), RSS {} MiB; kube-apiserver RSS {} MiB",
        fmt_mib(etcd_metric(&metrics, "etcd_mvcc_db_total_size_in_bytes")),
        fmt_mib(etcd_metric(&metrics, "etcd_mvcc_db_total_size_in_use_in_bytes")),
        fmt_mib(etcd_rss as f64),
        fmt_mib(apiserver_rss as f64),
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
