//! Persistence of the lease store: the checkpoint format, where checkpoints are kept, and the
//! maintenance task that reaps expired state and saves checkpoints off the hot path.
//!
//! A [`Checkpoint`] is a versioned JSON document. Standalone mode keeps it in one file
//! ([`FileCheckpoint`]: write to a temporary file, fsync, rename over the old one, fsync the
//! folder, so a crash leaves the old or the new checkpoint, never a torn one). Cluster mode keeps
//! it in Kubernetes objects, one part per lease-store shard ([`CheckpointStore::per_shard`],
//! [`LeaseStore::checkpoint_shards`], joined by [`Checkpoint::merge`]), so a change rewrites
//! only its shard; [`encode_chunks`] splits a part into JSON documents below a size limit (one
//! per object, under the API server's object size limit) and [`decode_chunks`] joins them.
//! [`CheckpointSaver`] writes what changed and [`CheckpointReport`] counts it and reports
//! failures (metrics, a health channel for `/readyz` and Events). Checkpoints hold no secrets:
//! no credentials, no signing key, no lease IDs (an ID is only valid with the key's signature).

use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, atomic::AtomicU64},
    time::Duration,
};

use async_trait::async_trait;
use prometheus_client::{
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{LeaseStore, ProxyKey};

/// A snapshot of the lease store's durable state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Checkpoint {
    /// Format version ([`Checkpoint::VERSION`]).
    pub version: u32,
    /// When it was taken (ms since the epoch).
    pub saved_at_ms: u64,
    /// Highest fencing token issued per shard number when each shard was snapshotted.
    pub token_hwm: BTreeMap<u16, u64>,
    /// Proxies with state worth keeping.
    #[serde(default)]
    pub proxies: Vec<ProxyCheckpoint>,
    /// Sticky-session bindings.
    #[serde(default)]
    pub sessions: Vec<SessionCheckpoint>,
    /// The last lease journal record this snapshot holds (standalone mode with durability,
    /// [`super::journal`]): replay skips it and every earlier one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal_seq: Option<u64>,
}

impl Checkpoint {
    /// The format version this build writes and reads.
    pub const VERSION: u32 = 1;

    /// Joins parts (e.g. one per store shard, written at different times) into one
    /// checkpoint: token high-water marks take the highest, a proxy named by two parts keeps
    /// the newer part's state (it moved between parts or shard counts changed), a session
    /// bound in two parts keeps the later-expiring binding. `None` for no parts.
    pub fn merge(parts: impl IntoIterator<Item = Checkpoint>) -> Option<Checkpoint> {
        let mut parts: Vec<Checkpoint> = parts.into_iter().collect();
        // Oldest first, so a newer part's proxy replaces an older one's.
        parts.sort_by_key(|p| p.saved_at_ms);
        let mut out = Checkpoint {
            version: Self::VERSION,
            saved_at_ms: parts.last()?.saved_at_ms,
            ..Checkpoint::default()
        };
        let mut proxies: BTreeMap<ProxyKey, ProxyCheckpoint> = BTreeMap::new();
        let mut sessions: BTreeMap<String, SessionCheckpoint> = BTreeMap::new();
        for part in parts {
            for (shard, hwm) in part.token_hwm {
                let have = out.token_hwm.entry(shard).or_insert(0);
                *have = (*have).max(hwm);
            }
            for p in part.proxies {
                proxies.insert(p.key.clone(), p);
            }
            for s in part.sessions {
                match sessions.get(&s.session_key) {
                    Some(have) if have.expires_at_ms >= s.expires_at_ms => {}
                    _ => {
                        sessions.insert(s.session_key.clone(), s);
                    }
                }
            }
        }
        out.proxies = proxies.into_values().collect();
        out.sessions = sessions.into_values().collect();
        Some(out)
    }

    /// Number of active leases in the checkpoint.
    pub fn lease_count(&self) -> usize {
        self.proxies.iter().map(|p| p.leases.len()).sum()
    }
}

/// Admission as persisted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointAdmission {
    /// Taking new leases.
    Open,
    /// Not taking new leases.
    Closed,
    /// Not taking new leases nor renewals.
    Draining,
}

/// One proxy's durable lease state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyCheckpoint {
    /// The proxy.
    pub key: ProxyKey,
    /// Its admission.
    pub admission: CheckpointAdmission,
    /// End of its cooldown, if resting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_until_ms: Option<u64>,
    /// Leases with a lower first token were revoked.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revoked_below: u64,
    /// Per-domain bans.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bans: Vec<BanCheckpoint>,
    /// Active leases.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leases: Vec<LeaseCheckpoint>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A per-domain ban.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BanCheckpoint {
    /// The domain (lowercase).
    pub domain: String,
    /// When it ends.
    pub until_ms: u64,
}

