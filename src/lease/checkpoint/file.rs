//! Standalone mode's checkpoint: a snapshot file and a delta file after it.
//!
//! - The **snapshot** (`<file>`) is a whole [`Checkpoint`], replaced atomically: written to a
//!   temporary file, synced, renamed over the old one, the folder synced.
//! - The **delta file** (`<file>.delta`) starts with a header frame naming the snapshot it follows
//!   (its `savedAtMs`, length and CRC-32), then one frame per save: a [`CheckpointDelta`] of what
//!   changed since the save before, appended and synced. A frame is `len: u32 LE | crc32: u32 LE |
//!   JSON`. Loading applies the frames in order onto the snapshot and stops at a torn or corrupt
//!   frame (a save a crash interrupted: it was never reported done).
//! - **Folding.** Once the delta file would grow past the snapshot (or [`FOLD_MIN_BYTES`]), the
//!   next save writes a whole snapshot and then a new delta file holding only its header
//!   (written aside and renamed over the old one). A crash between the two leaves the new
//!   snapshot with the old delta file, whose header names the old snapshot: it is ignored, and
//!   the new snapshot holds everything it held. Each delta save writes what changed; a fold writes
//!   the whole store at most once per snapshot's worth of deltas, so the bytes written per change
//!   stay bounded whatever the number of proxies that did not change.
//! - A process appends only to a delta file it started itself (its first save is a whole
//!   snapshot), so it never appends after a torn frame; after a failed append, the next save is a
//!   whole snapshot again.

use std::{
    fs::{File, OpenOptions},
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{Checkpoint, CheckpointDelta, CheckpointError, CheckpointStore, Written, decode, encode};
use crate::sync::lock;

/// The delta file is folded into a new snapshot once appending would take it past the
/// snapshot's size or this, whichever is larger (small snapshots are not rewritten every few
/// saves).
pub const FOLD_MIN_BYTES: u64 = 256 * 1024;
const FRAME_HEADER: usize = 8;
/// No frame comes near this; a larger length is a corrupt frame.
const MAX_FRAME: usize = 256 << 20;

/// Names the snapshot a delta file follows.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DeltaHeader {
    snapshot_saved_at_ms: u64,
    snapshot_bytes: u64,
    snapshot_crc32: u32,
}

impl DeltaHeader {
    fn of(saved_at_ms: u64, bytes: &[u8]) -> Self {
        Self {
            snapshot_saved_at_ms: saved_at_ms,
            snapshot_bytes: bytes.len() as u64,
            snapshot_crc32: crc32fast::hash(bytes),
        }
    }
}

/// The delta file this process appends to.
#[derive(Debug, Default)]
struct Appender {
    /// Open for appending, its header naming the snapshot this process wrote last; `None`:
    /// the next save writes a whole snapshot.
    file: Option<File>,
    /// Its length.
    bytes: u64,
    /// The snapshot's length.
    snapshot_bytes: u64,
}

/// Standalone mode's checkpoint: a snapshot file replaced atomically and a delta file appended
/// after it (see the module docs).
#[derive(Clone, Debug)]
pub struct FileCheckpoint {
    path: PathBuf,
    appender: Arc<Mutex<Appender>>,
    /// [`FOLD_MIN_BYTES`] unless set otherwise.
    fold_min_bytes: u64,
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payloads of the whole frames at the start of `bytes`, and whether a torn or corrupt
/// one ended them.
fn frames(mut bytes: &[u8]) -> (Vec<&[u8]>, bool) {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let Some((head, rest)) = bytes.split_first_chunk::<FRAME_HEADER>() else {
            return (out, true);
        };
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len > MAX_FRAME || len > rest.len() || crc32fast::hash(&rest[..len]) != crc {
            return (out, true);
        }
        out.push(&rest[..len]);
        bytes = &rest[len..];
    }
    (out, false)
}

fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("checkpoint deltas always serialize: plain data, string map keys")
}

fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // A rename is durable only once the folder is synced.
    File::open(dir)?.sync_all()
}

