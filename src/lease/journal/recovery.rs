//! Recovery and compaction: a snapshot with the log replayed onto it at start, and the
//! periodic snapshot that lets covered segments go (recycled as the next spare).

use std::{
    collections::BTreeMap,
    future::Future,
    path::{Path, PathBuf},
    time::Duration,
};

use super::{
    Journal, JournalError, Record,
    segment::{self, SegmentEnd},
};
use crate::lease::{
    LeaseStore, MAX_SHARDS, ProxyKey,
    checkpoint::{
        Checkpoint, CheckpointAdmission, CheckpointDelta, CheckpointReport, CheckpointSaver, FileCheckpoint,
        LeaseCheckpoint, ProxyCheckpoint, SessionCheckpoint,
    },
};

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
    for (first_seq, path) in segment::segments(dir) {
        let (records, end) = segment::read_segment(&path, first_seq)?;
        if end == SegmentEnd::Torn {
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
    let snapshot = FileCheckpoint::read(checkpoint).ok().flatten();
    let Ok(recovered) = recover(state, snapshot) else {
        return BTreeMap::new();
    };
    let now = crate::lease::Clock::System.now_ms();
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
            Record::Acquire(a) => {
                if a.first_token >= proxy.revoked_below
                    && !proxy.leases.iter().any(|l| l.first_token == a.first_token)
                {
                    proxy.leases.push(LeaseCheckpoint {
                        first_token: a.first_token,
                        token: a.token,
                        holder: a.holder.clone(),
                        acquired_at_ms: a.acquired_at_ms,
                        expires_at_ms: a.expires_at_ms,
                        ttl_ms: a.ttl_ms,
                        target_domain: a.target_domain.clone(),
                        session_key: a.session.as_ref().map(|(k, _)| k.clone()),
                        request_id: a.request_id.clone(),
                    });
                }
                if let Some((session_key, until)) = &a.session {
                    let binding =
                        self.sessions
                            .entry(session_key.clone())
                            .or_insert_with(|| SessionCheckpoint {
                                session_key: session_key.clone(),
                                proxy: a.key.clone(),
                                expires_at_ms: 0,
                            });
                    if *until >= binding.expires_at_ms {
                        binding.proxy = a.key.clone();
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
    use crate::lease::checkpoint::CheckpointStore;
    let snapshot = match file.load().await {
        Ok(snapshot) => snapshot,
        Err(error) => {
            tracing::warn!(%error, "lease checkpoint unreadable; starting from the journal alone");
            None
        }
    };
    let had_segments = !segment::segments(dir).is_empty();
    let recovered = recover(dir, snapshot)?;
    // A spare whose preparation a crash interrupted: started again when needed.
    let _ = std::fs::remove_file(dir.join(segment::SPARE_PART));
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
/// up to it was applied to the store first), then recycles or deletes the segments the
/// snapshot covers (closing the open one past [`segment::SEGMENT_BYTES`]), and keeps a spare
/// segment ready; a last snapshot when `shutdown` completes, then it closes the journal. Saves are counted and failures reported through `report` (like
/// [`crate::lease::checkpoint::maintenance`]'s, which then runs without a checkpoint sink, reaping only).
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
            // The checkpoint must name the new last record even if the store's changes were
            // all in the last one: an empty delta does.
            saver.flush();
        }
        if saver.pending(&store) {
            let through = journal.last_appended();
            let sink = Sequenced {
                file: &file,
                journal_seq: through,
            };
            match saver.save(&store, &sink, &report).await {
                Ok(()) => {
                    if journal.segment_bytes() >= segment::SEGMENT_BYTES
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
        prepare_spare_if_missing(&dir).await;
    }
}

/// The file checkpoint, stamping each snapshot with the journal sequence it holds.
struct Sequenced<'a> {
    file: &'a FileCheckpoint,
    journal_seq: u64,
}

#[async_trait::async_trait]
impl crate::lease::checkpoint::CheckpointStore for Sequenced<'_> {
    async fn load(&self) -> Result<Option<Checkpoint>, crate::lease::checkpoint::CheckpointError> {
        self.file.load().await
    }

    async fn save(
        &self,
        checkpoint: &Checkpoint,
    ) -> Result<crate::lease::checkpoint::Written, crate::lease::checkpoint::CheckpointError> {
        let stamped = Checkpoint {
            journal_seq: Some(self.journal_seq),
            ..checkpoint.clone()
        };
        self.file.save(&stamped).await
    }

    fn deltas(&self) -> bool {
        true
    }

    async fn save_delta(
        &self,
        mut delta: CheckpointDelta,
    ) -> Result<Option<crate::lease::checkpoint::Written>, crate::lease::checkpoint::CheckpointError> {
        delta.journal_seq = Some(self.journal_seq);
        self.file.save_delta(delta).await
    }
}

/// Prepares a spare segment of zeros on a blocking thread if there is none (at start, before
/// the first covered segment can be recycled), so the writer never grows a segment under load.
async fn prepare_spare_if_missing(dir: &Path) {
    if segment::has_spare(dir) {
        return;
    }
    let dir = dir.to_owned();
    match tokio::task::spawn_blocking(move || segment::prepare_spare(&dir)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "preparing a spare lease journal segment failed"),
        Err(error) => tracing::warn!(%error, "preparing a spare lease journal segment panicked"),
    }
}
