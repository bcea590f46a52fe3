//! Standalone mode's lease journal: acquires, renewals and releases are made durable before
//! they are answered, so a crash at any instant loses no answered lease operation.
//!
//! It owns the append-only log in the state folder (segment files `leases.journal.<first
//! sequence>`), the one writer thread that commits it, and recovery (snapshot + log replay).
//!
//! - **Group commit.** A handler applies its operation to the [`LeaseStore`], then appends
//!   what changed ([`Record`]) with [`Journal::append`], which numbers it (a sequence number)
//!   and returns a [`Commit`] to await before answering. The writer thread takes everything
//!   appended so far (optionally after waiting up to [`JournalConfig::window`] for more, or until
//!   [`JournalConfig::max_batch`] records), writes it and `fdatasync`s once for the whole batch;
//!   what arrives during a sync makes the next batch (a sync takes 0.1 to 1 ms here).
//!   A failed write or sync fails every record of its batch (the handlers answer 503, never
//!   200); the next batch goes to a fresh segment, and while failing, the writer retries an
//!   empty segment every second and lease operations are refused up front ([`Journal::failing`]).
//! - **Compaction.** [`compaction`] snapshots the store once a second (if anything changed)
//!   into the checkpoint file, recording the last record `S` appended before the snapshot was
//!   read ([`Checkpoint::journal_seq`]; every record up to `S` was applied to the store before
//!   it was appended), then deletes the segments holding only records up to `S`, closing the
//!   open one once it is large. A crash between the two leaves records the snapshot already
//!   holds: replay skips every record up to the snapshot's `S`.
//! - **Sync cost.** Records overwrite zeros written ahead of them, so a sync flushes data only
//!   (see [`Segment`]).
//! - **Replay is idempotent.** Records after `S` may also be in the snapshot (an
//!   operation applied before the snapshot, appended after the rotation); each record merges
//!   into the state (an acquire adds a lease it does not find, a renewal keeps the newer token,
//!   a release removes the lease), and the records of one lease are in causal order in the log:
//!   a renewal or release presents a token its holder only had once the earlier record was
//!   committed.
//! - **Frames.** `len: u32 LE | crc32(seq ++ payload): u32 LE | seq: u64 LE | payload (JSON)`.
//!   A torn or corrupt frame ends its segment's replay, with a log line; it was never committed,
//!   so nobody was told about it.

use std::{
    collections::{BTreeMap, VecDeque},
    fs::{File, OpenOptions},
    future::Future,
    io::Read,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use prometheus_client::{
    metrics::{
        counter::Counter,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::{
    LeaseStore, MAX_SHARDS, ProxyKey,
    checkpoint::{
        BanCheckpoint, Checkpoint, CheckpointAdmission, CheckpointReport, CheckpointSaver, FileCheckpoint,
        LeaseCheckpoint, ProxyCheckpoint, SessionCheckpoint,
    },
};

/// Segment files are `leases.journal.<first sequence, 20 digits>` in the journal's folder.
pub const SEGMENT_PREFIX: &str = "leases.journal.";

const FRAME_HEADER: usize = 16;
/// No record comes near this; a larger length is a corrupt frame.
const MAX_RECORD: usize = 1 << 20;

/// One lease operation as the journal keeps it: what changed in the store, enough to redo it
/// on a snapshot. Holds no secrets (no lease IDs, no credentials).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    deny_unknown_fields
)]
pub enum Record {
    /// A lease was granted (or reinstated from its signed ID).
    Acquire {
        /// The proxy.
        key: ProxyKey,
        /// The lease's first fencing token (its identity within the proxy).
        first_token: u64,
        /// Its current token.
        token: u64,
        /// Holder.
        holder: String,
        /// Granted at (ms since the epoch).
        acquired_at_ms: u64,
        /// Expires at.
        expires_at_ms: u64,
        /// The TTL a renewal without one extends by.
        ttl_ms: u64,
        /// Target domain.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target_domain: Option<String>,
        /// Sticky-session key and when its binding lapses.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session: Option<(String, u64)>,
    },
    /// A lease was renewed.
    Renew {
        /// The proxy.
        key: ProxyKey,
        /// The lease.
        first_token: u64,
        /// Its new token.
        token: u64,
        /// Its new expiry.
        expires_at_ms: u64,
    },
    /// A lease was released.
    Release {
        /// The proxy.
        key: ProxyKey,
        /// The lease.
        first_token: u64,
        /// The proxy's cooldown end after the release, if resting.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cooldown_until_ms: Option<u64>,
        /// The domain ban a `banned` outcome started.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ban: Option<BanCheckpoint>,
    },
}

impl Record {
    /// The record of a granted lease.
    pub fn acquired(lease: &super::Lease, claim: &super::LeaseClaim, session_idle: Duration) -> Self {
        Record::Acquire {
            key: lease.id.key.clone(),
            first_token: lease.id.first_token,
            token: lease.fencing_token,
            holder: claim.holder.clone(),
            acquired_at_ms: lease.acquired_at_ms,
            expires_at_ms: lease.expires_at_ms,
            ttl_ms: lease.expires_at_ms.saturating_sub(lease.acquired_at_ms).max(1),
            target_domain: claim.target_domain.clone(),
            session: claim
                .session_key
                .clone()
                .map(|k| (k, lease.expires_at_ms + session_idle.as_millis() as u64)),
        }
    }

    /// The record of a lease reinstated from its signed claim with `token`.
    pub fn reinstated(claim: &super::LeaseClaim, token: u64) -> Self {
        Record::Acquire {
            key: claim.id.key.clone(),
            first_token: claim.id.first_token,
            token,
            holder: claim.holder.clone(),
            acquired_at_ms: claim.acquired_at_ms,
            expires_at_ms: claim.expires_at_ms,
            ttl_ms: claim.expires_at_ms.saturating_sub(claim.acquired_at_ms).max(1),
            target_domain: claim.target_domain.clone(),
            session: None,
        }
    }

    fn tokens(&self) -> [u64; 2] {
        match self {
            Record::Acquire {
                first_token, token, ..
            } => [*first_token, *token],
            Record::Renew {
                first_token, token, ..
            } => [*first_token, *token],
            Record::Release { first_token, .. } => [*first_token, *first_token],
        }
    }

    fn key(&self) -> &ProxyKey {
        match self {
            Record::Acquire { key, .. } | Record::Renew { key, .. } | Record::Release { key, .. } => key,
        }
    }
}

/// Why the journal could not recover, write or sync.
#[derive(Clone, Debug, thiserror::Error)]
pub enum JournalError {
    /// File system trouble (the message names the file).
    #[error("lease journal {path}: {message}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// The writer thread is gone (the journal was closed).
    #[error("the lease journal is closed")]
    Closed,
    /// An earlier write failed and the journal has not recovered yet.
    #[error("the lease journal is failing: {0}")]
    Failing(String),
}

impl JournalError {
    fn io(path: &Path, error: &std::io::Error) -> Self {
        JournalError::Io {
            path: path.to_owned(),
            message: error.to_string(),
        }
    }
}

/// Settings of the writer.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// The folder of the segment files (standalone mode: the state folder).
    pub dir: PathBuf,
    /// How long the writer waits for more records after the first one of a batch before it
    /// writes and syncs. Zero (the default): at once, and the records that arrive during a
    /// sync make the next batch, so batches grow with the load by themselves. A window adds
    /// itself to every operation's latency, which caps a client with `n` connections at
    /// `n / window` operations a second (benches/wrk.sh: 16 connections, 1 ms: 13k/s).
    pub window: Duration,
    /// A batch this large is written without waiting out the window.
    pub max_batch: usize,
}

