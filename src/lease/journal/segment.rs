//! The journal's files: segment names, the frame format, reading a segment back, and the
//! spare segment that the writer moves to when the open one is full.
//!
//! A frame is `len: u32 LE | crc32(seq ++ payload): u32 LE | seq: u64 LE | payload (JSON)`.
//! Every batch is written followed by a zero header (the end marker, overwritten by the next
//! batch), and a segment named `N` holds records `N, N+1, ...` in order, so a reader stops
//! cleanly at a zero header or at a record out of sequence: what follows is zeros written ahead
//! or the stale records of a recycled segment, never a record anyone was told about.
//!
//! Files never grow under the writer's syncs where this can be avoided: a sync of data written
//! over blocks the file already has flushes data only, while one that changed the file's size
//! also waits for a file-system journal commit (ten times slower under other writers). So a
//! segment is written over zeros written ahead, or over a spare: a covered segment renamed, or
//! (before there is one to recycle) a file of zeros prepared off the writer's path. Recycling
//! also spares the file system a delete, which with `discard` stalls the next commit for
//! milliseconds.

use std::{
    fs::{File, OpenOptions},
    io::Read,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    time::Duration,
};

use super::{JournalError, Record};

/// Segment files are `leases.journal.<first sequence, 20 digits>` in the journal's folder.
pub const SEGMENT_PREFIX: &str = "leases.journal.";
/// The spare: a file of zeros or a covered segment, the next segment's blocks.
const SPARE: &str = "leases.journal.spare";
/// A spare being prepared (renamed to [`SPARE`] once all zeros are durable).
pub(super) const SPARE_PART: &str = "leases.journal.spare.part";

pub(super) const FRAME_HEADER: usize = 16;
/// No record comes near this; a larger length is a corrupt frame.
const MAX_RECORD: usize = 1 << 20;

/// Zeros written ahead of a segment that outgrew its blocks: doubling from the first to the
/// last size, so a quiet journal writes little ahead.
pub(super) const ZERO_AHEAD_MIN: u64 = 64 * 1024;
pub(super) const ZERO_AHEAD_MAX: u64 = 4 * 1024 * 1024;
/// A fresh spare's size; the writer moves to the spare once a batch no longer fits.
pub(super) const SEGMENT_BYTES: u64 = 32 * 1024 * 1024;
/// A fresh spare is written in steps this large, each synced, with a pause between, so its
/// flushes never hold the writer's up for long.
const PREPARE_STEP: usize = 1024 * 1024;
const PREPARE_PAUSE: Duration = Duration::from_millis(2);

pub(super) fn segment_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{SEGMENT_PREFIX}{first_seq:020}"))
}

/// The segment files in `dir`, by first sequence (the spare is none).
pub(super) fn segments(dir: &Path) -> Vec<(u64, PathBuf)> {
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

pub(super) fn encode_frame(out: &mut Vec<u8>, seq: u64, payload: &[u8]) {
    let seq = seq.to_le_bytes();
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&frame_crc(&seq, payload).to_le_bytes());
    out.extend_from_slice(&seq);
    out.extend_from_slice(payload);
}

/// CRC-32 (IEEE) of a frame's sequence number and payload.
fn frame_crc(seq: &[u8; 8], payload: &[u8]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(seq);
    crc.update(payload);
    crc.finalize()
}

/// What reading a segment found after its last record.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum SegmentEnd {
    /// The end marker, zeros, the file's end, or a stale record of a recycled segment.
    Clean,
    /// A torn or corrupt frame: a write a crash cut short (never acknowledged).
    Torn,
}

/// The records of the segment at `path`, whose first record is numbered `first_seq`, in order.
pub(super) fn read_segment(
    path: &Path,
    first_seq: u64,
) -> Result<(Vec<(u64, Record)>, SegmentEnd), JournalError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| JournalError::io(path, &e))?;
    let mut out = Vec::new();
    let mut at = 0;
    let mut expected = first_seq;
    while at < bytes.len() {
        let Some(header) = bytes.get(at..at + FRAME_HEADER) else {
            // A short tail of zeros is the end of what was written ahead; anything else was cut.
            let end = if bytes[at..].iter().all(|b| *b == 0) {
                SegmentEnd::Clean
            } else {
                SegmentEnd::Torn
            };
            return Ok((out, end));
        };
        if header.iter().all(|b| *b == 0) {
            return Ok((out, SegmentEnd::Clean));
        }
        let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let seq_bytes: [u8; 8] = header[8..16].try_into().expect("8 bytes");
        let Some(payload) = (len <= MAX_RECORD)
            .then(|| bytes.get(at + FRAME_HEADER..at + FRAME_HEADER + len))
            .flatten()
        else {
            return Ok((out, SegmentEnd::Torn));
        };
        if frame_crc(&seq_bytes, payload) != crc {
            return Ok((out, SegmentEnd::Torn));
        }
        let seq = u64::from_le_bytes(seq_bytes);
        if seq != expected {
            // A record of the segment this file was before it was recycled.
            return Ok((out, SegmentEnd::Clean));
        }
        let Ok(record) = serde_json::from_slice::<Record>(payload) else {
            return Ok((out, SegmentEnd::Torn));
        };
        out.push((seq, record));
        expected += 1;
        at += FRAME_HEADER + len;
    }
    Ok((out, SegmentEnd::Clean))
}