/// One active lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeaseCheckpoint {
    /// First fencing token (the lease's identity within its proxy).
    pub first_token: u64,
    /// Latest fencing token.
    pub token: u64,
    /// Holder.
    pub holder: String,
    /// Granted at.
    pub acquired_at_ms: u64,
    /// Expires at.
    pub expires_at_ms: u64,
    /// TTL a renewal extends by when the holder names none.
    pub ttl_ms: u64,
    /// Target domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_domain: Option<String>,
    /// Sticky-session key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_key: Option<String>,
}

/// A sticky-session binding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SessionCheckpoint {
    /// The session key.
    pub session_key: String,
    /// The bound proxy.
    pub proxy: ProxyKey,
    /// When the binding lapses.
    pub expires_at_ms: u64,
}

/// Why a checkpoint could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File system trouble.
    #[error("checkpoint file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Not a checkpoint this build understands.
    #[error("checkpoint does not decode: {0}")]
    Decode(String),
    /// A chunk limit too small for one item.
    #[error("checkpoint item of {0} bytes does not fit in a chunk")]
    ChunkTooSmall(usize),
    /// Where the checkpoint lives failed otherwise (e.g. the Kubernetes API).
    #[error("checkpoint backend: {0}")]
    Backend(String),
}

/// What one save wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Objects (files, ConfigMaps) written or deleted.
    pub objects: u64,
    /// Bytes of checkpoint data in them.
    pub bytes: u64,
}

impl std::ops::AddAssign for Written {
    fn add_assign(&mut self, other: Self) {
        self.objects += other.objects;
        self.bytes += other.bytes;
    }
}

/// Where checkpoints are kept: either as one document ([`Self::save`]) or as one part per
/// store shard ([`Self::per_shard`], [`Self::save_shard`]), so a change rewrites only the
/// parts of the shards it touched.
#[async_trait]
pub trait CheckpointStore: Send + Sync {
    /// The latest checkpoint (parts joined), or `None` if none was ever saved.
    async fn load(&self) -> Result<Option<Checkpoint>, CheckpointError>;
    /// Replaces the latest checkpoint.
    async fn save(&self, checkpoint: &Checkpoint) -> Result<Written, CheckpointError>;
    /// Whether [`maintenance`] saves with [`Self::save_shard`], one part per store shard.
    fn per_shard(&self) -> bool {
        false
    }
    /// Replaces store shard `shard`'s part (made by [`LeaseStore::checkpoint_shards`]).
    async fn save_shard(&self, shard: usize, part: &Checkpoint) -> Result<Written, CheckpointError> {
        let _ = (shard, part);
        Err(CheckpointError::Backend(
            "this checkpoint store keeps one document".to_owned(),
        ))
    }
}

/// Decodes one JSON checkpoint document, checking its version.
pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let cp: Checkpoint = serde_json::from_slice(bytes).map_err(|e| CheckpointError::Decode(e.to_string()))?;
    if cp.version != Checkpoint::VERSION {
        return Err(CheckpointError::Decode(format!(
            "version {} (this build reads {})",
            cp.version,
            Checkpoint::VERSION
        )));
    }
    Ok(cp)
}

/// Encodes one JSON checkpoint document.
pub fn encode(checkpoint: &Checkpoint) -> Vec<u8> {
    serde_json::to_vec(checkpoint).expect("a checkpoint always serializes: plain data, string map keys")
}