impl JournalConfig {
    /// The defaults for segments in `dir`: no window, batches of at most 1024 records.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            window: Duration::ZERO,
            max_batch: 1024,
        }
    }
}

/// Commit metrics: batch sizes, sync latency, failures. Clones share their values.
#[derive(Clone, Debug)]
pub struct JournalMetrics {
    batch_records: Histogram,
    fsync_seconds: Histogram,
    failures: Counter,
    records: Counter,
    /// [`Self::totals`]' (not exported: the histogram has them).
    syncs: Counter,
    sync_micros: Counter,
}

impl Default for JournalMetrics {
    fn default() -> Self {
        Self {
            batch_records: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            fsync_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 14)),
            failures: Counter::default(),
            records: Counter::default(),
            syncs: Counter::default(),
            sync_micros: Counter::default(),
        }
    }
}

impl JournalMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "epo_lease_journal_commit_batch_records",
            "Lease operations committed together by one journal sync (group commit)",
            self.batch_records.clone(),
        );
        registry.register(
            "epo_lease_journal_fsync_seconds",
            "Time to write and fdatasync one lease journal batch",
            self.fsync_seconds.clone(),
        );
        registry.register(
            "epo_lease_journal_failures",
            "Lease journal writes or syncs that failed (their operations were answered 503)",
            self.failures.clone(),
        );
        registry.register(
            "epo_lease_journal_records",
            "Lease operations committed to the journal",
            self.records.clone(),
        );
    }

    /// Failed batches so far.
    pub fn failures(&self) -> u64 {
        self.failures.get()
    }

    /// Records committed, batches committed and the seconds their syncs took, so far.
    pub fn totals(&self) -> (u64, u64, f64) {
        (
            self.records.get(),
            self.syncs.get(),
            self.sync_micros.get() as f64 / 1e6,
        )
    }
}

type Waiter = oneshot::Sender<Result<(), JournalError>>;

enum Item {
    /// Consecutive records and whom to tell when they are durable.
    Records {
        first_seq: u64,
        payloads: Vec<Vec<u8>>,
        waiters: Vec<Waiter>,
    },
    /// Close the current segment once everything before is durable.
    Rotate(Waiter),
}

#[derive(Default)]
struct Queue {
    next_seq: u64,
    items: VecDeque<Item>,
    records: usize,
    first_at: Option<Instant>,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// [`JournalConfig::max_batch`].
    max_batch: usize,
    wake: Condvar,
    failing: AtomicBool,
    /// Bytes written to the open segment.
    segment_bytes: AtomicU64,
    last_error: Mutex<Option<String>>,
    last_durable: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding it leaves plain data; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The journal's writer handle; cheap to clone. Dropping the last clone does not stop the
/// writer: [`Journal::close`] does (after writing what was appended).
#[derive(Clone)]
pub struct Journal {
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("failing", &self.failing())
            .finish_non_exhaustive()
    }
}

/// Awaited by a handler before it answers: resolves once its record is durable.
#[must_use = "an operation is durable only once its commit resolves"]
pub struct Commit(oneshot::Receiver<Result<(), JournalError>>);