/// An open segment: records are written at `pos`, over blocks the file has up to `allocated`
/// (zeros, or a recycled segment's old records), so a sync flushes data only.
pub(super) struct Segment {
    /// Open for writing at offsets (never appending: the size must not change under a sync).
    pub(super) file: File,
    /// For error messages.
    pub(super) path: PathBuf,
    /// Where the next batch goes: just past the last record (over the end marker).
    pub(super) pos: u64,
    /// How far the file has blocks: writing below this flushes data only.
    pub(super) allocated: u64,
    /// The next zero-fill's size, once the file's own blocks are used up.
    pub(super) ahead: u64,
}

impl Segment {
    /// Creates segment `first_seq` in `dir` from the spare if there is one (renamed: no
    /// allocation), else as an empty file (emptying a file of that name: nothing in it was
    /// acknowledged, since record numbers only grow), and makes its name durable.
    pub(super) fn open(dir: &Path, first_seq: u64) -> Result<Self, JournalError> {
        let path = segment_path(dir, first_seq);
        let spare = dir.join(SPARE);
        let (file, allocated) = match std::fs::rename(&spare, &path) {
            Ok(()) => {
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| JournalError::io(&path, &e))?;
                let len = file.metadata().map_err(|e| JournalError::io(&path, &e))?.len();
                (file, len)
            }
            Err(_) => (create_empty(&path)?, 0),
        };
        sync_dir(dir)?;
        Ok(Segment {
            file,
            path,
            pos: 0,
            allocated,
            ahead: ZERO_AHEAD_MIN,
        })
    }

    /// Whether `bytes` more (and the end marker) fit in the blocks the file has.
    pub(super) fn fits(&self, bytes: usize) -> bool {
        self.pos + (bytes + FRAME_HEADER) as u64 <= self.allocated
    }

    /// Writes `frames` and the end marker at `pos` (first writing zeros ahead if the file's
    /// blocks do not reach that far) and syncs the data.
    pub(super) fn write_sync(&mut self, frames: &mut Vec<u8>) -> std::io::Result<()> {
        let records_end = self.pos + frames.len() as u64;
        frames.extend_from_slice(&[0; FRAME_HEADER]);
        let end = self.pos + frames.len() as u64;
        let written = (|| {
            if end > self.allocated {
                let to = end.max(self.allocated + self.ahead);
                self.file
                    .write_all_at(&vec![0u8; (to - self.allocated) as usize], self.allocated)?;
                self.allocated = to;
                self.ahead = (self.ahead * 2).min(ZERO_AHEAD_MAX);
            }
            self.file.write_all_at(frames, self.pos)?;
            self.file.sync_data()
        })();
        frames.truncate(frames.len() - FRAME_HEADER);
        written?;
        self.pos = records_end;
        Ok(())
    }
}

/// Creates the file at `path`, emptying one of that name.
fn create_empty(path: &Path) -> Result<File, JournalError> {
    OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| JournalError::io(path, &e))
}

fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| JournalError::io(dir, &e))
}

/// Whether `dir` has a spare segment.
pub(super) fn has_spare(dir: &Path) -> bool {
    dir.join(SPARE).is_file()
}

/// Makes the covered segment at `path` the spare (if there is none yet) or deletes it.
/// Returns whether it was recycled.
pub(super) fn recycle_or_remove(dir: &Path, path: &Path) -> bool {
    let spare = dir.join(SPARE);
    if !spare.exists() && std::fs::rename(path, &spare).is_ok() {
        return true;
    }
    let _ = std::fs::remove_file(path);
    false
}

/// Writes a spare of zeros, in synced steps with pauses between (off the writer's path: the
/// compaction calls it on a blocking thread), then renames it into place.
pub(super) fn prepare_spare(dir: &Path) -> Result<(), JournalError> {
    let part = dir.join(SPARE_PART);
    let file = create_empty(&part)?;
    let zeros = vec![0u8; PREPARE_STEP];
    let mut at = 0;
    while at < SEGMENT_BYTES {
        file.write_all_at(&zeros, at)
            .and_then(|()| file.sync_data())
            .map_err(|e| JournalError::io(&part, &e))?;
        at += PREPARE_STEP as u64;
        std::thread::sleep(PREPARE_PAUSE);
    }
    let spare = dir.join(SPARE);
    if spare.exists() {
        // The compaction recycled a segment meanwhile.
        let _ = std::fs::remove_file(&part);
        return Ok(());
    }
    std::fs::rename(&part, &spare).map_err(|e| JournalError::io(&spare, &e))?;
    sync_dir(dir)
}
