//! Standalone mode's lease journal: acquires, renewals and releases are made durable before
//! they are answered, so a crash at any instant loses no answered lease operation.
//!
//! It owns the append-only log in the state folder (segment files `leases.journal.<first
//! sequence>`), the one writer thread that commits it, and recovery (snapshot + log replay).
//!
//! - **Group commit** ([`writer`]). A handler applies its operation to the [`LeaseStore`](super::LeaseStore),
//!   then appends what changed ([`Record`]) with [`Journal::append`], which numbers it (a
//!   sequence number) and returns a [`Commit`] to await before answering. The writer thread
//!   writes a batch and `fdatasync`s once for all of it, as soon as the batch it expects (as
//!   large as the last) is in, or [`JournalConfig::window`] after the batch's first record.
//!   A failed write or sync fails every record of its batch (the handlers answer 503, never
//!   200); the next batch goes to a fresh segment, and while failing, the writer retries an
//!   empty segment every second and lease operations are refused up front ([`Journal::failing`]).
//! - **Files** ([`segment`]): frames with a CRC and their sequence number, written over blocks
//!   the file already has (a spare segment, or zeros written ahead), so a sync flushes data
//!   only; a reader stops cleanly at the end marker or a record out of sequence.
//! - **Compaction** ([`recovery::compaction`]). It snapshots the store once a second (if
//!   anything changed) into the checkpoint file, recording the last record `S` appended before
//!   the snapshot was read ([`Checkpoint::journal_seq`](super::checkpoint::Checkpoint::journal_seq); every record up to `S` was applied to
//!   the store before it was appended), then recycles the segments holding only records up to
//!   `S` as the next spare (or deletes them). A crash between the two leaves records the
//!   snapshot already holds: replay skips every record up to the snapshot's `S`.
//! - **Replay is idempotent** ([`recovery`]). Records after `S` may also be in the snapshot (an
//!   operation applied before the snapshot, appended after the rotation); each record merges
//!   into the state (an acquire adds a lease it does not find, a renewal keeps the newer token,
//!   a release removes the lease), and the records of one lease are in causal order in the log:
//!   a renewal or release presents a token its holder only had once the earlier record was
//!   committed. A torn or corrupt frame ends its segment's replay, with a log line; it was never
//!   committed, so nobody was told about it.

mod recovery;
mod segment;
#[cfg(test)]
mod tests;
mod writer;

pub use recovery::{Recovered, active_leases_by_proxy, compaction, recover, recover_and_compact};
pub use segment::SEGMENT_PREFIX;

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
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

use super::{ProxyKey, checkpoint::BanCheckpoint};
use crate::{
    json_writer::{put_str, put_u64},
    sync::lock,
};

/// One lease operation as the journal keeps it: what changed in the store, enough to redo it
/// on a snapshot. Holds no secrets (no lease IDs, no credentials).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "op",
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    deny_unknown_fields
)]
pub enum Record {
    /// A lease was granted (or reinstated from its signed ID).
    Acquire(AcquireRecord),
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
        cooldown_until_ms: Option<u64>,
        /// The domain ban a `banned` outcome started.
        ban: Option<BanCheckpoint>,
    },
}

/// A granted (or reinstated) lease as the journal keeps it.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireRecord {
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
    target_domain: Option<String>,
    /// Sticky-session key and when its binding lapses.
    session: Option<(String, u64)>,
    /// The request ID it was granted for.
    request_id: Option<String>,
}

impl Record {
    /// The record of a granted lease.
    pub fn acquired(
        lease: &super::Lease,
        claim: &super::LeaseClaim,
        request_id: Option<&str>,
        session_idle: Duration,
    ) -> Self {
        Record::Acquire(AcquireRecord {
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
            request_id: request_id.map(str::to_owned),
        })
    }

    /// The record of a lease reinstated from its signed claim with `token`.
    pub fn reinstated(claim: &super::LeaseClaim, token: u64) -> Self {
        Record::Acquire(AcquireRecord {
            key: claim.id.key.clone(),
            first_token: claim.id.first_token,
            token,
            holder: claim.holder.clone(),
            acquired_at_ms: claim.acquired_at_ms,
            expires_at_ms: claim.expires_at_ms,
            ttl_ms: claim.expires_at_ms.saturating_sub(claim.acquired_at_ms).max(1),
            target_domain: claim.target_domain.clone(),
            session: None,
            request_id: None,
        })
    }