/// Splits a checkpoint into JSON documents of at most `max_bytes` each; each is a valid
/// checkpoint with the same header and a share of the proxies and sessions.
pub fn encode_chunks(checkpoint: &Checkpoint, max_bytes: usize) -> Result<Vec<String>, CheckpointError> {
    let header = Checkpoint {
        proxies: Vec::new(),
        sessions: Vec::new(),
        ..checkpoint.clone()
    };
    let empty = String::from_utf8(encode(&header)).expect("serde_json writes UTF-8");
    // `{"version":..,"proxies":[],"sessions":[]}`: items go between the brackets.
    let base = empty.len();
    let proxies: Vec<String> = checkpoint.proxies.iter().map(to_json).collect();
    let sessions: Vec<String> = checkpoint.sessions.iter().map(to_json).collect();
    let mut chunks: Vec<(Vec<&str>, Vec<&str>, usize)> = vec![(Vec::new(), Vec::new(), base)];
    for (item, is_proxy) in proxies
        .iter()
        .map(|p| (p, true))
        .chain(sessions.iter().map(|s| (s, false)))
    {
        let need = item.len() + 1;
        if base + need > max_bytes {
            return Err(CheckpointError::ChunkTooSmall(item.len()));
        }
        let last = chunks.last_mut().expect("chunks starts non-empty");
        if last.2 + need > max_bytes {
            chunks.push((Vec::new(), Vec::new(), base));
        }
        let last = chunks.last_mut().expect("chunks starts non-empty");
        if is_proxy {
            last.0.push(item);
        } else {
            last.1.push(item);
        }
        last.2 += need;
    }
    let prefix = empty
        .strip_suffix(r#""proxies":[],"sessions":[]}"#)
        .expect("proxies and sessions serialize last");
    Ok(chunks
        .into_iter()
        .map(|(p, s, _)| {
            format!(
                r#"{prefix}"proxies":[{}],"sessions":[{}]}}"#,
                p.join(","),
                s.join(",")
            )
        })
        .collect())
}

fn to_json<T: Serialize>(item: &T) -> String {
    serde_json::to_string(item).expect("checkpoint items always serialize: plain data")
}

/// Joins documents made by [`encode_chunks`] (in any order).
pub fn decode_chunks<S: AsRef<str>>(chunks: &[S]) -> Result<Option<Checkpoint>, CheckpointError> {
    let mut out: Option<Checkpoint> = None;
    for chunk in chunks {
        let cp = decode(chunk.as_ref().as_bytes())?;
        match out.as_mut() {
            None => out = Some(cp),
            Some(acc) => {
                if acc.saved_at_ms != cp.saved_at_ms {
                    return Err(CheckpointError::Decode(
                        "chunks come from different checkpoints".to_owned(),
                    ));
                }
                for (shard, hwm) in cp.token_hwm {
                    let have = acc.token_hwm.entry(shard).or_insert(0);
                    *have = (*have).max(hwm);
                }
                acc.proxies.extend(cp.proxies);
                acc.sessions.extend(cp.sessions);
            }
        }
    }
    Ok(out)
}

/// Standalone mode's checkpoint: one JSON file, replaced atomically.
#[derive(Clone, Debug)]
pub struct FileCheckpoint {
    path: PathBuf,
}

impl FileCheckpoint {
    /// Checkpoints kept at `path` (its folder must exist).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let tmp = path.with_extension("tmp");
        {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(bytes)?;
            file.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        // The rename is durable only once the folder is synced.
        std::fs::File::open(dir)?.sync_all()
    }
}

#[async_trait]
impl CheckpointStore for FileCheckpoint {
    async fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        match tokio::fs::read(&self.path).await {
            Ok(bytes) => decode(&bytes).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CheckpointError::Io {
                path: self.path.clone(),
                source,
            }),
        }
    }

    async fn save(&self, checkpoint: &Checkpoint) -> Result<Written, CheckpointError> {
        let bytes = encode(checkpoint);
        let written = Written {
            objects: 1,
            bytes: bytes.len() as u64,
        };
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || Self::write_atomically(&path, &bytes))
            .await
            .map_err(|e| CheckpointError::Backend(format!("writer task failed: {e}")))?
            .map_err(|source| CheckpointError::Io {
                path: self.path.clone(),
                source,
            })?;
        Ok(written)
    }
}

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
/// a per-shard store, else the whole document. A part that fails stays pending and goes out
/// with the next save. [`maintenance`] calls it every checkpoint interval; benchmarks and tests
/// drive it directly.
#[derive(Debug, Default)]
pub struct CheckpointSaver {
    shards: BTreeSet<usize>,
    whole: bool,
}

impl CheckpointSaver {
    /// Makes the next save write (the whole document for a one-document store) even if
    /// nothing changed.
    pub fn force(&mut self) {
        self.whole = true;
    }

    /// Whether the next [`Self::save`] to a one-document store writes (takes the store's
    /// dirty marks, like that save would).
    pub fn pending(&mut self, store: &LeaseStore) -> bool {
        self.whole |= store.take_dirty();
        self.whole
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
            result
        } else {
            self.whole |= store.take_dirty();
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
            });
            report.outcome(&result);
            result
        }
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

/// Leases per proxy (`namespace/name`) in the checkpoint file at `path`, for `status`; an
/// absent or unreadable file counts as no leases. Leases that had expired when it was saved are
/// not counted.
pub fn active_leases_by_proxy(path: &Path) -> BTreeMap<String, u32> {
    let Ok(bytes) = std::fs::read(path) else {
        return BTreeMap::new();
    };
    let Ok(checkpoint) = decode(&bytes) else {
        return BTreeMap::new();
    };
    checkpoint
        .proxies
        .iter()
        .map(|p| {
            let live = p
                .leases
                .iter()
                .filter(|l| l.expires_at_ms > checkpoint.saved_at_ms)
                .count();
            (p.key.to_string(), u32::try_from(live).unwrap_or(u32::MAX))
        })
        .collect()
}