impl Commit {
    /// Waits until the record is synced (or its batch failed).
    pub async fn wait(self) -> Result<(), JournalError> {
        self.0.await.unwrap_or(Err(JournalError::Closed))
    }
}

impl Journal {
    /// Starts the writer; the first record gets sequence `next_seq` (one past the last
    /// recovered: [`Recovered::last_seq`]).
    pub fn start(
        config: JournalConfig,
        next_seq: u64,
        metrics: JournalMetrics,
    ) -> Result<Self, JournalError> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                next_seq: next_seq.max(1),
                ..Queue::default()
            }),
            max_batch: config.max_batch.max(1),
            wake: Condvar::new(),
            failing: AtomicBool::new(false),
            segment_bytes: AtomicU64::new(0),
            last_error: Mutex::new(None),
            last_durable: AtomicU64::new(next_seq.saturating_sub(1)),
        });
        let writer = Writer {
            shared: shared.clone(),
            config,
            metrics,
            file: None,
        };
        let thread = std::thread::Builder::new()
            .name("lease-journal".into())
            .spawn(move || writer.run())
            .map_err(|e| JournalError::io(Path::new("lease-journal thread"), &e))?;
        Ok(Self {
            shared,
            thread: Arc::new(Mutex::new(Some(thread))),
        })
    }

    /// Numbers `record` and queues it for the next commit. Call it after the store applied
    /// the operation (so a snapshot taken after a rotation holds every record up to it).
    pub fn append(&self, record: &Record) -> Commit {
        let payload =
            serde_json::to_vec(record).expect("journal records are plain data and always serialize");
        let (tx, rx) = oneshot::channel();
        let mut q = lock(&self.shared.queue);
        if q.closed {
            let _ = tx.send(Err(JournalError::Closed));
            return Commit(rx);
        }
        let seq = q.next_seq;
        q.next_seq += 1;
        q.records += 1;
        if q.first_at.is_none() {
            q.first_at = Some(Instant::now());
        }
        match q.items.back_mut() {
            Some(Item::Records {
                payloads, waiters, ..
            }) => {
                payloads.push(payload);
                waiters.push(tx);
            }
            _ => q.items.push_back(Item::Records {
                first_seq: seq,
                payloads: vec![payload],
                waiters: vec![tx],
            }),
        }
        // The writer needs waking for a batch's first record (it waits for work) and a full
        // batch (it waits out the window); waking it for every record costs a context switch each.
        let wake = q.records == 1 || q.records >= self.shared.max_batch;
        drop(q);
        if wake {
            self.shared.wake.notify_one();
        }
        Commit(rx)
    }

    /// Closes the current segment: returns `S` once every record numbered up to `S` (all that
    /// were appended before this call) is durable in closed segments; later records go to new
    /// ones.
    pub async fn rotate(&self) -> Result<u64, JournalError> {
        let (tx, rx) = oneshot::channel();
        let through = {
            let mut q = lock(&self.shared.queue);
            if q.closed {
                return Err(JournalError::Closed);
            }
            q.items.push_back(Item::Rotate(tx));
            q.next_seq - 1
        };
        self.shared.wake.notify_one();
        rx.await.unwrap_or(Err(JournalError::Closed))?;
        Ok(through)
    }

    /// The highest sequence number handed out so far.
    pub fn last_appended(&self) -> u64 {
        lock(&self.shared.queue).next_seq - 1
    }

    /// Whether the last write failed and the writer has not recovered since: lease operations
    /// are refused, `/readyz` says why.
    pub fn failing(&self) -> Option<String> {
        if !self.shared.failing.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.shared.last_error).clone()
    }

    /// Writes and syncs what was appended, then stops the writer.
    pub fn close(&self) {
        lock(&self.shared.queue).closed = true;
        self.shared.wake.notify_one();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
    }

    /// Bytes written to the open segment.
    pub fn segment_bytes(&self) -> u64 {
        self.shared.segment_bytes.load(Ordering::Relaxed)
    }

    /// Deletes the segments whose records are all numbered up to `through` (they are in a
    /// saved snapshot): those followed by a segment starting at `through + 1` or before. The
    /// last one stays (it may be the open one). Returns how many.
    pub fn remove_covered(dir: &Path, through: u64) -> usize {
        let all = segments(dir);
        all.windows(2)
            .filter(|pair| pair[1].0 <= through + 1)
            .filter(|pair| std::fs::remove_file(&pair[0].1).is_ok())
            .count()
    }

    /// Deletes every segment (all replayed into a saved snapshot, at start); returns how many.
    fn remove_all(dir: &Path) -> usize {
        segments(dir)
            .into_iter()
            .filter(|(_, path)| std::fs::remove_file(path).is_ok())
            .count()
    }
}

struct Writer {
    shared: Arc<Shared>,
    config: JournalConfig,
    metrics: JournalMetrics,
    /// The open segment.
    file: Option<Segment>,
}

/// An open segment: records are written at `pos` over zeros written ahead up to `zeroed`, so
/// a sync flushes data only (appending would change the file size, and `fdatasync` would then
/// wait for a file-system journal commit too: ten times slower here under other writers).
struct Segment {
    file: File,
    path: PathBuf,
    pos: u64,
    zeroed: u64,
    /// The next zero-fill's size: doubles from [`ZERO_AHEAD_MIN`] to [`ZERO_AHEAD_MAX`], so a
    /// quiet journal writes little ahead.
    ahead: u64,
}