fn write_atomically(path: &Path, tmp: &Path, bytes: &[u8]) -> std::io::Result<()> {
    {
        let mut file = File::create(tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(tmp, path)?;
    sync_dir(path)
}

impl FileCheckpoint {
    /// Checkpoints kept at `path` (and `path` + `.delta`; its folder must exist).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            appender: Arc::default(),
            fold_min_bytes: FOLD_MIN_BYTES,
        }
    }

    /// Folds the deltas into a new snapshot once they would pass the snapshot's size or
    /// `bytes` (default [`FOLD_MIN_BYTES`]): tests fold often with a small one.
    pub fn with_fold_min_bytes(mut self, bytes: u64) -> Self {
        self.fold_min_bytes = bytes;
        self
    }

    /// The snapshot file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The delta file of the snapshot at `path`.
    pub fn delta_path(path: &Path) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(".delta");
        PathBuf::from(name)
    }

    /// Reads the checkpoint at `path`: the snapshot with the delta file that follows it applied
    /// (a delta file following another snapshot is ignored; a torn frame ends it). `None` if
    /// there is no snapshot.
    pub fn read(path: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
        let io = |cause| CheckpointError::Io {
            path: path.to_owned(),
            cause,
        };
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        let mut checkpoint = decode(&bytes)?;
        let delta_path = Self::delta_path(path);
        let deltas = match std::fs::read(&delta_path) {
            Ok(deltas) => deltas,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Some(checkpoint)),
            Err(cause) => {
                return Err(CheckpointError::Io {
                    path: delta_path,
                    cause,
                });
            }
        };
        let (payloads, torn) = frames(&deltas);
        let Some((header, payloads)) = payloads.split_first() else {
            return Ok(Some(checkpoint));
        };
        let follows = serde_json::from_slice::<DeltaHeader>(header)
            .is_ok_and(|h| h == DeltaHeader::of(checkpoint.saved_at_ms, &bytes));
        if !follows {
            // Left by a fold that a crash interrupted: the snapshot holds all of it.
            return Ok(Some(checkpoint));
        }
        let mut applied = Vec::with_capacity(payloads.len());
        for payload in payloads {
            match serde_json::from_slice::<CheckpointDelta>(payload) {
                Ok(delta) => applied.push(delta),
                Err(error) => {
                    return Err(CheckpointError::Decode(format!(
                        "{}: a delta with a valid checksum does not decode: {error}",
                        delta_path.display()
                    )));
                }
            }
        }
        if torn {
            tracing::warn!(
                file = %delta_path.display(),
                "lease checkpoint delta file ends in a torn frame: ignored from there (that save never completed)"
            );
        }
        checkpoint.apply_deltas(applied);
        Ok(Some(checkpoint))
    }

    /// Writes a whole snapshot, then a fresh delta file after it, and keeps that open for
    /// appending.
    fn write_snapshot(
        path: &Path,
        saved_at_ms: u64,
        bytes: &[u8],
        appender: &mut Appender,
    ) -> std::io::Result<()> {
        // Whatever happens next, nothing more is appended to the old delta file.
        appender.file = None;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        write_atomically(path, Path::new(&tmp), bytes)?;
        let header = frame(&to_json(&DeltaHeader::of(saved_at_ms, bytes)));
        let delta = Self::delta_path(path);
        let mut delta_tmp = delta.as_os_str().to_owned();
        delta_tmp.push(".tmp");
        write_atomically(&delta, Path::new(&delta_tmp), &header)?;
        appender.file = Some(OpenOptions::new().append(true).open(&delta)?);
        appender.bytes = header.len() as u64;
        appender.snapshot_bytes = bytes.len() as u64;
        Ok(())
    }

    fn io_error(&self, cause: std::io::Error) -> CheckpointError {
        CheckpointError::Io {
            path: self.path.clone(),
            cause,
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, CheckpointError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CheckpointError::Backend(format!("checkpoint writer task failed: {e}")))
}

#[async_trait]
impl CheckpointStore for FileCheckpoint {
    async fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let path = self.path.clone();
        blocking(move || Self::read(&path)).await?
    }

    async fn save(&self, checkpoint: &Checkpoint) -> Result<Written, CheckpointError> {
        let bytes = encode(checkpoint);
        let (path, appender) = (self.path.clone(), self.appender.clone());
        let saved_at_ms = checkpoint.saved_at_ms;
        let len = bytes.len() as u64;
        blocking(move || Self::write_snapshot(&path, saved_at_ms, &bytes, &mut lock(&appender)))
            .await?
            .map_err(|e| self.io_error(e))?;
        // The delta file's header is part of the snapshot's write.
        Ok(Written {
            objects: 1,
            bytes: len,
        })
    }

    fn deltas(&self) -> bool {
        true
    }

    async fn save_delta(&self, delta: CheckpointDelta) -> Result<Option<Written>, CheckpointError> {
        if lock(&self.appender).file.is_none() {
            return Ok(None);
        }
        let appender = self.appender.clone();
        let fold_min_bytes = self.fold_min_bytes;
        // Encoded off the serving threads too: under load every proxy of a large pool changes
        // each second, and encoding 10,000 of them took the one serving core for milliseconds.
        blocking(move || {
            let framed = frame(&to_json(&delta));
            let len = framed.len() as u64;
            let mut appender = lock(&appender);
            if appender.bytes + len > appender.snapshot_bytes.max(fold_min_bytes) {
                return Ok(None);
            }
            let Some(file) = appender.file.as_mut() else {
                return Ok(None);
            };
            match file.write_all(&framed).and_then(|()| file.sync_data()) {
                Ok(()) => {
                    appender.bytes += len;
                    Ok(Some(Written {
                        objects: 1,
                        bytes: len,
                    }))
                }
                Err(error) => {
                    // A partial frame may be on disk: append nothing after it.
                    appender.file = None;
                    Err(error)
                }
            }
        })
        .await?
        .map_err(|e| self.io_error(e))
    }
}
