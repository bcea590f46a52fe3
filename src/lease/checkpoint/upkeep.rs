//! The lease store's upkeep: the task that reaps expired state and saves checkpoints off the
//! hot path ([`maintenance`]), what it writes ([`CheckpointSaver`]: only what changed) and how it
//! reports ([`CheckpointReport`]: metrics, a health channel for `/readyz`, Events).

use std::{
    collections::BTreeSet,
    future::Future,
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use prometheus_client::{
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};
use tokio::sync::watch;

use super::{CheckpointError, CheckpointStore, Written};
use crate::lease::LeaseStore;

/// How often [`maintenance`] reaps and checkpoints, and where it reports.
#[derive(Clone, Debug)]
pub struct MaintenanceConfig {
    /// Between two reaps of expired leases, bans and bindings.
    pub reap_interval: Duration,
    /// Between two checkpoints (taken only if something changed). This is the window in which
    /// a crash loses state that only signed claims can bring back. A per-shard store writes
    /// each changed shard's part at most once per interval.
    pub checkpoint_interval: Duration,
    /// Where saves are counted and failures reported.
    pub report: CheckpointReport,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            reap_interval: Duration::from_secs(1),
            checkpoint_interval: Duration::from_secs(1),
            report: CheckpointReport::default(),
        }
    }
}

/// Whether checkpoints are being saved, as [`CheckpointReport::subscribe`] tells it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckpointHealth {
    /// The last save's error, while saves fail.
    pub failing: Option<String>,
    /// Failed saves in a row.
    pub consecutive_failures: u64,
}

/// Counts checkpoint saves and reports failures: metrics (register them with
/// [`Self::register`]) and a [`CheckpointHealth`] channel (readiness detail, Events).
/// Clones share their counts.
#[derive(Clone, Debug)]
pub struct CheckpointReport {
    failures: Counter,
    last_success: Gauge<f64, AtomicU64>,
    bytes: Counter,
    objects: Counter,
    health: Arc<watch::Sender<CheckpointHealth>>,
}

impl Default for CheckpointReport {
    fn default() -> Self {
        Self {
            failures: Counter::default(),
            last_success: Gauge::default(),
            bytes: Counter::default(),
            objects: Counter::default(),
            health: Arc::new(watch::channel(CheckpointHealth::default()).0),
        }
    }
}

impl CheckpointReport {
    /// Registers the metrics in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "epo_lease_checkpoint_failures",
            "Lease checkpoint saves that failed (each is retried at the next interval)",
            self.failures.clone(),
        );
        registry.register(
            "epo_lease_checkpoint_last_success_timestamp_seconds",
            "When a lease checkpoint save last succeeded (Unix time; 0 before the first)",
            self.last_success.clone(),
        );
        registry.register(
            "epo_lease_checkpoint_written_bytes",
            "Bytes of lease checkpoint data written",
            self.bytes.clone(),
        );
        registry.register(
            "epo_lease_checkpoint_written_objects",
            "Lease checkpoint objects (files, ConfigMaps) written or deleted",
            self.objects.clone(),
        );
    }

    /// Follows the save health.
    pub fn subscribe(&self) -> watch::Receiver<CheckpointHealth> {
        self.health.subscribe()
    }

    /// The save health now.
    pub fn health(&self) -> CheckpointHealth {
        self.health.borrow().clone()
    }

    /// Failed saves so far.
    pub fn failures(&self) -> u64 {
        self.failures.get()
    }

    /// Written so far.
    pub fn written(&self) -> Written {
        Written {
            objects: self.objects.get(),
            bytes: self.bytes.get(),
        }
    }

    fn wrote(&self, written: Written) {
        self.objects.inc_by(written.objects);
        self.bytes.inc_by(written.bytes);
    }

    fn outcome(&self, result: &Result<(), CheckpointError>) {
        match result {
            Ok(()) => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                self.last_success.set(now.as_secs_f64());
                self.health.send_if_modified(|h| {
                    let changed = h.failing.is_some();
                    *h = CheckpointHealth::default();
                    changed
                });
            }
            Err(error) => {
                self.failures.inc();
                self.health.send_modify(|h| {
                    h.failing = Some(error.to_string());
                    h.consecutive_failures += 1;
                });
            }
        }
    }
}

/// Saves what changed since its last successful save: one part per changed store shard for
/// a per-shard store; for a store that takes deltas ([`CheckpointStore::deltas`]), a
/// [`CheckpointDelta`](super::CheckpointDelta) of the proxies that changed, or the whole document
/// when the store asks for one (its first save, or to fold its deltas); else the whole document.
/// A part that fails stays pending and goes out with the next save; a delta that fails makes the
/// next save a whole document (the changes it took are in no other). [`maintenance`] calls it
/// every checkpoint interval; benchmarks and tests drive it directly.
#[derive(Debug, Default)]
pub struct CheckpointSaver {
    shards: BTreeSet<usize>,
    whole: bool,
    /// Write at the next save even if nothing changed (a delta store: an empty delta).
    flush: bool,
    /// A whole document went out through this saver: deltas have a base. Until then (at
    /// start, when every restored proxy counts as changed) a delta would be taken only to be
    /// refused.
    based: bool,
}