const ZERO_AHEAD_MIN: u64 = 64 * 1024;
const ZERO_AHEAD_MAX: u64 = 4 * 1024 * 1024;
/// Past this many bytes, [`compaction`] closes the segment, so covered ones can be deleted.
const SEGMENT_BYTES: u64 = 32 * 1024 * 1024;

/// Encoded frames not yet written, and the sequence of the first.
#[derive(Default)]
struct Pending {
    frames: Vec<u8>,
    first_seq: u64,
    last_seq: u64,
    records: usize,
    waiters: Vec<Waiter>,
}

impl Writer {
    fn run(mut self) {
        let mut pending = Pending::default();
        loop {
            let Some(items) = self.next_batch() else { break };
            for item in items {
                match item {
                    Item::Records {
                        first_seq,
                        payloads,
                        waiters,
                    } => {
                        if pending.records == 0 {
                            pending.first_seq = first_seq;
                        }
                        for (i, payload) in payloads.iter().enumerate() {
                            let seq = first_seq + i as u64;
                            encode_frame(&mut pending.frames, seq, payload);
                            pending.last_seq = seq;
                        }
                        pending.records += payloads.len();
                        pending.waiters.extend(waiters);
                    }
                    Item::Rotate(done) => {
                        let result = self.commit(&mut pending);
                        // The next record opens a new segment.
                        self.file = None;
                        let _ = done.send(result);
                    }
                }
            }
            let _ = self.commit(&mut pending);
        }
    }

    /// Waits for work and takes it, after the group-commit window; `None` once closed and
    /// drained.
    fn next_batch(&mut self) -> Option<VecDeque<Item>> {
        let mut q = lock(&self.shared.queue);
        while q.items.is_empty() && !q.closed {
            if self.shared.failing.load(Ordering::Acquire) {
                // Idle while failing: try a fresh segment every second.
                q = self
                    .shared
                    .wake
                    .wait_timeout(q, Duration::from_secs(1))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                if q.items.is_empty() && !q.closed {
                    let next = q.next_seq;
                    drop(q);
                    self.probe(next);
                    q = lock(&self.shared.queue);
                }
            } else {
                q = self.shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        }
        if q.items.is_empty() {
            return None;
        }
        // Group commit: give concurrent handlers the window to join this batch.
        if let Some(first) = q.first_at {
            let deadline = first + self.config.window;
            while !q.closed
                && q.records < self.config.max_batch
                && !matches!(q.items.back(), Some(Item::Rotate(_)))
            {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                q = self
                    .shared
                    .wake
                    .wait_timeout(q, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        q.records = 0;
        q.first_at = None;
        Some(std::mem::take(&mut q.items))
    }

    /// Writes and syncs the pending frames and tells their waiters.
    fn commit(&mut self, pending: &mut Pending) -> Result<(), JournalError> {
        if pending.records == 0 {
            return Ok(());
        }
        let started = Instant::now();
        let result = self.write_sync(&pending.frames, pending.first_seq);
        match &result {
            Ok(()) => {
                let took = started.elapsed();
                self.metrics.fsync_seconds.observe(took.as_secs_f64());
                self.metrics.syncs.inc();
                self.metrics.sync_micros.inc_by(took.as_micros() as u64);
                self.metrics.batch_records.observe(pending.records as f64);
                self.metrics.records.inc_by(pending.records as u64);
                self.shared
                    .last_durable
                    .store(pending.last_seq, Ordering::Release);
                self.recovered();
            }
            Err(error) => self.failed(error),
        }
        for waiter in pending.waiters.drain(..) {
            let _ = waiter.send(result.clone());
        }
        pending.frames.clear();
        pending.records = 0;
        result
    }

    fn write_sync(&mut self, frames: &[u8], first_seq: u64) -> Result<(), JournalError> {
        use std::os::unix::fs::FileExt;
        if self.file.is_none() {
            self.file = Some(self.open_segment(first_seq)?);
        }
        let seg = self.file.as_mut().expect("opened above");
        let end = seg.pos + frames.len() as u64;
        let result = (|| {
            if end > seg.zeroed {
                let to = end.max(seg.zeroed + seg.ahead);
                seg.file
                    .write_all_at(&vec![0u8; (to - seg.zeroed) as usize], seg.zeroed)?;
                seg.zeroed = to;
                seg.ahead = (seg.ahead * 2).min(ZERO_AHEAD_MAX);
            }
            seg.file.write_all_at(frames, seg.pos)?;
            seg.file.sync_data()
        })();
        result.map_err(|e| JournalError::io(&seg.path, &e))?;
        seg.pos = end;
        self.shared.segment_bytes.store(end, Ordering::Relaxed);
        Ok(())
    }

    /// Creates segment `first_seq` (emptying a file of that name: nothing in it was
    /// acknowledged, since record numbers only grow) and makes its name durable.
    fn open_segment(&self, first_seq: u64) -> Result<Segment, JournalError> {
        let path = segment_path(&self.config.dir, first_seq);
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| JournalError::io(&path, &e))?;
        File::open(&self.config.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| JournalError::io(&self.config.dir, &e))?;
        self.shared.segment_bytes.store(0, Ordering::Relaxed);
        Ok(Segment {
            file,
            path,
            pos: 0,
            zeroed: 0,
            ahead: ZERO_AHEAD_MIN,
        })
    }

    fn probe(&mut self, next_seq: u64) {
        match self.open_segment(next_seq).and_then(|seg| {
            seg.file
                .sync_data()
                .map_err(|e| JournalError::io(&seg.path, &e))?;
            Ok(seg)
        }) {
            Ok(open) => {
                self.file = Some(open);
                self.recovered();
            }
            Err(error) => self.failed(&error),
        }
    }

    fn failed(&mut self, error: &JournalError) {
        self.metrics.failures.inc();
        // Whatever the failed segment holds now, later batches go to a fresh one.
        self.file = None;
        if !self.shared.failing.swap(true, Ordering::AcqRel) {
            tracing::error!(%error, "the lease journal failed: lease operations are refused (503) until it recovers");
        }
        *lock(&self.shared.last_error) = Some(error.to_string());
    }

    fn recovered(&self) {
        if self.shared.failing.swap(false, Ordering::AcqRel) {
            tracing::info!("the lease journal recovered");
        }
    }
}

fn segment_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{SEGMENT_PREFIX}{first_seq:020}"))
}

/// The segment files in `dir`, by first sequence.
fn segments(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        // Regular files only: a symlink or device is nothing this journal wrote.
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            let name = e.file_name();
            let first = name.to_str()?.strip_prefix(SEGMENT_PREFIX)?.parse().ok()?;
            Some((first, e.path()))
        })
        .collect();
    out.sort();
    out
}

