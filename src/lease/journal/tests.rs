//! The journal's unit tests: replay, torn tails, compaction's cover, group commit, failures.

use std::path::Path;

use prometheus_client::registry::Registry;

use super::{
    segment::{FRAME_HEADER, encode_frame, segment_path, segments},
    *,
};
use crate::api::test_key as key;
use crate::lease::checkpoint::{BanCheckpoint, Checkpoint};

fn acquire(name: &str, first: u64, expires: u64) -> Record {
    Record::Acquire(AcquireRecord {
        key: key(name),
        first_token: first,
        token: first,
        holder: "c1".into(),
        acquired_at_ms: 1_000,
        expires_at_ms: expires,
        ttl_ms: expires - 1_000,
        target_domain: Some("example.com".into()),
        session: Some(("s1".into(), expires + 60_000)),
        request_id: None,
    })
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

#[test]
fn records_are_written_as_serde_json_writes_them_and_read_back() {
    let odd = "quote\" back\\ ctl\u{1}\n é✓";
    let bare_acquire = Record::Acquire(AcquireRecord {
        key: key("p0"),
        first_token: 0,
        token: u64::MAX,
        holder: odd.into(),
        acquired_at_ms: 0,
        expires_at_ms: 1,
        ttl_ms: 1,
        target_domain: None,
        session: None,
        request_id: None,
    });
    let full_acquire = Record::Acquire(AcquireRecord {
        key: key("p1"),
        first_token: 7,
        token: 9,
        holder: "c1".into(),
        acquired_at_ms: 1_779_962_400_000,
        expires_at_ms: 1_779_962_460_000,
        ttl_ms: 60_000,
        target_domain: Some("example.com".into()),
        session: Some((odd.into(), 1_779_962_520_000)),
        request_id: Some(odd.into()),
    });
    let bare_release = Record::Release {
        key: key("p2"),
        first_token: 3,
        cooldown_until_ms: None,
        ban: None,
    };
    for record in [
        bare_acquire,
        full_acquire,
        acquire("p3", 4, 70_000),
        renew("p4", 5, 6, 80_000),
        release("p5", 7),
        bare_release,
    ] {
        let mut fast = Vec::new();
        record.write_json(&mut fast);
        assert_eq!(
            String::from_utf8(fast.clone()).unwrap(),
            serde_json::to_string(&record).unwrap()
        );
        assert_eq!(serde_json::from_slice::<Record>(&fast).unwrap(), record);
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

/// A journal that committed `records` (numbered from 1), then closed its segment.
async fn rotated_after(dir: &Path, records: &[Record]) -> (Journal, u64) {
    let journal = write_all(dir, 1, records).await;
    let through = journal.rotate().await.unwrap();
    assert_eq!(through, records.len() as u64);
    (journal, through)
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
    let (journal, through) =
        rotated_after(dir.path(), &[acquire("a", 33, 90_000), acquire("a", 65, 90_000)]).await;
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

#[test]
fn the_writer_expects_the_last_batch_and_a_window_cut_lowers_it() {
    use super::writer::next_expected;
    // 64 clients in a closed loop: the expectation rises to what arrives and stays.
    assert_eq!(next_expected(1, 9, false), 9);
    assert_eq!(next_expected(9, 64, false), 64);
    assert_eq!(next_expected(64, 64, false), 64);
    // A client left: the batch waited out the window with 63; the next one expects 63.
    assert_eq!(next_expected(64, 63, true), 63);
    // A lone client: one window, then every record is written at once.
    assert_eq!(next_expected(63, 1, true), 1);
    assert_eq!(next_expected(0, 0, true), 1);
}

#[tokio::test]
async fn a_lighter_load_waits_the_window_once_then_writes_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = JournalConfig {
        window: std::time::Duration::from_millis(200),
        ..JournalConfig::new(dir.path())
    };
    let journal = Journal::start(config, 1, JournalMetrics::default()).unwrap();
    // The last batches held eight records (as under eight concurrent clients).
    journal.shared.expected.store(8, Ordering::Relaxed);
    let started = std::time::Instant::now();
    journal.append(&release("a", 33)).wait().await.unwrap();
    let first = started.elapsed();
    let started = std::time::Instant::now();
    for i in 1..4u64 {
        journal.append(&release("a", 33 + 32 * i)).wait().await.unwrap();
    }
    let next_three = started.elapsed();
    journal.close();
    assert!(
        first >= std::time::Duration::from_millis(195),
        "the writer expected eight and waited the window for them: {first:?}"
    );
    assert!(
        next_three < std::time::Duration::from_millis(150),
        "after one window the writer no longer waits: {next_three:?} for three operations"
    );
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().ino()
}

#[tokio::test]
async fn a_covered_segment_is_recycled_and_its_old_records_never_replay() {
    let dir = tempfile::tempdir().unwrap();
    let (journal, _) = rotated_after(dir.path(), &[acquire("a", 33, 90_000), acquire("b", 65, 90_000)]).await;
    journal.append(&release("a", 33)).wait().await.unwrap();
    let old = segment_path(dir.path(), 1);
    let old_inode = inode(&old);
    // The snapshot holds 1 and 2: segment 1 becomes the spare rather than being deleted.
    assert_eq!(Journal::remove_covered(dir.path(), 2), 1);
    assert!(!old.exists());
    assert!(dir.path().join("leases.journal.spare").is_file());
    // Segment 3's blocks (zeros written ahead, 64 KiB) run out: the writer moves to the spare.
    let mut seq = 4u64;
    while segments(dir.path()).len() < 2 {
        journal
            .append(&acquire("c", 97 + 32 * seq, 90_000))
            .wait()
            .await
            .unwrap();
        seq += 1;
        assert!(seq < 10_000, "the writer never moved to the spare");
    }
    let (first, newest) = segments(dir.path()).pop().unwrap();
    assert_eq!(inode(&newest), old_inode, "the spare is the recycled segment 1");
    assert!(first > 3);
    journal.close();
    // Replay from the snapshot: segment 3 and the recycled one hold exactly 3..seq-1; the
    // old records 1 and 2 still in the recycled file's tail are neither replayed nor a tear.
    let snapshot = Checkpoint {
        journal_seq: Some(2),
        ..Checkpoint::default()
    };
    let r = recover(dir.path(), Some(snapshot)).unwrap();
    assert_eq!((r.replayed as u64, r.torn, r.last_seq), (seq - 3, 0, seq - 1));
    assert!(
        leases(&r.checkpoint).iter().all(|(name, ..)| name == "crawl/c"),
        "only c's leases: a was released, b's acquire is in the snapshot's past"
    );
}

#[tokio::test]
async fn a_spare_taken_but_not_yet_written_replays_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let journal = write_all(dir.path(), 1, &[acquire("a", 33, 90_000), release("a", 33)]).await;
    journal.close();
    // A crash right after the writer renamed a recycled segment to its new name: the file
    // holds only another segment's records.
    std::fs::rename(segment_path(dir.path(), 1), segment_path(dir.path(), 100)).unwrap();
    let r = recover(dir.path(), None).unwrap();
    assert_eq!((r.replayed, r.torn, r.last_seq), (0, 0, 0));
}
