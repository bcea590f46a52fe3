//! Live owners for orphan GC in standalone mode: the records of the state folder, read afresh
//! at each pass (the runner writes a record before it creates the instance). Read-only: never
//! takes the folder's lock.

use std::{collections::HashSet, path::PathBuf};

use async_trait::async_trait;

use super::store::Store;
use crate::gc::LiveOwners;

/// The niceness of the thread that reads the records for a GC pass where it cannot be made
/// an idle-class thread (0 is the default, 19 the lowest priority).
const GC_READ_NICENESS: i32 = 10;

/// Makes the calling thread yield the CPU to every other: Linux's `SCHED_IDLE` class, whose
/// threads the scheduler preempts as soon as any other wakes up. A niced thread still ran in
/// slices of up to 4.5 ms (measured with `perf sched` beside the lease API under load), each a
/// wait for the requests behind it. Falls back to a niceness of 10. Returns whether the thread
/// is idle-class.
fn yield_to_every_other_thread() -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(2) with pid 0 changes only the calling thread's policy and
    // reads nothing but `param`, which lives across the call.
    let idle = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == 0;
    if !idle {
        let _ = rustix::process::setpriority_process(None, GC_READ_NICENESS);
    }
    idle
}

/// The UIDs of the Proxies recorded in a state folder.
pub struct StateOwners(pub PathBuf);

#[async_trait]
impl LiveOwners for StateOwners {
    async fn live_uids(&self, _namespace: Option<&str>) -> Result<HashSet<String>, String> {
        // A file and a JSON parse per Proxy: ~190 ms of CPU at 10,000. On the runtime it
        // stalled every request once a GC pass; on a thread of its own in the idle class
        // (Linux: the policy is per thread) it takes only what requests leave.
        let dir = self.0.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("gc-owners".into())
            .spawn(move || {
                yield_to_every_other_thread();
                let read = Store::read_only(&dir).and_then(|store| store.list());
                let _ = tx.send(read.map(|records| records.into_iter().map(|(_, r)| r.uid).collect()));
            })
            .map_err(|e| format!("starting the thread that reads the state folder: {e}"))?;
        rx.await
            .map_err(|_| "the thread reading the state folder ended without an answer".to_owned())?
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };

    use super::*;
    use crate::{api::ProxyKey, standalone::store::ProxyRecord};

    /// GC asks for the owners once a minute; with 10,000 records reading them took ~190 ms, a
    /// stall of every request on the runtime when it ran there.
    #[tokio::test(flavor = "current_thread")]
    async fn the_records_are_read_off_the_runtime() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Store::open(dir.path()).expect("opens");
        for i in 0..50 {
            let record = ProxyRecord {
                uid: format!("u-{i}"),
                ..ProxyRecord::default()
            };
            store
                .save(&ProxyKey::new("default", &format!("p-{i}")), &record)
                .expect("saves");
        }
        let ran = Arc::new(AtomicBool::new(false));
        let other = tokio::spawn({
            let ran = ran.clone();
            async move { ran.store(true, Ordering::SeqCst) }
        });
        let uids = StateOwners(dir.path().to_owned())
            .live_uids(None)
            .await
            .expect("reads");
        // On a one-thread runtime the other task ran only if reading let go of the thread.
        assert!(ran.load(Ordering::SeqCst), "the read held the runtime's thread");
        assert_eq!(uids.len(), 50);
        other.await.expect("the other task ends");
    }

    #[test]
    fn the_reading_thread_is_idle_class() {
        let policy = std::thread::spawn(|| {
            assert!(
                yield_to_every_other_thread(),
                "sched_setscheduler refused SCHED_IDLE"
            );
            // SAFETY: sched_getscheduler(2) on the calling thread reads nothing of ours.
            unsafe { libc::sched_getscheduler(0) }
        })
        .join()
        .expect("the thread ends");
        assert_eq!(policy, libc::SCHED_IDLE);
    }
}
