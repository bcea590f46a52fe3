//! Persistence of the lease store: the checkpoint format, where checkpoints are kept, and the
//! maintenance task that reaps expired state and saves checkpoints off the hot path.
//!
//! A [`Checkpoint`] is a versioned JSON document. Standalone mode keeps it in one file
//! ([`FileCheckpoint`]: write to a temporary file, fsync, rename over the old one, fsync the
//! folder, so a crash leaves the old or the new checkpoint, never a torn one), followed by a
//! delta file of what changed since ([`CheckpointDelta`]s, one appended per save), folded into a
//! new snapshot once it outgrows the snapshot, so a save costs what changed, not the whole store. Cluster mode keeps
//! it in Kubernetes objects, one part per lease-store shard ([`CheckpointStore::per_shard`],
//! [`LeaseStore::checkpoint_shards`](super::LeaseStore::checkpoint_shards), joined by [`Checkpoint::merge`]), so a change rewrites
//! only its shard; [`encode_chunks`] splits a part into JSON documents below a size limit (one
//! per object, under the API server's object size limit) and [`decode_chunks`] joins them.
//! [`CheckpointSaver`] writes what changed and [`CheckpointReport`] counts it and reports
//! failures (metrics, a health channel for `/readyz` and Events). Checkpoints hold no secrets:
//! no credentials, no signing key, no lease IDs (an ID is only valid with the key's signature).

use std::{collections::BTreeMap, path::PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::ProxyKey;

mod file;
mod upkeep;
pub use file::{FOLD_MIN_BYTES, FileCheckpoint};
pub use upkeep::{CheckpointHealth, CheckpointReport, CheckpointSaver, MaintenanceConfig, maintenance};

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

    /// Applies deltas taken after this checkpoint ([`LeaseStore::checkpoint_delta`](super::LeaseStore::checkpoint_delta)), oldest first:
    /// each names every proxy and binding that changed since the one before, as it then was.
    pub fn apply_deltas(&mut self, deltas: impl IntoIterator<Item = CheckpointDelta>) {
        let mut deltas = deltas.into_iter().peekable();
        if deltas.peek().is_none() {
            return;
        }
        let mut proxies: BTreeMap<ProxyKey, ProxyCheckpoint> = std::mem::take(&mut self.proxies)
            .into_iter()
            .map(|p| (p.key.clone(), p))
            .collect();
        let mut sessions: BTreeMap<String, SessionCheckpoint> = std::mem::take(&mut self.sessions)
            .into_iter()
            .map(|s| (s.session_key.clone(), s))
            .collect();
        for delta in deltas {
            self.saved_at_ms = self.saved_at_ms.max(delta.saved_at_ms);
            for (shard, hwm) in delta.token_hwm {
                let have = self.token_hwm.entry(shard).or_insert(0);
                *have = (*have).max(hwm);
            }
            for key in &delta.removed {
                proxies.remove(key);
            }
            for p in delta.proxies {
                proxies.insert(p.key.clone(), p);
            }
            for s in delta.sessions {
                sessions.insert(s.session_key.clone(), s);
            }
            if delta.journal_seq.is_some() {
                self.journal_seq = delta.journal_seq;
            }
        }
        self.proxies = proxies.into_values().collect();
        self.sessions = sessions.into_values().collect();
    }
}

/// What changed in the lease store since the checkpoint before
/// ([`LeaseStore::checkpoint_delta`](super::LeaseStore::checkpoint_delta)): one frame of
/// [`FileCheckpoint`]'s delta file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointDelta {
    /// When it was taken (ms since the epoch).
    pub saved_at_ms: u64,
    /// Highest fencing token issued per shard number when it was taken.
    pub token_hwm: BTreeMap<u16, u64>,
    /// Proxies removed, or with nothing worth keeping any more (applied before `proxies`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<ProxyKey>,
    /// Proxies whose state changed, as it now is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxies: Vec<ProxyCheckpoint>,
    /// Sticky-session bindings made or extended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sessions: Vec<SessionCheckpoint>,
    /// As [`Checkpoint::journal_seq`]: the last journal record the state holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal_seq: Option<u64>,
}

impl CheckpointDelta {
    /// Whether it names no proxy and no binding (it may still move the token marks).
    pub fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.proxies.is_empty() && self.sessions.is_empty()
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
    /// The request ID it was granted for (an acquire repeating it gets this lease again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
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
    #[error("checkpoint file {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
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
    /// Whether [`CheckpointSaver`] may save with [`Self::save_delta`], only what changed.
    fn deltas(&self) -> bool {
        false
    }
    /// Appends what changed since the last save to the latest checkpoint; `Ok(None)`: write
    /// a whole checkpoint with [`Self::save`] instead (no base to append to yet, or the deltas
    /// outgrew the base: time to fold them into it).
    async fn save_delta(&self, delta: CheckpointDelta) -> Result<Option<Written>, CheckpointError> {
        drop(delta);
        Ok(None)
    }
    /// Replaces store shard `shard`'s part (made by [`LeaseStore::checkpoint_shards`](super::LeaseStore::checkpoint_shards)).
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