fn encode_frame(out: &mut Vec<u8>, seq: u64, payload: &[u8]) {
    let seq = seq.to_le_bytes();
    let crc = crc32(crc32_update(CRC_INIT, &seq), payload);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&seq);
    out.extend_from_slice(payload);
}

/// The records of one segment, in order, and whether it ended in a torn or corrupt frame.
fn read_segment(path: &Path) -> Result<(Vec<(u64, Record)>, bool), JournalError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| JournalError::io(path, &e))?;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        // Zeros written ahead: the clean end of the segment.
        if bytes[at..].iter().all(|b| *b == 0) {
            break;
        }
        let Some(header) = bytes.get(at..at + FRAME_HEADER) else {
            return Ok((out, true));
        };
        let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let seq_bytes: [u8; 8] = header[8..16].try_into().expect("8 bytes");
        let Some(payload) = (len <= MAX_RECORD)
            .then(|| bytes.get(at + FRAME_HEADER..at + FRAME_HEADER + len))
            .flatten()
        else {
            return Ok((out, true));
        };
        if crc32(crc32_update(CRC_INIT, &seq_bytes), payload) != crc {
            return Ok((out, true));
        }
        let Ok(record) = serde_json::from_slice::<Record>(payload) else {
            return Ok((out, true));
        };
        out.push((u64::from_le_bytes(seq_bytes), record));
        at += FRAME_HEADER + len;
    }
    Ok((out, false))
}

const CRC_INIT: u32 = 0xFFFF_FFFF;

const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

