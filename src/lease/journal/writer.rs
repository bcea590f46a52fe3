//! The writer thread: takes what handlers appended, in batches, writes each batch and syncs it
//! once, then tells the batch's handlers.
//!
//! **Batches as large as the load.** A sync costs about the same for one record as for a
//! hundred, and every sync costs the machine (on a virtual disk, the host's time too), so the
//! writer waits for the batch it expects: as many records as the last batch held, or
//! [`JournalConfig::window`] after the batch's first record, whichever comes first. Under a
//! steady load of `n` concurrent clients, each with one operation outstanding, every batch
//! holds all `n` and is written the moment the last one arrives; a batch cut by the window
//! lowers the expectation to what arrived, so a lighter load waits the window once. The
//! appender wakes the writer only for a batch's first record and for the expected last.

use std::{
    collections::VecDeque,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use crate::sync::lock;

use super::{
    Item, JournalConfig, JournalError, JournalMetrics, Shared, Waiter,
    segment::{self, Segment},
};

pub(super) struct Writer {
    pub(super) shared: Arc<Shared>,
    pub(super) config: JournalConfig,
    pub(super) metrics: JournalMetrics,
    /// The open segment.
    pub(super) file: Option<Segment>,
}

/// Encoded frames not yet written, and the sequence of the first.
#[derive(Default)]
struct Pending {
    frames: Vec<u8>,
    first_seq: u64,
    last_seq: u64,
    records: usize,
    waiters: Vec<Waiter>,
}

/// The batch size the writer waits for: what the last batch held, lowered to what arrived when
/// the window cut a batch short.
pub(super) fn next_expected(expected: usize, taken: usize, cut_by_window: bool) -> usize {
    if cut_by_window {
        taken.max(1)
    } else {
        expected.max(taken).max(1)
    }
}

impl Writer {
    pub(super) fn run(mut self) {
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
                            segment::encode_frame(&mut pending.frames, seq, payload);
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

    /// Waits for work and takes it, once the expected batch is in or the window is over;
    /// `None` once closed and drained.
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
        let expected = self.shared.expected.load(Ordering::Relaxed);
        let mut cut_by_window = false;
        if let Some(first) = q.first_at {
            let deadline = first + self.config.window;
            while !q.closed
                && q.records < expected.min(self.shared.max_batch)
                && !matches!(q.items.back(), Some(Item::Rotate(_)))
            {
                let now = Instant::now();
                if now >= deadline {
                    cut_by_window = true;
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
        self.shared.expected.store(
            next_expected(expected, q.records, cut_by_window),
            Ordering::Relaxed,
        );
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
        let result = self.write_sync(pending);
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

    fn write_sync(&mut self, pending: &mut Pending) -> Result<(), JournalError> {
        // Move to the spare once the open segment's blocks are used up, rather than grow it.
        if self
            .file
            .as_ref()
            .is_some_and(|seg| !seg.fits(pending.frames.len()) && segment::has_spare(&self.config.dir))
        {
            self.file = None;
        }
        if self.file.is_none() {
            self.file = Some(Segment::open(&self.config.dir, pending.first_seq)?);
        }
        let seg = self.file.as_mut().expect("opened above");
        seg.write_sync(&mut pending.frames)
            .map_err(|e| JournalError::io(&seg.path, &e))?;
        self.shared.segment_bytes.store(seg.pos, Ordering::Relaxed);
        Ok(())
    }

    /// While failing: whether a fresh segment can be created and synced.
    fn probe(&mut self, next_seq: u64) {
        match Segment::open(&self.config.dir, next_seq).and_then(|seg| {
            seg.file
                .sync_data()
                .map_err(|e| JournalError::io(&seg.path, &e))?;
            Ok(seg)
        }) {
            Ok(open) => {
                self.shared.segment_bytes.store(0, Ordering::Relaxed);
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