impl CheckpointSaver {
    /// Makes the next save write the whole document even if nothing changed.
    pub fn force(&mut self) {
        self.whole = true;
    }

    /// Makes the next save write even if nothing changed: a delta (possibly naming nothing)
    /// to a store that takes deltas, else the whole document. E.g. to stamp a new journal
    /// sequence number on the checkpoint.
    pub fn flush(&mut self) {
        self.flush = true;
    }

    /// Whether the next [`Self::save`] to a one-document store writes (clears no marks).
    pub fn pending(&mut self, store: &LeaseStore) -> bool {
        self.whole || self.flush || store.has_changes()
    }

    /// Saves what changed to `sink`, counting and reporting to `report`.
    pub async fn save(
        &mut self,
        store: &LeaseStore,
        sink: &dyn CheckpointStore,
        report: &CheckpointReport,
    ) -> Result<(), CheckpointError> {
        if sink.per_shard() {
            self.shards.extend(store.take_dirty_shards());
            if self.shards.is_empty() {
                return Ok(());
            }
            let which: Vec<usize> = self.shards.iter().copied().collect();
            let parts = {
                let (store, which) = (store.clone(), which.clone());
                off_the_serving_threads(move || store.checkpoint_shards(&which)).await?
            };
            let mut result = Ok(());
            for (shard, part) in which.iter().zip(parts) {
                // Other shards still go out when one fails (e.g. it grew past a size limit).
                match sink.save_shard(*shard, &part).await {
                    Ok(written) => {
                        report.wrote(written);
                        self.shards.remove(shard);
                    }
                    Err(error) => result = Err(error),
                }
            }
            report.outcome(&result);
            return result;
        }
        if sink.deltas() && self.based && !self.whole {
            if !self.flush && !store.has_changes() {
                return Ok(());
            }
            // Reads only what changed, but under load that is every proxy of a large pool:
            // taken off the serving threads like the whole snapshot.
            let delta = {
                let store = store.clone();
                off_the_serving_threads(move || store.checkpoint_delta()).await?
            };
            match sink.save_delta(delta).await {
                Ok(Some(written)) => {
                    report.wrote(written);
                    self.flush = false;
                    report.outcome(&Ok(()));
                    return Ok(());
                }
                // The store wants the whole document: its first, or a fold.
                Ok(None) => self.whole = true,
                Err(error) => {
                    self.whole = true;
                    let result = Err(error);
                    report.outcome(&result);
                    return result;
                }
            }
        }
        // Taken before the snapshot is read: what changes meanwhile is noted again.
        self.whole |= store.take_dirty() || self.flush;
        if !self.whole {
            return Ok(());
        }
        let checkpoint = {
            let store = store.clone();
            off_the_serving_threads(move || store.checkpoint()).await?
        };
        let result = sink.save(&checkpoint).await.map(|written| {
            report.wrote(written);
            self.whole = false;
            self.flush = false;
            self.based = true;
        });
        report.outcome(&result);
        result
    }
}

/// Runs `f` (taking a snapshot of the store: milliseconds for many proxies) on the blocking
/// pool, so the runtime's workers keep serving requests meanwhile.
async fn off_the_serving_threads<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, CheckpointError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CheckpointError::Backend(format!("checkpoint snapshot task failed: {e}")))
}

/// Reaps expired state and saves checkpoints until `shutdown` completes, then saves a last
/// checkpoint. A failed save is logged, counted and reported through
/// [`MaintenanceConfig::report`], and retried at the next interval; the last one's error is
/// returned.
pub async fn maintenance(
    store: LeaseStore,
    sink: Option<Arc<dyn CheckpointStore>>,
    config: MaintenanceConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), CheckpointError> {
    let mut reap = tokio::time::interval(config.reap_interval);
    let mut save = tokio::time::interval(config.checkpoint_interval);
    reap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut saver = CheckpointSaver::default();
    let report = &config.report;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = reap.tick() => {
                let expired = store.reap();
                if expired > 0 {
                    tracing::debug!(expired, "reaped expired leases");
                }
            }
            _ = save.tick(), if sink.is_some() => {
                if let Some(sink) = &sink
                    && let Err(error) = saver.save(&store, sink.as_ref(), report).await
                {
                    tracing::warn!(%error, "saving the lease checkpoint failed; retrying");
                }
            }
        }
    }
    // The last save always writes (as before shards): a clean stop leaves a checkpoint.
    saver.force();
    match sink {
        Some(sink) => saver.save(&store, sink.as_ref(), report).await,
        None => Ok(()),
    }
}