    /// The record's JSON, byte for byte as serde_json writes it (recovery reads it back with
    /// serde): written by hand because serde's per-field machinery (every field name escaped
    /// again) was about a third of what the journal cost an acquire and a release.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let field = |out: &mut Vec<u8>, name: &[u8], n: u64| {
            out.extend_from_slice(name);
            put_u64(out, n);
        };
        let op: &[u8] = match self {
            Record::Acquire(_) => b"acquire",
            Record::Renew { .. } => b"renew",
            Record::Release { .. } => b"release",
        };
        out.extend_from_slice(b"{\"op\":\"");
        out.extend_from_slice(op);
        out.extend_from_slice(b"\",\"key\":");
        put_str(out, self.key().as_str());
        field(out, b",\"firstToken\":", self.tokens()[0]);
        match self {
            Record::Acquire(a) => {
                field(out, b",\"token\":", a.token);
                out.extend_from_slice(b",\"holder\":");
                put_str(out, &a.holder);
                field(out, b",\"acquiredAtMs\":", a.acquired_at_ms);
                field(out, b",\"expiresAtMs\":", a.expires_at_ms);
                field(out, b",\"ttlMs\":", a.ttl_ms);
                if let Some(domain) = &a.target_domain {
                    out.extend_from_slice(b",\"targetDomain\":");
                    put_str(out, domain);
                }
                if let Some((session_key, lapses_at_ms)) = &a.session {
                    out.extend_from_slice(b",\"session\":[");
                    put_str(out, session_key);
                    field(out, b",", *lapses_at_ms);
                    out.push(b']');
                }
                if let Some(request_id) = &a.request_id {
                    out.extend_from_slice(b",\"requestId\":");
                    put_str(out, request_id);
                }
            }
            Record::Renew {
                token, expires_at_ms, ..
            } => {
                field(out, b",\"token\":", *token);
                field(out, b",\"expiresAtMs\":", *expires_at_ms);
            }
            Record::Release {
                cooldown_until_ms,
                ban,
                ..
            } => {
                if let Some(until) = cooldown_until_ms {
                    field(out, b",\"cooldownUntilMs\":", *until);
                }
                if let Some(ban) = ban {
                    out.extend_from_slice(b",\"ban\":{\"domain\":");
                    put_str(out, &ban.domain);
                    field(out, b",\"untilMs\":", ban.until_ms);
                    out.push(b'}');
                }
            }
        }
        out.push(b'}');
    }

    fn tokens(&self) -> [u64; 2] {
        match self {
            Record::Acquire(acquire) => [acquire.first_token, acquire.token],
            Record::Renew {
                first_token, token, ..
            } => [*first_token, *token],
            Record::Release { first_token, .. } => [*first_token, *first_token],
        }
    }

    fn key(&self) -> &ProxyKey {
        match self {
            Record::Acquire(AcquireRecord { key, .. })
            | Record::Renew { key, .. }
            | Record::Release { key, .. } => key,
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
    /// The longest a batch waits for the records the writer expects (as many as the last
    /// batch held) after its first: the most a lighter load adds to an operation's latency,
    /// once, before the expectation drops. Zero: every batch is written at once (the records
    /// arriving during a sync make the next).
    pub window: Duration,
    /// A batch this large is written at once.
    pub max_batch: usize,
}

impl JournalConfig {
    /// The defaults for segments in `dir`: a 1 ms window (64 clients' operations arrive over
    /// ~0.6 ms here, so a batch can hold them all), batches of at most 1024 records.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            window: Duration::from_millis(1),
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
    /// The batch size the writer waits for ([`writer::next_expected`]).
    expected: AtomicUsize,
    wake: Condvar,
    failing: AtomicBool,
    /// Bytes written to the open segment.
    segment_bytes: AtomicU64,
    last_error: Mutex<Option<String>>,
    last_durable: AtomicU64,
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
            expected: AtomicUsize::new(1),
            wake: Condvar::new(),
            failing: AtomicBool::new(false),
            segment_bytes: AtomicU64::new(0),
            last_error: Mutex::new(None),
            last_durable: AtomicU64::new(next_seq.saturating_sub(1)),
        });
        let writer = writer::Writer {
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
        let mut payload = Vec::with_capacity(192);
        record.write_json(&mut payload);
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
        // The writer needs waking for a batch's first record (it waits for work) and the
        // batch's expected last (it waits for it); waking it for every record costs a context
        // switch each.
        let expected = self.shared.expected.load(Ordering::Relaxed);
        let wake = q.records == 1 || q.records == expected.min(self.shared.max_batch);
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

    /// Recycles (as the next spare) or deletes the segments whose records are all numbered up
    /// to `through` (they are in a saved snapshot): those followed by a segment starting at
    /// `through + 1` or before. The last one stays (it may be the open one). Returns how many.
    pub fn remove_covered(dir: &Path, through: u64) -> usize {
        let all = segment::segments(dir);
        let covered: Vec<&PathBuf> = all
            .windows(2)
            .filter(|pair| pair[1].0 <= through + 1)
            .map(|pair| &pair[0].1)
            .collect();
        for path in &covered {
            segment::recycle_or_remove(dir, path);
        }
        covered.len()
    }

    /// Recycles or deletes every segment (all replayed into a saved snapshot, at start);
    /// returns how many.
    fn remove_all(dir: &Path) -> usize {
        let all = segment::segments(dir);
        for (_, path) in &all {
            segment::recycle_or_remove(dir, path);
        }
        all.len()
    }
}