fn crc32_update(mut crc: u32, bytes: &[u8]) -> u32 {
    for &b in bytes {
        crc = CRC_TABLE[((crc ^ b as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    crc
}

/// CRC-32 (IEEE) of everything fed since [`CRC_INIT`], finishing with `bytes`.
fn crc32(crc: u32, bytes: &[u8]) -> u32 {
    !crc32_update(crc, bytes)
}

/// A snapshot with the log replayed onto it.
#[derive(Debug)]
pub struct Recovered {
    /// The state to [`LeaseStore::restore`] (its [`Checkpoint::journal_seq`] is `last_seq`).
    pub checkpoint: Checkpoint,
    /// The last sequence number in the snapshot or the log.
    pub last_seq: u64,
    /// Records replayed onto the snapshot.
    pub replayed: usize,
    /// Segments that ended in a torn or corrupt frame (ignored from there).
    pub torn: usize,
    /// Whether the state is exact: there was no snapshot, or one written with the journal on
    /// (a snapshot from a run without it may hold leases released in its last second).
    pub exact: bool,
}

/// Replays the segments in `dir` onto `snapshot` (records it already holds are skipped).
pub fn recover(dir: &Path, snapshot: Option<Checkpoint>) -> Result<Recovered, JournalError> {
    let mut cp = snapshot.unwrap_or_else(|| Checkpoint {
        version: Checkpoint::VERSION,
        ..Checkpoint::default()
    });
    let exact = cp.journal_seq.is_some() || (cp.proxies.is_empty() && cp.sessions.is_empty());
    let from = cp.journal_seq.unwrap_or(0);
    let mut last_seq = from;
    let mut replay = Replay::new(&mut cp);
    let mut replayed = 0;
    let mut torn = 0;
    for (_, path) in segments(dir) {
        let (records, torn_tail) = read_segment(&path)?;
        if torn_tail {
            torn += 1;
            tracing::warn!(
                segment = %path.display(),
                "lease journal segment ends in a torn or corrupt record: ignored from there (it was never acknowledged)"
            );
        }
        for (seq, record) in records {
            if seq <= from {
                continue;
            }
            last_seq = last_seq.max(seq);
            replay.apply(&record);
            replayed += 1;
        }
    }
    replay.finish();
    cp.journal_seq = Some(last_seq);
    Ok(Recovered {
        checkpoint: cp,
        last_seq,
        replayed,
        torn,
        exact,
    })
}

/// Active leases per proxy (`namespace/name`) in the state folder `state`: its checkpoint file
/// `checkpoint` with the journal replayed onto it, read-only (for `status`, while the operator
/// may run). Unreadable parts count as no leases; leases past their expiry are not counted.
pub fn active_leases_by_proxy(state: &Path, checkpoint: &Path) -> BTreeMap<String, u32> {
    let snapshot = std::fs::read(checkpoint)
        .ok()
        .and_then(|bytes| super::checkpoint::decode(&bytes).ok());
    let Ok(recovered) = recover(state, snapshot) else {
        return BTreeMap::new();
    };
    let now = super::Clock::System.now_ms();
    recovered
        .checkpoint
        .proxies
        .iter()
        .map(|p| {
            let live = p.leases.iter().filter(|l| l.expires_at_ms > now).count();
            (p.key.to_string(), u32::try_from(live).unwrap_or(u32::MAX))
        })
        .collect()
}

/// Applies records to a checkpoint, indexed by proxy and session.
struct Replay<'a> {
    cp: &'a mut Checkpoint,
    proxies: BTreeMap<ProxyKey, ProxyCheckpoint>,
    sessions: BTreeMap<String, SessionCheckpoint>,
}

impl<'a> Replay<'a> {
    fn new(cp: &'a mut Checkpoint) -> Self {
        let proxies = std::mem::take(&mut cp.proxies)
            .into_iter()
            .map(|p| (p.key.clone(), p))
            .collect();
        let sessions = std::mem::take(&mut cp.sessions)
            .into_iter()
            .map(|s| (s.session_key.clone(), s))
            .collect();
        Self {
            cp,
            proxies,
            sessions,
        }
    }

    fn apply(&mut self, record: &Record) {
        for token in record.tokens() {
            let shard = (token & (MAX_SHARDS as u64 - 1)) as u16;
            let hwm = self.cp.token_hwm.entry(shard).or_insert(0);
            *hwm = (*hwm).max(token);
        }
        let proxy = self
            .proxies
            .entry(record.key().clone())
            .or_insert_with(|| ProxyCheckpoint {
                key: record.key().clone(),
                admission: CheckpointAdmission::Closed,
                cooldown_until_ms: None,
                revoked_below: 0,
                bans: Vec::new(),
                leases: Vec::new(),
            });
        match record {
            Record::Acquire {
                key,
                first_token,
                token,
                holder,
                acquired_at_ms,
                expires_at_ms,
                ttl_ms,
                target_domain,
                session,
            } => {
                if *first_token >= proxy.revoked_below
                    && !proxy.leases.iter().any(|l| l.first_token == *first_token)
                {
                    proxy.leases.push(LeaseCheckpoint {
                        first_token: *first_token,
                        token: *token,
                        holder: holder.clone(),
                        acquired_at_ms: *acquired_at_ms,
                        expires_at_ms: *expires_at_ms,
                        ttl_ms: *ttl_ms,
                        target_domain: target_domain.clone(),
                        session_key: session.as_ref().map(|(k, _)| k.clone()),
                    });
                }
                if let Some((session_key, until)) = session {
                    let binding =
                        self.sessions
                            .entry(session_key.clone())
                            .or_insert_with(|| SessionCheckpoint {
                                session_key: session_key.clone(),
                                proxy: key.clone(),
                                expires_at_ms: 0,
                            });
                    if *until >= binding.expires_at_ms {
                        binding.proxy = key.clone();
                        binding.expires_at_ms = *until;
                    }
                }
            }
            Record::Renew {
                first_token,
                token,
                expires_at_ms,
                ..
            } => {
                if let Some(lease) = proxy.leases.iter_mut().find(|l| l.first_token == *first_token)
                    && *token > lease.token
                {
                    lease.token = *token;
                    lease.expires_at_ms = *expires_at_ms;
                }
            }
            Record::Release {
                first_token,
                cooldown_until_ms,
                ban,
                ..
            } => {
                proxy.leases.retain(|l| l.first_token != *first_token);
                if let Some(until) = cooldown_until_ms {
                    proxy.cooldown_until_ms = Some(proxy.cooldown_until_ms.unwrap_or(0).max(*until));
                }
                if let Some(ban) = ban {
                    proxy.bans.retain(|b| b.domain != ban.domain);
                    proxy.bans.push(ban.clone());
                }
            }
        }
    }

    fn finish(self) {
        self.cp.proxies = self.proxies.into_values().collect();
        self.cp.sessions = self.sessions.into_values().collect();
    }
}

/// Standalone start-up: loads the snapshot at `file`, replays the log in `dir` onto it, saves
/// the result as the new snapshot and deletes the replayed segments, so the log starts afresh
/// at [`Recovered::last_seq`] + 1. Runs with durability off too: then the log, if any, is left
/// from an earlier durable run and its answered operations must not be lost either.
pub async fn recover_and_compact(dir: &Path, file: &FileCheckpoint) -> Result<Recovered, JournalError> {
    use super::checkpoint::CheckpointStore;
    let snapshot = match file.load().await {
        Ok(snapshot) => snapshot,
        Err(error) => {
            tracing::warn!(%error, "lease checkpoint unreadable; starting from the journal alone");
            None
        }
    };
    let had_segments = !segments(dir).is_empty();
    let recovered = recover(dir, snapshot)?;
    if had_segments {
        file.save(&recovered.checkpoint)
            .await
            .map_err(|e| JournalError::Io {
                path: file.path().to_owned(),
                message: e.to_string(),
            })?;
        Journal::remove_all(dir);
    }
    Ok(recovered)
}

/// Durable mode's checkpointing: every `interval` in which anything changed, snapshots the
/// store into `file`, stamped with the last record appended before it was read (every record
/// up to it was applied to the store first), then deletes the segments the snapshot covers
/// (closing the open one past [`SEGMENT_BYTES`]); a last one when `shutdown` completes, then
/// closes the journal. Saves are counted and failures reported through `report` (like
/// [`super::maintenance`]'s, which then runs without a checkpoint sink, reaping only).
pub async fn compaction(
    store: LeaseStore,
    journal: Journal,
    file: FileCheckpoint,
    dir: PathBuf,
    interval: Duration,
    report: CheckpointReport,
    shutdown: impl Future<Output = ()>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut saver = CheckpointSaver::default();
    let mut compacted = journal.last_appended();
    tokio::pin!(shutdown);
    loop {
        let last = tokio::select! {
            _ = &mut shutdown => true,
            _ = tick.tick() => false,
        };
        if last || journal.last_appended() > compacted {
            saver.force();
        }
        if saver.pending(&store) {
            let through = journal.last_appended();
            let sink = Sequenced {
                file: &file,
                journal_seq: through,
            };
            match saver.save(&store, &sink, &report).await {
                Ok(()) => {
                    if journal.segment_bytes() >= SEGMENT_BYTES
                        && let Err(error) = journal.rotate().await
                    {
                        tracing::warn!(%error, "closing a lease journal segment failed");
                    }
                    Journal::remove_covered(&dir, through);
                    compacted = through;
                }
                Err(error) => tracing::warn!(%error, "saving the lease checkpoint failed; retrying"),
            }
        }
        if last {
            // Joins the writer thread: off the async workers.
            let _ = tokio::task::spawn_blocking(move || journal.close()).await;
            return;
        }
    }
}

/// The file checkpoint, stamping each snapshot with the journal sequence it holds.
struct Sequenced<'a> {
    file: &'a FileCheckpoint,
    journal_seq: u64,
}

#[async_trait::async_trait]
impl super::checkpoint::CheckpointStore for Sequenced<'_> {
    async fn load(&self) -> Result<Option<Checkpoint>, super::checkpoint::CheckpointError> {
        self.file.load().await
    }

    async fn save(
        &self,
        checkpoint: &Checkpoint,
    ) -> Result<super::checkpoint::Written, super::checkpoint::CheckpointError> {
        let stamped = Checkpoint {
            journal_seq: Some(self.journal_seq),
            ..checkpoint.clone()
        };
        self.file.save(&stamped).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ProxyKey {
        ProxyKey::new("crawl", name)
    }

    fn acquire(name: &str, first: u64, expires: u64) -> Record {
        Record::Acquire {
            key: key(name),
            first_token: first,
            token: first,
            holder: "c1".into(),
            acquired_at_ms: 1_000,
            expires_at_ms: expires,
            ttl_ms: expires - 1_000,
            target_domain: Some("example.com".into()),
            session: Some(("s1".into(), expires + 60_000)),
        }
    }

    fn renew(name: &str, first: u64, token: u64, expires: u64) -> Record {
        Record::Renew {
            key: key(name),
            first_token: first,
            token,
            expires_at_ms: expires,
        }
    }

    fn release(name: &str, first: u64) -> Record {
        Record::Release {
            key: key(name),
            first_token: first,
            cooldown_until_ms: Some(5_000),
            ban: Some(BanCheckpoint {
                domain: "example.com".into(),
                until_ms: 9_000,
            }),
        }
    }

    fn leases(cp: &Checkpoint) -> Vec<(String, u64, u64, u64)> {
        cp.proxies
            .iter()
            .flat_map(|p| {
                p.leases
                    .iter()
                    .map(|l| (p.key.to_string(), l.first_token, l.token, l.expires_at_ms))
            })
            .collect()
    }

    async fn write_all(dir: &Path, next_seq: u64, records: &[Record]) -> Journal {
        let journal = Journal::start(JournalConfig::new(dir), next_seq, JournalMetrics::default()).unwrap();
        let commits: Vec<Commit> = records.iter().map(|r| journal.append(r)).collect();
        for commit in commits {
            commit.wait().await.unwrap();
        }
        journal
    }

    #[tokio::test]
    async fn committed_records_replay_onto_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let journal = write_all(
            dir.path(),
            1,
            &[
                acquire("a", 33, 90_000),
                acquire("b", 65, 90_000),
                renew("a", 33, 97, 120_000),
                release("b", 65),
            ],
        )
        .await;
        journal.close();
        let r = recover(dir.path(), None).unwrap();
        assert_eq!((r.last_seq, r.replayed, r.torn), (4, 4, 0));
        assert_eq!(leases(&r.checkpoint), [("crawl/a".to_owned(), 33, 97, 120_000)]);
        let b = r.checkpoint.proxies.iter().find(|p| p.key == key("b")).unwrap();
        assert_eq!(b.cooldown_until_ms, Some(5_000));
        assert_eq!(b.bans.len(), 1);
        assert_eq!(
            r.checkpoint.sessions.len(),
            1,
            "the binding of the sticky acquire"
        );
        // Every token replayed bounds the next ones: shard 1 issued 33, 65 and 97.
        assert_eq!(r.checkpoint.token_hwm.get(&1), Some(&97));
        assert_eq!(r.checkpoint.journal_seq, Some(4));
        assert!(r.exact, "no snapshot: the journal is the whole state");
        // A snapshot written without the journal may be a second behind: not exact.
        let plain = Checkpoint {
            journal_seq: None,
            ..r.checkpoint.clone()
        };
        assert!(!recover(dir.path(), Some(plain)).unwrap().exact);
        assert!(recover(dir.path(), Some(r.checkpoint)).unwrap().exact);
    }

    #[tokio::test]
    async fn a_torn_last_record_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let journal = write_all(dir.path(), 1, &[acquire("a", 33, 90_000), release("a", 33)]).await;
        journal.close();
        let (_, path) = segments(dir.path()).pop().unwrap();
        let whole = std::fs::read(&path).unwrap();
        // Cut the release in half, as a crash during its write would.
        let mut frames = Vec::new();
        encode_frame(
            &mut frames,
            1,
            &serde_json::to_vec(&acquire("a", 33, 90_000)).unwrap(),
        );
        std::fs::write(&path, &whole[..frames.len() + 20]).unwrap();
        let r = recover(dir.path(), None).unwrap();
        assert_eq!((r.replayed, r.torn), (1, 1));
        assert_eq!(leases(&r.checkpoint).len(), 1);
        // A flipped bit is as torn as a cut.
        let mut corrupt = whole.clone();
        corrupt[frames.len() + FRAME_HEADER + 5] ^= 0x20;
        std::fs::write(&path, &corrupt).unwrap();
        let r = recover(dir.path(), None).unwrap();
        assert_eq!((r.replayed, r.torn), (1, 1));
        // The zeros written ahead of the records are the clean end of a segment, not a tear.
        assert!(whole.ends_with(&[0; 64]), "records are written over zeros");
        std::fs::write(&path, &whole).unwrap();
        let r = recover(dir.path(), None).unwrap();
        assert_eq!((r.replayed, r.torn), (2, 0));
    }

    #[tokio::test]
    async fn replay_skips_what_the_snapshot_holds_and_merges_what_it_may_hold() {
        let dir = tempfile::tempdir().unwrap();
        let journal = write_all(
            dir.path(),
            1,
            &[acquire("a", 33, 90_000), acquire("a", 65, 90_000)],
        )
        .await;
        let through = journal.rotate().await.unwrap();
        assert_eq!(through, 2);
        // Applied to the store before the snapshot below, appended after the rotation.
        let late = [renew("a", 33, 97, 120_000), release("a", 65)];
        for r in &late {
            journal.append(r).wait().await.unwrap();
        }
        journal.close();
        assert_eq!(segments(dir.path()).len(), 2, "the rotation started a segment");
        // The snapshot holds all four operations and says it holds records up to 2.
        let mut snapshot = recover(dir.path(), None).unwrap().checkpoint;
        snapshot.journal_seq = Some(through);
        // Crash before the old segment was deleted: replay skips 1 and 2, merges 3 and 4 again.
        let r = recover(dir.path(), Some(snapshot.clone())).unwrap();
        assert_eq!(r.replayed, 2);
        assert_eq!(leases(&r.checkpoint), [("crawl/a".to_owned(), 33, 97, 120_000)]);
        // And after it was deleted: the same.
        assert_eq!(Journal::remove_covered(dir.path(), through), 1);
        let again = recover(dir.path(), Some(snapshot)).unwrap();
        assert_eq!(leases(&again.checkpoint), leases(&r.checkpoint));
        assert_eq!(again.last_seq, 4);
    }

    #[tokio::test]
    async fn concurrent_appends_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = JournalMetrics::default();
        let journal = Journal::start(JournalConfig::new(dir.path()), 1, metrics.clone()).unwrap();
        let commits: Vec<_> = (0..200u64)
            .map(|i| {
                let journal = journal.clone();
                tokio::spawn(async move { journal.append(&acquire("a", 33 + 32 * i, 90_000)).wait().await })
            })
            .collect();
        for c in commits {
            c.await.unwrap().unwrap();
        }
        journal.close();
        assert_eq!(metrics.records.get(), 200);
        let mut text = String::new();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let batches: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("epo_lease_journal_commit_batch_records_count "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            batches < 200,
            "{batches} syncs for 200 records: no group commit\n{text}"
        );
        assert_eq!(recover(dir.path(), None).unwrap().replayed, 200);
    }

    #[tokio::test]
    async fn a_failed_write_fails_its_batch_and_the_journal_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let journal = write_all(dir.path(), 1, &[acquire("a", 33, 90_000)]).await;
        assert_eq!(journal.rotate().await.unwrap(), 1);
        // The next segment is a full disk: writes fail with ENOSPC.
        std::os::unix::fs::symlink("/dev/full", segment_path(dir.path(), 2)).unwrap();
        let failed = journal.append(&release("a", 33)).wait().await;
        assert!(
            matches!(&failed, Err(JournalError::Io { message, .. }) if message.contains("No space")),
            "{failed:?}"
        );
        assert!(journal.failing().is_some());
        // The next batch goes to a fresh segment.
        journal.append(&acquire("b", 65, 90_000)).wait().await.unwrap();
        assert_eq!(journal.failing(), None);
        journal.close();
        let r = recover(dir.path(), None).unwrap();
        assert_eq!(
            leases(&r.checkpoint).len(),
            2,
            "the failed release is not in the log"
        );
    }
}
