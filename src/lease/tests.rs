use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use super::{
    checkpoint::{self, CheckpointStore, FileCheckpoint},
    store::BURST,
    token::{LeaseSigner, TokenError},
    *,
};
use crate::api::test_key as key;
use crate::{api::LeasePolicy, provider::Endpoint};

const T0: u64 = 1_780_000_000_000;

fn store(shards: usize) -> (LeaseStore, Clock) {
    let clock = Clock::manual(T0);
    let store = LeaseStore::new(LeaseStoreConfig {
        shards,
        ban_cooldown: Duration::from_secs(600),
        session_idle_ttl: Duration::from_secs(60),
        restore_grace: Duration::from_secs(60),
        unconfirmed_grace: Duration::from_secs(30),
        clock: clock.clone(),
    });
    (store, clock)
}

fn target(name: &str, attrs: &[(&str, &str)], max: i32, cooldown: i32) -> LeaseTarget {
    LeaseTarget {
        key: key(name),
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 3128,
        },
        attributes: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        policy: LeasePolicy {
            max_concurrent: max,
            cooldown_seconds: cooldown,
            max_ttl_seconds: 600,
        },
        credentials: None,
    }
}

fn add_open(store: &LeaseStore, t: LeaseTarget) {
    let k = t.key.clone();
    store.upsert_proxy(t);
    store.set_admission(&k, Admission::Open).unwrap();
}

/// A store over `shards` shards holding the open proxies `names`, without attributes, each
/// with `max` slots and `cooldown` seconds of rest.
fn plain_pool(shards: usize, names: &[&str], max: i32, cooldown: i32) -> LeaseStore {
    let (store, _) = store(shards);
    for name in names {
        add_open(&store, target(name, &[], max, cooldown));
    }
    store
}

fn sel(store: &LeaseStore, text: &str) -> CompiledSelector {
    store.compile(&Selector::parse(text).unwrap())
}

fn acquire(store: &LeaseStore, selector: &CompiledSelector) -> Result<Lease, LeaseError> {
    acquire_with(store, selector, None, None)
}

fn acquire_with(
    store: &LeaseStore,
    selector: &CompiledSelector,
    domain: Option<&str>,
    session: Option<&str>,
) -> Result<Lease, LeaseError> {
    store.acquire(&AcquireRequest {
        selector,
        holder: "crawler-1",
        ttl: Duration::from_secs(60),
        target_domain: domain,
        session_key: session,
        request_id: None,
    })
}

fn name(lease: &Lease) -> &str {
    lease.id.key.name()
}

/// A store of `shards` shards with one open proxy "a" (no attributes), and the selector that
/// matches everything.
fn one_proxy(shards: usize, max: i32, cooldown: i32) -> (LeaseStore, Clock, CompiledSelector) {
    let (store, clock) = store(shards);
    add_open(&store, target("a", &[], max, cooldown));
    let all = sel(&store, "");
    (store, clock, all)
}

/// Ends `lease` as a plain success; the tests that need the error call `release` themselves.
fn release_ok(store: &LeaseStore, lease: &Lease) {
    store
        .release(&lease.id, lease.fencing_token, Outcome::Ok, None)
        .unwrap();
}

#[test]
fn only_open_proxies_are_leased() {
    let (store, _) = store(4);
    store.upsert_proxy(target("a", &[], 1, 0));
    let all = sel(&store, "");
    assert!(matches!(
        acquire(&store, &all),
        Err(LeaseError::NoProxyAvailable { .. })
    ));
    store.set_admission(&key("a"), Admission::Open).unwrap();
    let lease = acquire(&store, &all).unwrap();
    assert_eq!(name(&lease), "a");
    assert_eq!(store.active_leases(&key("a")), 1);
    store.set_admission(&key("a"), Admission::Closed).unwrap();
    // Closing keeps the lease running and renewable.
    store.renew(&lease.id, lease.fencing_token, None).unwrap();
    assert_eq!(
        store.set_admission(&key("nope"), Admission::Open),
        Err(LeaseError::UnknownProxy(key("nope")))
    );
}

#[test]
fn selector_picks_matching_proxies_only() {
    let (store, _) = store(4);
    add_open(&store, target("eu-1", &[("region", "eu"), ("tier", "dc")], 5, 0));
    add_open(&store, target("eu-2", &[("region", "eu"), ("tier", "res")], 5, 0));
    add_open(&store, target("us-1", &[("region", "us"), ("tier", "dc")], 5, 0));
    let eu_dc = sel(&store, "region=eu, tier=dc");
    for _ in 0..5 {
        assert_eq!(name(&acquire(&store, &eu_dc).unwrap()), "eu-1");
    }
    assert!(matches!(
        acquire(&store, &eu_dc),
        Err(LeaseError::NoProxyAvailable { .. })
    ));
    assert_eq!(sel(&store, "region=mars"), CompiledSelector::Unsatisfiable);
    assert_eq!(
        sel(&store, "region=eu,region=us"),
        CompiledSelector::Unsatisfiable
    );
    let listed: Vec<_> = store
        .list(&sel(&store, "tier=dc"))
        .into_iter()
        .map(|v| (v.info.key.name().to_owned(), v.availability, v.active_leases))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("eu-1".to_owned(), Availability::Busy, 5),
            ("us-1".to_owned(), Availability::Available, 0)
        ]
    );
    assert!(Selector::parse("region").is_err());
    assert!(Selector::parse("=eu").is_err());
    assert!(Selector::parse(&"a=b,".repeat(MAX_SELECTOR_TERMS + 1)).is_err());
}

#[test]
fn least_recently_used_first_with_one_shard() {
    let store = plain_pool(1, &["a", "b", "c"], 2, 0);
    let all = sel(&store, "");
    let a = acquire(&store, &all).unwrap();
    let b = acquire(&store, &all).unwrap();
    assert_eq!((name(&a), name(&b)), ("a", "b"));
    // c was never used; a and b were, a before b.
    assert_eq!(name(&acquire(&store, &all).unwrap()), "c");
    release_ok(&store, &b);
    // a: used once (oldest), then c, then b (just released).
    assert_eq!(name(&acquire(&store, &all).unwrap()), "a");
    assert_eq!(name(&acquire(&store, &all).unwrap()), "c");
    assert_eq!(name(&acquire(&store, &all).unwrap()), "b");
}

#[test]
fn fencing_tokens_increase_and_stale_ones_are_refused() {
    let (store, clock) = store(2);
    add_open(&store, target("a", &[], 1, 0));
    let lease = acquire(&store, &sel(&store, "")).unwrap();
    clock.advance(Duration::from_secs(1));
    let renewed = store.renew(&lease.id, lease.fencing_token, None).unwrap();
    assert!(renewed.fencing_token > lease.fencing_token);
    assert_eq!(renewed.expires_at_ms, T0 + 1000 + 60_000);
    assert!(
        renewed.fencing_token < 1 << 53,
        "tokens stay exact in JSON numbers"
    );
    let stale = LeaseError::StaleToken {
        presented: lease.fencing_token,
        current: renewed.fencing_token,
    };
    assert_eq!(
        store.renew(&lease.id, lease.fencing_token, None),
        Err(stale.clone())
    );
    assert_eq!(
        store.release(&lease.id, lease.fencing_token, Outcome::Ok, None),
        Err(stale)
    );
    store
        .release(&lease.id, renewed.fencing_token, Outcome::Ok, None)
        .unwrap();
    assert_eq!(
        store.release(&lease.id, renewed.fencing_token, Outcome::Ok, None),
        Err(LeaseError::NotFound)
    );
    // The next lease on the same proxy gets a greater token still.
    let next = acquire(&store, &sel(&store, "")).unwrap();
    assert!(next.fencing_token > renewed.fencing_token);
}

#[test]
fn renewal_is_capped_by_max_ttl() {
    let (store, _) = store(1);
    add_open(&store, target("a", &[], 1, 0));
    let lease = store
        .acquire(&AcquireRequest {
            selector: &sel(&store, ""),
            holder: "h",
            ttl: Duration::from_secs(100_000),
            target_domain: None,
            session_key: None,
            request_id: None,
        })
        .unwrap();
    assert_eq!(lease.expires_at_ms, T0 + 600_000);
    let r = store
        .renew(&lease.id, lease.fencing_token, Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(r.expires_at_ms, T0 + 5_000);
}

#[test]
fn cooldown_after_release() {
    let (store, clock, all) = one_proxy(1, 1, 30);
    let lease = acquire(&store, &all).unwrap();
    release_ok(&store, &lease);
    match acquire(&store, &all) {
        Err(LeaseError::NoProxyAvailable { retry_after }) => assert_eq!(retry_after, Duration::from_secs(30)),
        other => panic!("expected cooldown, got {other:?}"),
    }
    assert_eq!(store.list(&all)[0].availability, Availability::CoolingDown);
    clock.advance(Duration::from_secs(30));
    assert_eq!(name(&acquire(&store, &all).unwrap()), "a");
}

#[test]
fn banned_outcome_cools_down_for_that_domain_only() {
    let (store, clock, all) = one_proxy(1, 1, 0);
    let lease = acquire_with(&store, &all, Some("Shop.Example."), None).unwrap();
    store
        .release(&lease.id, lease.fencing_token, Outcome::Banned, None)
        .unwrap();
    assert!(matches!(
        acquire_with(&store, &all, Some("shop.example"), None),
        Err(LeaseError::NoProxyAvailable { .. })
    ));
    let other = acquire_with(&store, &all, Some("news.example"), None).unwrap();
    release_ok(&store, &other);
    let none = acquire(&store, &all).unwrap();
    // A ban needs a domain: the lease has none and the release names none.
    assert_eq!(
        store.release(&none.id, none.fencing_token, Outcome::Banned, None),
        Err(LeaseError::BanNeedsDomain)
    );
    store
        .release(
            &none.id,
            none.fencing_token,
            Outcome::Banned,
            Some("news.example"),
        )
        .unwrap();
    assert!(acquire_with(&store, &all, Some("news.example"), None).is_err());
    clock.advance(Duration::from_secs(600));
    let again = acquire_with(&store, &all, Some("shop.example"), None).unwrap();
    assert_eq!(name(&again), "a");
}

#[test]
fn a_ban_may_last_a_time_of_its_own() {
    let (store, clock, all) = one_proxy(1, 1, 0);
    let lease = acquire_with(&store, &all, Some("shop.example"), None).unwrap();
    let now = store.now_ms();
    let released = store
        .release_banning_at(
            &lease.id,
            lease.fencing_token,
            Outcome::Banned,
            None,
            Some(Duration::from_secs(5)),
            now,
        )
        .unwrap();
    assert_eq!(released.ban.map(|b| b.until_ms), Some(now + 5_000));
    assert!(acquire_with(&store, &all, Some("shop.example"), None).is_err());
    clock.advance(Duration::from_secs(5));
    // Rested for its own 5 s, not the store's 600.
    let again = acquire_with(&store, &all, Some("shop.example"), None).unwrap();
    release_ok(&store, &again);
}

#[test]
fn sticky_sessions_keep_their_proxy_while_eligible() {
    let store = plain_pool(4, &["a", "b", "c", "d"], 1, 60);
    let all = sel(&store, "");
    let first = acquire_with(&store, &all, None, Some("login-42")).unwrap();
    let bound = first.id.key.clone();
    release_ok(&store, &first);
    // Its own post-release cooldown does not apply to the session.
    for _ in 0..3 {
        let again = acquire_with(&store, &all, None, Some("login-42")).unwrap();
        assert_eq!(again.id.key, bound);
        release_ok(&store, &again);
    }
    // Others do wait for the cooldown.
    let others: Vec<_> = (0..3).map(|_| acquire(&store, &all).unwrap().id.key).collect();
    assert!(!others.contains(&bound));
    // Once the bound proxy leaves rotation, the session moves and stays on its new proxy.
    store.set_admission(&bound, Admission::Closed).unwrap();
    for n in ["a", "b", "c", "d"] {
        if key(n) != bound {
            store.set_admission(&key(n), Admission::Closed).unwrap();
        }
    }
    let spare = key("e");
    add_open(&store, target("e", &[], 1, 60));
    let moved = acquire_with(&store, &all, None, Some("login-42")).unwrap();
    assert_eq!(moved.id.key, spare);
    release_ok(&store, &moved);
    store.set_admission(&bound, Admission::Open).unwrap();
    assert_eq!(
        acquire_with(&store, &all, None, Some("login-42")).unwrap().id.key,
        spare
    );
}

#[test]
fn concurrent_clients_never_exceed_max_concurrent() {
    let (store, _) = store(4);
    const PROXIES: usize = 8;
    const MAX: usize = 3;
    let names: Vec<String> = (0..PROXIES).map(|i| format!("p{i}")).collect();
    for n in &names {
        add_open(&store, target(n, &[("pool", "x")], MAX as i32, 0));
    }
    let in_use: Arc<Vec<AtomicUsize>> = Arc::new((0..PROXIES).map(|_| AtomicUsize::new(0)).collect());
    let violated = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (store, in_use, violated, granted) =
                (store.clone(), in_use.clone(), violated.clone(), granted.clone());
            std::thread::spawn(move || {
                let selector = store.compile(&Selector::parse("pool=x").unwrap());
                let mut held: Vec<(Lease, usize)> = Vec::new();
                for i in 0..20_000usize {
                    // Hold up to 4 leases, release in varying order.
                    if held.len() < 4 && (i + t) % 3 != 0 {
                        if let Ok(lease) = acquire(&store, &selector) {
                            let idx: usize = lease.id.key.name()[1..].parse().unwrap();
                            if in_use[idx].fetch_add(1, Ordering::SeqCst) + 1 > MAX {
                                violated.store(true, Ordering::SeqCst);
                            }
                            granted.fetch_add(1, Ordering::Relaxed);
                            held.push((lease, idx));
                        }
                    } else if !held.is_empty() {
                        let (lease, idx) = held.swap_remove(i % held.len());
                        // Count down before the store frees the slot.
                        in_use[idx].fetch_sub(1, Ordering::SeqCst);
                        release_ok(&store, &lease);
                    }
                }
                for (lease, idx) in held {
                    in_use[idx].fetch_sub(1, Ordering::SeqCst);
                    release_ok(&store, &lease);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(!violated.load(Ordering::SeqCst), "a proxy exceeded maxConcurrent");
    assert!(
        granted.load(Ordering::Relaxed) > 10_000,
        "the test must actually contend"
    );
    assert_eq!(store.active_total(), 0);
}

#[test]
fn renewals_say_when_the_proxy_left_rotation() {
    let (store, _, all) = one_proxy(2, 2, 0);
    let lease = acquire(&store, &all).unwrap();
    let renewed = store.renew(&lease.id, lease.fencing_token, None).unwrap();
    assert!(!renewed.out_of_rotation);
    // Health checks fail: the engine closes it. The lease runs on, and its renewals say so.
    store.set_admission(&key("a"), Admission::Closed).unwrap();
    store.set_admission(&key("a"), Admission::Closed).unwrap();
    let renewed = store.renew(&lease.id, renewed.fencing_token, None).unwrap();
    assert!(renewed.out_of_rotation);
    // Healthy again: back in rotation.
    store.set_admission(&key("a"), Admission::Open).unwrap();
    let renewed = store.renew(&lease.id, renewed.fencing_token, None).unwrap();
    assert!(!renewed.out_of_rotation);
    // A proxy that was never open (as after a restart, until its first probe) is not out of
    // rotation: that says nothing about the instance.
    let (fresh, _) = self::store(2);
    fresh.upsert_proxy(target("b", &[], 1, 0));
    fresh.set_admission(&key("b"), Admission::Closed).unwrap();
    fresh.set_admission(&key("b"), Admission::Open).unwrap();
    let lease = acquire(&fresh, &sel(&fresh, "")).unwrap();
    assert!(
        !fresh
            .renew(&lease.id, lease.fencing_token, None)
            .unwrap()
            .out_of_rotation
    );
}

/// Whoever waits for a drain is told when its last lease ends, by a release or an expiry, once,
/// and never while leases remain or for a proxy that is not draining.
#[test]
fn the_end_of_a_drain_is_told_by_the_release_or_expiry_that_ends_it() {
    let (store, clock, all) = one_proxy(3, 3, 0);
    let told = Arc::new(std::sync::Mutex::new(Vec::new()));
    store.on_drained({
        let told = told.clone();
        Arc::new(move |key: &ProxyKey| told.lock().unwrap().push(key.clone()))
    });
    let (l1, l2) = (acquire(&store, &all).unwrap(), acquire(&store, &all).unwrap());
    release_ok(&store, &l1);
    assert!(told.lock().unwrap().is_empty(), "not draining");
    let l3 = acquire(&store, &all).unwrap();
    assert_eq!(store.drain(&key("a")), DrainStatus::Pending { active: 2 });
    release_ok(&store, &l2);
    assert!(told.lock().unwrap().is_empty(), "a lease remains");
    release_ok(&store, &l3);
    assert_eq!(*told.lock().unwrap(), [key("a")]);

    // Reopened, leased, drained again: this time the lease expires.
    store.set_admission(&key("a"), Admission::Open).unwrap();
    acquire(&store, &all).unwrap();
    assert_eq!(store.drain(&key("a")), DrainStatus::Pending { active: 1 });
    clock.advance(Duration::from_secs(61));
    store.reap();
    assert_eq!(*told.lock().unwrap(), [key("a"), key("a")]);
    assert_eq!(store.drain(&key("a")), DrainStatus::Drained);
}

#[test]
fn drain_refuses_renewals_and_reports_completion() {
    let (store, _, all) = one_proxy(2, 2, 0);
    let l1 = acquire(&store, &all).unwrap();
    assert_eq!(store.drain(&key("a")), DrainStatus::Pending { active: 1 });
    assert!(acquire(&store, &all).is_err());
    assert_eq!(
        store.renew(&l1.id, l1.fencing_token, None),
        Err(LeaseError::Draining)
    );
    release_ok(&store, &l1);
    assert_eq!(store.drain(&key("a")), DrainStatus::Drained);
    assert_eq!(store.drain(&key("unknown")), DrainStatus::Drained);
    store.set_admission(&key("a"), Admission::Open).unwrap();
    assert!(acquire(&store, &all).is_ok());
}

/// A lease that ends at its expiry, whether the reaper or an acquire finds it expired, is
/// handed out once by `take_expired` with its holder and how long it was held (grant to
/// expiry), so usage can count the lease-seconds of clients that never release.
#[test]
fn leases_that_expire_are_taken_once_with_their_holder_and_time() {
    let (store, clock, all) = one_proxy(2, 2, 0);
    let first = acquire(&store, &all).unwrap();
    clock.advance(Duration::from_secs(10));
    let _second = acquire(&store, &all).unwrap();
    release_ok(&store, &first);
    assert!(store.take_expired().is_empty(), "a release is no expiry");
    let _third = acquire(&store, &all).unwrap();
    clock.advance(Duration::from_secs(61));
    // An acquire may find the expired ones on its way, the reaper finds the rest.
    let _fourth = acquire(&store, &all).unwrap();
    store.reap();
    let mut ended = store.take_expired();
    ended.sort_by_key(|e| e.held_ms);
    assert_eq!(
        ended,
        [
            ExpiredLease {
                holder: "crawler-1".to_owned(),
                held_ms: 60_000
            },
            ExpiredLease {
                holder: "crawler-1".to_owned(),
                held_ms: 60_000
            },
        ]
    );
    assert!(store.take_expired().is_empty(), "taken once");
}

#[test]
fn revoke_and_remove_drop_leases() {
    let (store, _, all) = one_proxy(2, 3, 0);
    let l1 = acquire(&store, &all).unwrap();
    let _l2 = acquire(&store, &all).unwrap();
    assert_eq!(store.revoke_all(&key("a")), 2);
    assert_eq!(store.active_leases(&key("a")), 0);
    assert_eq!(
        store.renew(&l1.id, l1.fencing_token, None),
        Err(LeaseError::NotFound)
    );
    let l3 = acquire(&store, &all).unwrap();
    store.remove_proxy(&key("a"));
    assert_eq!(store.active_total(), 0);
    assert_eq!(
        store.release(&l3.id, l3.fencing_token, Outcome::Ok, None),
        Err(LeaseError::NotFound)
    );
    assert_eq!(store.revoke_all(&key("a")), 0);
}

#[test]
fn expired_leases_are_reaped_and_free_their_slot() {
    let (store, clock, all) = one_proxy(2, 1, 0);
    let lease = acquire(&store, &all).unwrap();
    assert!(acquire(&store, &all).is_err());
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.active_leases(&key("a")), 0);
    assert_eq!(store.reap(), 1);
    assert_eq!(store.active_total(), 0);
    assert_eq!(
        store.renew(&lease.id, lease.fencing_token, None),
        Err(LeaseError::NotFound)
    );
    assert!(acquire(&store, &all).is_ok());
}

#[test]
fn upsert_updates_in_place_and_keeps_leases() {
    let (store, _) = store(1);
    add_open(&store, target("a", &[("region", "eu")], 1, 0));
    let lease = acquire(&store, &sel(&store, "region=eu")).unwrap();
    store.upsert_proxy(target("a", &[("region", "us")], 2, 0));
    assert_eq!(store.active_leases(&key("a")), 1);
    assert!(acquire(&store, &sel(&store, "region=eu")).is_err());
    let second = acquire(&store, &sel(&store, "region=us")).unwrap();
    assert_eq!(name(&second), "a");
    release_ok(&store, &lease);
    // A lower limit than the active count stops new leases only.
    store.upsert_proxy(target("a", &[("region", "us")], 1, 0));
    assert_eq!(store.active_leases(&key("a")), 1);
    assert!(acquire(&store, &sel(&store, "")).is_err());
}

#[tokio::test]
async fn leases_survive_a_restart_through_the_file_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let file = FileCheckpoint::new(dir.path().join("leases.json"));
    assert_eq!(file.load().await.unwrap(), None);
    let (before, clock) = store(4);
    add_open(&before, target("a", &[("name", "a")], 2, 30));
    add_open(&before, target("b", &[("name", "b")], 1, 0));
    let on_a = sel(&before, "name=a");
    let on_b = sel(&before, "name=b");
    let l1 = acquire_with(&before, &on_a, Some("shop.example"), Some("s1")).unwrap();
    let l2 = acquire(&before, &on_a).unwrap();
    let l3 = acquire(&before, &on_b).unwrap();
    let renewed = before.renew(&l1.id, l1.fencing_token, None).unwrap();
    before
        .release(&l3.id, l3.fencing_token, Outcome::Banned, Some("news.example"))
        .unwrap();
    assert!(before.take_dirty());
    file.save(&before.checkpoint()).await.unwrap();
    assert!(!before.take_dirty());
    drop(before);

    let after = LeaseStore::new(LeaseStoreConfig {
        shards: 3,
        clock: clock.clone(),
        ..LeaseStoreConfig::default()
    });
    after.restore(&file.load().await.unwrap().unwrap());
    // Renew and release work before the controller configures the proxies again...
    let r = after.renew(&l1.id, renewed.fencing_token, None).unwrap();
    assert!(r.fencing_token > renewed.fencing_token);
    assert_eq!(
        after.renew(&l1.id, renewed.fencing_token, None),
        Err(LeaseError::StaleToken {
            presented: renewed.fencing_token,
            current: r.fencing_token
        })
    );
    // ...but nothing new is leased until the controller has seen each proxy pass a probe in
    // this process (it may have died while the checkpoint aged)...
    after.upsert_proxy(target("a", &[("name", "a")], 2, 30));
    after.upsert_proxy(target("b", &[("name", "b")], 1, 0));
    assert_eq!(after.active_total(), 2);
    let all = sel(&after, "");
    assert!(
        acquire(&after, &all).is_err(),
        "restored proxies stay closed until verified"
    );
    // ...and once it opens them, limits count the restored leases.
    after.set_admission(&key("a"), Admission::Open).unwrap();
    after.set_admission(&key("b"), Admission::Open).unwrap();
    let l4 = acquire(&after, &all).unwrap();
    assert_eq!(name(&l4), "b", "a is full with its two restored leases");
    assert!(acquire(&after, &all).is_err());
    release_ok(&after, &l4);
    assert!(
        acquire_with(&after, &all, Some("news.example"), None).is_err(),
        "the ban on b survived"
    );
    release_ok(&after, &l2);
    // The sticky session is still bound to a (which has a free slot again).
    let sticky = acquire_with(&after, &all, None, Some("s1")).unwrap();
    assert_eq!(name(&sticky), "a");
    // Tokens keep increasing across the restart.
    assert!(l4.fencing_token > r.fencing_token && r.fencing_token > l3.fencing_token);
}

#[test]
fn signed_claims_bring_back_leases_the_checkpoint_missed() {
    let secret = LeaseSigner::generate_secret();
    let signer = LeaseSigner::new(&secret).unwrap();
    let (leader1, clock) = store(4);
    add_open(&leader1, target("a", &[], 1, 0));
    add_open(&leader1, target("b", &[], 2, 0));
    let all = sel(&leader1, "");
    let known = acquire(&leader1, &all).unwrap();
    let released = acquire(&leader1, &all).unwrap();
    release_ok(&leader1, &released);
    let cp = leader1.checkpoint();
    // Issued after the checkpoint: the next leader has no record of it.
    let missed = acquire_with(&leader1, &all, Some("shop.example"), None).unwrap();
    let missed_id = signer.sign(&missed.claim("crawler-1", Some("shop.example"), None));
    let renewed = leader1.renew(&missed.id, missed.fencing_token, None).unwrap();
    drop(leader1);

    clock.advance(Duration::from_secs(5));
    let leader2 = store_with_clock(&clock);
    leader2.restore(&cp);
    // The controller of the new leader verifies and opens the proxies again.
    add_open(&leader2, target("a", &[], 1, 0));
    add_open(&leader2, target("b", &[], 2, 0));
    let claim = LeaseSigner::new(&secret).unwrap().verify(&missed_id).unwrap();
    assert_eq!(
        leader2.release(&claim.id, renewed.fencing_token, Outcome::Ok, None),
        Err(LeaseError::NotFound)
    );
    leader2.reinstate(&claim, renewed.fencing_token).unwrap();
    assert_eq!(
        leader2.active_total(),
        2,
        "the known lease and the reinstated one"
    );
    // Limits count it: the other proxy has one slot left at most.
    let mut more = 0;
    while acquire(&leader2, &sel(&leader2, "")).is_ok() {
        more += 1;
    }
    assert_eq!(more, 1, "3 slots in all, 2 taken");
    leader2
        .renew(&claim.id, renewed.fencing_token, None)
        .expect("the reinstated lease renews");
    // A lease the checkpoint knew as released is not brought back.
    let released_claim = released.claim("crawler-1", None, None);
    assert_eq!(
        leader2.reinstate(&released_claim, released.fencing_token),
        Err(LeaseError::NotFound)
    );
    // The known one renews as usual.
    leader2.renew(&known.id, known.fencing_token, None).unwrap();
    leader2.revoke_all(&claim.id.key);
    assert_eq!(
        leader2.reinstate(&claim, renewed.fencing_token),
        Err(LeaseError::NotFound),
        "revoked claims stay dead"
    );
}

#[test]
fn a_reinstated_claim_is_honoured_once() {
    let (leader1, clock) = store(1);
    add_open(&leader1, target("a", &[], 1, 0));
    let cp = leader1.checkpoint();
    let missed = acquire(&leader1, &sel(&leader1, "")).unwrap();
    let claim = missed.claim("h", None, None);
    let leader2 = store_with_clock(&clock);
    leader2.restore(&cp);
    leader2.upsert_proxy(target("a", &[], 1, 0));
    leader2.reinstate(&claim, missed.fencing_token).unwrap();
    leader2
        .release(&claim.id, missed.fencing_token, Outcome::Ok, None)
        .unwrap();
    assert_eq!(
        leader2.reinstate(&claim, missed.fencing_token),
        Err(LeaseError::NotFound)
    );
    // A lease issued by this store itself is never "missed".
    leader2.set_admission(&key("a"), Admission::Open).unwrap();
    let own = acquire(&leader2, &sel(&leader2, "")).unwrap();
    release_ok(&leader2, &own);
    assert_eq!(
        leader2.reinstate(&own.claim("h", None, None), own.fencing_token),
        Err(LeaseError::NotFound)
    );
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        leader2.reinstate(&claim, 0),
        Err(LeaseError::NotFound),
        "expired claim"
    );
}

fn store_with_clock(clock: &Clock) -> LeaseStore {
    LeaseStore::new(LeaseStoreConfig {
        shards: 4,
        clock: clock.clone(),
        ..LeaseStoreConfig::default()
    })
}

/// The shortest ID a lease can have (one-character names, no domain or session) is still longer
/// than the head `presented` decodes, and its head reads back.
#[test]
fn the_shortest_lease_id_still_has_its_head_read() {
    let hint = LeaseHint {
        shard: 3,
        slot: 70_000,
        generation: 9,
    };
    let id = LeaseSigner::new(&[9u8; 32]).unwrap().sign(&LeaseClaim {
        id: LeaseId {
            key: ProxyKey::new("a", "b"),
            first_token: u64::MAX,
            hint,
        },
        holder: "h".into(),
        acquired_at_ms: 0,
        expires_at_ms: 1,
        target_domain: None,
        session_key: None,
    });
    assert_eq!(id.len(), 84);
    let signer = LeaseSigner::new(&[9u8; 32]).unwrap();
    let presented = signer.presented(&id).expect("its head reads");
    assert_eq!((presented.hint, presented.first_token), (hint, u64::MAX));
    assert!(signer.presented(&id[..39]).is_none(), "shorter than the head");
}

/// An ID is one text: another base64 spelling of its bytes (nonzero bits after the last whole
/// byte, which a lenient decoder drops) is refused, not taken for the same lease.
#[test]
fn a_lease_id_spelled_with_trailing_bits_is_refused() {
    let signer = LeaseSigner::new(&[9u8; 32]).unwrap();
    let mut checked = 0;
    for holder in ["h", "hh", "hhh"] {
        let id = signer.sign(&LeaseClaim {
            id: LeaseId {
                key: ProxyKey::new("a", "b"),
                first_token: 5,
                hint: LeaseHint::default(),
            },
            holder: holder.into(),
            acquired_at_ms: 0,
            expires_at_ms: 1,
            target_domain: None,
            session_key: None,
        });
        assert!(signer.verify(&id).is_ok());
        if id.len().is_multiple_of(4) {
            continue;
        }
        // The last character carries bits past the payload's end: set one of them.
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let last = ALPHABET
            .iter()
            .position(|&c| c == *id.as_bytes().last().unwrap())
            .unwrap();
        let other = format!("{}{}", &id[..id.len() - 1], ALPHABET[last | 1] as char);
        assert_ne!(other, id);
        assert!(
            matches!(signer.verify(&other), Err(TokenError::Malformed)),
            "{other}"
        );
        checked += 1;
    }
    assert!(checked >= 2, "IDs of two lengths with trailing bits");
}

#[test]
fn signer_rejects_tampered_foreign_and_garbage_ids() {
    let signer = LeaseSigner::new(&[7u8; 32]).unwrap();
    let (store, _) = store(2);
    add_open(&store, target("a", &[], 1, 0));
    let lease = acquire(&store, &sel(&store, "")).unwrap();
    let claim = lease.claim("crawler-ü", Some("shop.example"), Some("s"));
    let id = signer.sign(&claim);
    assert_eq!(signer.verify(&id).unwrap(), claim);
    let mut bytes = id.clone().into_bytes();
    bytes[10] = if bytes[10] == b'A' { b'B' } else { b'A' };
    assert!(matches!(
        signer.verify(std::str::from_utf8(&bytes).unwrap()),
        Err(TokenError::BadSignature | TokenError::Malformed)
    ));
    let other = LeaseSigner::new(&[8u8; 32]).unwrap();
    assert!(matches!(other.verify(&id), Err(TokenError::BadSignature)));
    for garbage in ["", "x", "!!!!", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"] {
        assert!(signer.verify(garbage).is_err(), "{garbage:?}");
    }
    assert!(signer.verify(&"A".repeat(5000)).is_err());
    assert!(matches!(
        LeaseSigner::new(b"short"),
        Err(TokenError::SecretTooShort)
    ));
}

/// IDs signed with HMAC-SHA256 (format 1, before issue 25) still verify, so leases granted
/// before an upgrade are recognised after it; the format byte binds the MAC (an ID cannot be
/// passed off as the other format), and an unknown format is refused.
#[test]
fn lease_ids_of_the_hmac_format_still_verify_and_formats_do_not_mix() {
    use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
    let secret = [7u8; 32];
    let signer = LeaseSigner::new(&secret).unwrap();
    let (store, _) = store(2);
    add_open(&store, target("a", &[], 1, 0));
    let claim = acquire(&store, &sel(&store, ""))
        .unwrap()
        .claim("crawler", Some("shop.example"), None);
    let new = URL_SAFE_NO_PAD.decode(signer.sign(&claim)).unwrap();
    assert_eq!(new[0], 2, "new IDs are format 2 (BLAKE3)");
    let payload = &new[..new.len() - 16];
    let with_format = |format: u8, hmac_tag: bool| {
        let mut bytes = payload.to_vec();
        bytes[0] = format;
        let tag: Vec<u8> = if hmac_tag {
            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
            ring::hmac::sign(&key, &bytes).as_ref()[..16].to_vec()
        } else {
            let key = blake3::derive_key("egress-proxies-operator 2026-12-04 lease ID tag", &secret);
            blake3::keyed_hash(&key, &bytes).as_bytes()[..16].to_vec()
        };
        bytes.extend_from_slice(&tag);
        URL_SAFE_NO_PAD.encode(bytes)
    };
    assert_eq!(
        signer.verify(&with_format(1, true)).unwrap(),
        claim,
        "format 1, HMAC"
    );
    assert_eq!(
        signer.verify(&with_format(2, false)).unwrap(),
        claim,
        "format 2, BLAKE3"
    );
    assert!(matches!(
        signer.verify(&with_format(1, false)),
        Err(TokenError::BadSignature)
    ));
    assert!(matches!(
        signer.verify(&with_format(2, true)),
        Err(TokenError::BadSignature)
    ));
    assert!(signer.verify(&with_format(3, false)).is_err());
    assert!(signer.presented(&with_format(3, false)).is_none());
    assert!(signer.presented(&with_format(1, true)).is_some());
}

#[test]
fn signer_key_file_is_created_once_and_private() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lease-key");
    let first = LeaseSigner::load_or_create(&path).unwrap();
    let second = LeaseSigner::load_or_create(&path).unwrap();
    let (store, _) = store(1);
    add_open(&store, target("a", &[], 1, 0));
    let claim = acquire(&store, &sel(&store, "")).unwrap().claim("h", None, None);
    assert_eq!(second.verify(&first.sign(&claim)).unwrap(), claim);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

#[test]
fn checkpoint_chunks_round_trip_under_the_size_limit() {
    let (store, _) = store(4);
    let all = sel(&store, "");
    for i in 0..200 {
        add_open(&store, target(&format!("p{i}"), &[("n", &i.to_string())], 1, 0));
    }
    let compiled = store.compile(&Selector::default());
    for i in 0..150 {
        let session = format!("session-{i}");
        acquire_with(&store, &compiled, Some("shop.example"), Some(&session)).unwrap();
    }
    let _ = all;
    let cp = store.checkpoint();
    assert_eq!(cp.lease_count(), 150);
    let whole = checkpoint::encode(&cp).len();
    let chunks = checkpoint::encode_chunks(&cp, 4096).unwrap();
    assert!(
        chunks.len() >= whole / 4096,
        "{} chunks for {whole} bytes",
        chunks.len()
    );
    assert!(chunks.iter().all(|c| c.len() <= 4096));
    let mut back = checkpoint::decode_chunks(&chunks).unwrap().unwrap();
    back.proxies.sort_by(|a, b| a.key.cmp(&b.key));
    back.sessions.sort_by(|a, b| a.session_key.cmp(&b.session_key));
    assert_eq!(back, cp);
    assert_eq!(checkpoint::decode_chunks::<String>(&[]).unwrap(), None);
    assert!(checkpoint::encode_chunks(&cp, 64).is_err());
    assert!(checkpoint::decode(br#"{"version":99,"savedAtMs":0,"tokenHwm":{}}"#).is_err());
}

#[tokio::test]
async fn maintenance_reaps_and_saves_until_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let file = Arc::new(FileCheckpoint::new(dir.path().join("leases.json")));
    let (store, clock) = store(2);
    add_open(&store, target("a", &[], 1, 0));
    let lease = acquire(&store, &sel(&store, "")).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(checkpoint::maintenance(
        store.clone(),
        Some(file.clone() as Arc<dyn CheckpointStore>),
        checkpoint::MaintenanceConfig {
            reap_interval: Duration::from_millis(10),
            checkpoint_interval: Duration::from_millis(10),
            ..Default::default()
        },
        async {
            let _ = stopped.await;
        },
    ));
    // Poll until the periodic save shows the lease.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(cp)) = file.load().await
            && cp.lease_count() == 1
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no checkpoint with the lease"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    clock.advance(Duration::from_secs(120));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.active_total() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "lease not reaped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    let cp = file.load().await.unwrap().unwrap();
    assert_eq!(cp.lease_count(), 0);
    assert!(cp.token_hwm.values().any(|t| *t >= lease.fencing_token));
}

#[test]
fn proxy_urls_carry_credentials_only_where_asked() {
    let mut t = target("a", &[], 1, 0);
    t.credentials = Some(crate::provider::Credentials {
        username: "crawl er".into(),
        password: "p@ss:word".into(),
    });
    let info = ProxyInfo::new(&t);
    assert_eq!(info.url(), "http://127.0.0.1:3128");
    assert_eq!(
        info.url_with_credentials(),
        "http://crawl%20er:p%40ss%3Aword@127.0.0.1:3128"
    );
    assert!(!format!("{info:?}").contains("word"));
    let key: ProxyKey = "ns/name".parse().unwrap();
    assert_eq!(
        (key.namespace(), key.name(), key.to_string().as_str()),
        ("ns", "name", "ns/name")
    );
    assert!("ns/".parse::<ProxyKey>().is_err());
    assert!("a/b/c".parse::<ProxyKey>().is_err());
    let _: BTreeMap<ProxyKey, ()> = BTreeMap::new();
}

#[test]
fn the_lease_executor_interface_drives_the_store() {
    let (store, _) = store(2);
    let key = ProxyKey::new("crawl", "a");
    let control: &dyn LeaseControl = &store;
    control.upsert(LeaseTarget {
        key: key.clone(),
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 3128,
        },
        attributes: BTreeMap::from([("region".to_owned(), "eu".to_owned())]).into(),
        policy: LeasePolicy {
            max_concurrent: 2,
            cooldown_seconds: 0,
            max_ttl_seconds: 60,
        },
        credentials: None,
    });
    let eu = sel(&store, "region=eu");
    assert!(acquire(&store, &eu).is_err(), "closed until enabled");
    control.set_admission(&key, true);
    let lease = acquire(&store, &eu).unwrap();
    assert_eq!(lease.id.key, ProxyKey::new("crawl", "a"));
    assert_eq!(control.active(&key), 1);
    assert_eq!(control.drain(&key), DrainStatus::Pending { active: 1 });
    assert_eq!(control.revoke_all(&key), 1);
    assert_eq!(control.drain(&key), DrainStatus::Drained);
    control.remove(&key);
    assert_eq!(store.proxy_count(), 0);
    // Unknown proxies are no error for the executor.
    control.set_admission(&key, true);
    assert_eq!(control.active(&key), 0);
}

#[test]
fn a_combination_selector_is_indexed_and_keeps_lru_order_among_its_matches() {
    let (store, _) = store(1);
    for (n, region, tier) in [
        ("a", "eu", "dc"),
        ("b", "eu", "res"),
        ("c", "eu", "dc"),
        ("d", "us", "dc"),
    ] {
        add_open(&store, target(n, &[("region", region), ("tier", tier)], 1, 0));
    }
    let all = sel(&store, "");
    let a = acquire(&store, &all).unwrap();
    assert_eq!(name(&a), "a");
    release_ok(&store, &a);
    // Indexed after the proxies exist: its list takes them in their LRU order (c before a).
    let eu_dc = sel(&store, "tier=dc,region=eu");
    assert!(matches!(eu_dc, CompiledSelector::Indexed { .. }), "{eu_dc:?}");
    assert_eq!(
        sel(&store, "region=eu,tier=dc"),
        eu_dc,
        "same combination, same list"
    );
    let c = acquire(&store, &eu_dc).unwrap();
    assert_eq!(name(&c), "c");
    // A proxy added later, and one whose attributes change to match, join the list.
    add_open(&store, target("e", &[("region", "eu"), ("tier", "dc")], 1, 0));
    add_open(&store, target("b", &[("region", "eu"), ("tier", "dc")], 1, 0));
    let picked: Vec<_> = (0..3)
        .map(|_| name(&acquire(&store, &eu_dc).unwrap()).to_owned())
        .collect();
    assert_eq!(picked, ["a", "e", "b"]);
    assert!(matches!(
        acquire(&store, &eu_dc),
        Err(LeaseError::NoProxyAvailable { .. })
    ));
    // A proxy whose attributes stop matching leaves it.
    release_ok(&store, &c);
    add_open(&store, target("c", &[("region", "us"), ("tier", "dc")], 1, 0));
    assert!(matches!(
        acquire(&store, &eu_dc),
        Err(LeaseError::NoProxyAvailable { .. })
    ));
    assert_eq!(name(&acquire(&store, &sel(&store, "region=us")).unwrap()), "d");
}

#[test]
fn combinations_beyond_the_cap_are_served_unindexed() {
    let (store, _) = store(2);
    for i in 0..=MAX_INDEXED_COMBINATIONS {
        add_open(
            &store,
            target(&format!("p{i}"), &[("n", &i.to_string()), ("tier", "dc")], 1, 0),
        );
    }
    for i in 0..MAX_INDEXED_COMBINATIONS {
        assert!(matches!(
            sel(&store, &format!("n={i},tier=dc")),
            CompiledSelector::Indexed { .. }
        ));
    }
    let last = sel(&store, &format!("n={MAX_INDEXED_COMBINATIONS},tier=dc"));
    assert!(matches!(last, CompiledSelector::Pairs(_)), "{last:?}");
    let lease = acquire(&store, &last).unwrap();
    assert_eq!(name(&lease), format!("p{MAX_INDEXED_COMBINATIONS}"));
}

/// Random operations on a one-shard store against a plain model: every acquire must grant the
/// least recently (re)linked proxy among the open, free ones that match, whether the selector
/// is indexed, walked by its rarest term, or empty.
#[test]
fn acquire_agrees_with_a_plain_lru_model_under_random_operations() {
    #[derive(Clone, Debug)]
    struct Model {
        region: &'static str,
        tier: &'static str,
        open: bool,
        lease: Option<Lease>,
        /// When the proxy last went to the lists' tail.
        seq: u64,
    }
    const REGIONS: [&str; 3] = ["eu", "us", "ap"];
    const TIERS: [&str; 2] = ["dc", "res"];
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    for round in 0..20 {
        let (store, _) = store(1);
        let mut model: BTreeMap<String, Model> = BTreeMap::new();
        let mut seq = 0u64;
        let selectors = [
            "",
            "region=eu",
            "tier=dc",
            "region=eu,tier=dc",
            "region=us,tier=res",
        ];
        for step in 0..400 {
            let n = format!("p{}", rng.usize(..12));
            let context = format!("round {round} step {step}");
            match rng.u8(..5) {
                0 => {
                    let (region, tier) = (REGIONS[rng.usize(..3)], TIERS[rng.usize(..2)]);
                    store.upsert_proxy(target(&n, &[("region", region), ("tier", tier)], 1, 0));
                    let m = model.entry(n.clone()).or_insert(Model {
                        region,
                        tier,
                        open: false,
                        lease: None,
                        seq: 0,
                    });
                    let linked = m.open && m.lease.is_none();
                    if (m.region, m.tier) != (region, tier) && linked {
                        seq += 1;
                        m.seq = seq;
                    }
                    (m.region, m.tier) = (region, tier);
                }
                1 => {
                    let Some(m) = model.get_mut(&n) else { continue };
                    let open = rng.bool();
                    let admission = if open { Admission::Open } else { Admission::Closed };
                    store.set_admission(&key(&n), admission).unwrap();
                    if open && !m.open && m.lease.is_none() {
                        seq += 1;
                        m.seq = seq;
                    }
                    m.open = open;
                }
                2 => {
                    let Some(m) = model.get_mut(&n) else { continue };
                    let Some(lease) = m.lease.take() else { continue };
                    release_ok(&store, &lease);
                    if m.open {
                        seq += 1;
                        m.seq = seq;
                    }
                }
                _ => {
                    let text = selectors[rng.usize(..selectors.len())];
                    let wanted = Selector::parse(text).unwrap();
                    let expected = model
                        .iter()
                        .filter(|(_, m)| m.open && m.lease.is_none())
                        .filter(|(_, m)| {
                            let attrs = BTreeMap::from([
                                ("region".to_owned(), m.region.to_owned()),
                                ("tier".to_owned(), m.tier.to_owned()),
                            ]);
                            wanted.matches(&attrs)
                        })
                        .min_by_key(|(_, m)| m.seq)
                        .map(|(n, _)| n.clone());
                    let compiled = sel(&store, text);
                    // The same selector walked unindexed must agree too.
                    let unindexed = match &compiled {
                        CompiledSelector::Indexed { terms, .. } => CompiledSelector::Pairs(terms.clone()),
                        other => other.clone(),
                    };
                    let selector = if rng.bool() { compiled } else { unindexed };
                    match (acquire(&store, &selector), expected) {
                        (Ok(lease), Some(expected)) => {
                            assert_eq!(name(&lease), expected, "{context}: {text:?} via {selector:?}");
                            model.get_mut(&expected).unwrap().lease = Some(lease);
                        }
                        (Err(LeaseError::NoProxyAvailable { .. }), None) => {}
                        (got, expected) => {
                            panic!("{context}: {text:?}: got {got:?}, model says {expected:?}")
                        }
                    }
                }
            }
        }
    }
}

/// A lease restored from a checkpoint may have been released just before a crash (the holder was
/// told, and will never end it again): the lifecycle waits for it only a bounded grace, while a
/// lease its holder confirms (renews) after the restore is waited for like any other.
#[test]
fn unconfirmed_restored_leases_hold_up_a_drain_only_for_the_grace() {
    let (before, clock, all) = one_proxy(2, 3, 0);
    let forgotten = acquire(&before, &all).unwrap();
    let renewed_later = acquire(&before, &all).unwrap();
    let cp = before.checkpoint();
    drop(before);

    let after = store_with_clock(&clock);
    after.restore(&cp);
    add_open(&after, target("a", &[], 3, 0));
    assert_eq!(
        after.active_leases(&key("a")),
        2,
        "both still count against the limit"
    );
    assert_eq!(
        after.leases_to_wait_for(&key("a")),
        2,
        "both are waited for at first"
    );
    after
        .renew(&renewed_later.id, renewed_later.fencing_token, None)
        .unwrap();
    clock.advance(LeaseStoreConfig::default().unconfirmed_grace);
    assert_eq!(
        after.leases_to_wait_for(&key("a")),
        1,
        "after the grace only the confirmed lease holds a drain up, not {:?}",
        forgotten.id
    );
    assert_eq!(
        after.active_leases(&key("a")),
        2,
        "the unconfirmed one still counts until it expires"
    );
}

fn acquire_for(
    store: &LeaseStore,
    selector: &CompiledSelector,
    ttl: Duration,
    now: u64,
) -> Result<Lease, LeaseError> {
    store.acquire_at(
        &AcquireRequest {
            selector,
            holder: "crawler-1",
            ttl,
            target_domain: None,
            session_key: None,
            request_id: None,
        },
        now,
    )
}

/// Whether the lease exists, as renew (with a stale token: it changes nothing) sees it.
fn renew_sees(store: &LeaseStore, lease: &Lease, now: u64) -> bool {
    match store.renew_at(&lease.id, lease.fencing_token - 1, None, now) {
        Err(LeaseError::StaleToken { .. }) => true,
        Err(LeaseError::NotFound) => false,
        other => panic!("stale renew: {other:?}"),
    }
}

/// Whether the lease exists, as release (with a stale token) sees it.
fn release_sees(store: &LeaseStore, lease: &Lease, now: u64) -> bool {
    match store.release_at(&lease.id, lease.fencing_token - 1, Outcome::Ok, None, now) {
        Err(LeaseError::StaleToken { .. }) => true,
        Err(LeaseError::NotFound) => false,
        other => panic!("stale release: {other:?}"),
    }
}

#[test]
fn every_operation_agrees_on_expiry_at_every_instant_without_the_reaper() {
    for shards in [1, 4] {
        let (store, _, all) = one_proxy(shards, 1, 0);
        let lease = acquire_for(&store, &all, Duration::from_secs(10), T0).unwrap();
        let end = lease.expires_at_ms;
        assert_eq!(end, T0 + 10_000);
        // Just before expiresAt: it exists for everyone.
        for now in [T0, end - 1] {
            let view = &store.list_at(&all, now)[0];
            assert_eq!((view.availability, view.active_leases), (Availability::Busy, 1));
            assert!(renew_sees(&store, &lease, now));
            assert!(release_sees(&store, &lease, now));
            assert!(matches!(
                acquire_for(&store, &all, Duration::from_secs(10), now),
                Err(LeaseError::NoProxyAvailable { .. })
            ));
        }
        // At expiresAt: gone for everyone, and its slot is free at once (no reap in between).
        let view = &store.list_at(&all, end)[0];
        assert_eq!(
            (view.availability, view.active_leases),
            (Availability::Available, 0)
        );
        assert!(!renew_sees(&store, &lease, end));
        assert!(!release_sees(&store, &lease, end));
        assert_eq!(store.active_total(), 0);
        let next = acquire_for(&store, &all, Duration::from_secs(10), end).unwrap();
        assert_eq!(name(&next), "a");
        assert_eq!(store.reap(), 0, "nothing was left for the reaper");
    }
}

#[test]
fn an_expiry_rests_the_proxy_from_expires_at_like_a_release_then() {
    let (store, _, all) = one_proxy(1, 2, 5);
    let short = acquire_for(&store, &all, Duration::from_secs(10), T0).unwrap();
    let long = acquire_for(&store, &all, Duration::from_secs(60), T0).unwrap();
    let end = short.expires_at_ms;
    // Two seconds after the short lease's expiry, nobody having looked in between.
    let now = end + 2_000;
    let view = &store.list_at(&all, now)[0];
    assert_eq!(view.availability, Availability::CoolingDown);
    assert_eq!(view.active_leases, 1);
    assert_eq!(view.cooldown_until_ms, Some(end + 5_000));
    match acquire_for(&store, &all, Duration::from_secs(10), now) {
        Err(LeaseError::NoProxyAvailable { retry_after }) => assert_eq!(retry_after, Duration::from_secs(3)),
        other => panic!("expected the expiry's rest, got {other:?}"),
    }
    assert!(renew_sees(&store, &long, now));
    assert!(!renew_sees(&store, &short, now));
    // The rest ends five seconds after expiresAt, not after whenever the store noticed.
    assert!(acquire_for(&store, &all, Duration::from_secs(10), end + 5_000).is_ok());
}

#[test]
fn an_expiry_long_past_leaves_no_rest() {
    let (store, _, all) = one_proxy(1, 1, 5);
    let lease = acquire_for(&store, &all, Duration::from_secs(10), T0).unwrap();
    let now = lease.expires_at_ms + 5_000;
    assert_eq!(store.list_at(&all, now)[0].availability, Availability::Available);
    assert!(acquire_for(&store, &all, Duration::from_secs(10), now).is_ok());
}

#[test]
fn renewals_move_the_expiry_for_every_operation() {
    let (store, _, all) = one_proxy(1, 1, 0);
    let lease = acquire_for(&store, &all, Duration::from_secs(10), T0).unwrap();
    // Longer, then shorter than the first expiry: the heap entry must follow both ways.
    // Renews the one lease (its id never changes) with the token it holds now.
    let renew = |token: u64, ttl_secs: u64, now: u64| {
        store
            .renew_at(&lease.id, token, Some(Duration::from_secs(ttl_secs)), now)
            .unwrap()
    };
    let renewed = renew(lease.fencing_token, 30, T0 + 5_000);
    assert_eq!(renewed.expires_at_ms, T0 + 35_000);
    assert_eq!(store.list_at(&all, T0 + 20_000)[0].active_leases, 1);
    let renewed = renew(renewed.fencing_token, 1, T0 + 20_000);
    assert_eq!(renewed.expires_at_ms, T0 + 21_000);
    assert!(acquire_for(&store, &all, Duration::from_secs(10), T0 + 20_999).is_err());
    assert!(acquire_for(&store, &all, Duration::from_secs(10), T0 + 21_000).is_ok());
}

#[test]
fn retry_after_counts_only_the_proxies_the_selector_matches() {
    let (store, _) = store(4);
    add_open(&store, target("eu", &[("region", "eu")], 1, 10));
    add_open(&store, target("us", &[("region", "us")], 1, 50));
    add_open(&store, target("ap", &[("region", "ap")], 1, 0));
    add_open(&store, target("sa", &[("region", "sa")], 1, 0));
    store.set_admission(&key("sa"), Admission::Closed).unwrap();
    let ttl = Duration::from_secs(20);
    for region in ["eu", "us"] {
        let s = sel(&store, &format!("region={region}"));
        let l = acquire_for(&store, &s, ttl, T0).unwrap();
        store
            .release_at(&l.id, l.fencing_token, Outcome::Ok, None, T0)
            .unwrap();
    }
    // ap is busy until its lease expires in 20 s (no cooldown).
    acquire_for(&store, &sel(&store, "region=ap"), ttl, T0).unwrap();
    let retry = |selector: &str| match acquire_for(&store, &sel(&store, selector), ttl, T0) {
        Err(LeaseError::NoProxyAvailable { retry_after }) => retry_after,
        other => panic!("{selector}: {other:?}"),
    };
    assert_eq!(
        retry("region=us"),
        Duration::from_secs(50),
        "eu's shorter rest is not us's"
    );
    assert_eq!(retry("region=eu"), Duration::from_secs(10));
    assert_eq!(
        retry("region=ap"),
        Duration::from_secs(20),
        "a busy proxy frees at its expiry"
    );
    assert_eq!(
        retry("region=sa"),
        Duration::from_secs(5),
        "closed: nothing to wait for"
    );
    assert_eq!(retry("region=mars"), Duration::from_secs(5));
    assert_eq!(retry(""), Duration::from_secs(10), "the soonest of all");
}

#[test]
fn a_checkpoint_records_the_rest_a_due_expiry_brings() {
    let (store, clock, all) = one_proxy(1, 1, 30);
    let lease = acquire_for(&store, &all, Duration::from_secs(10), T0).unwrap();
    clock.advance(Duration::from_secs(12));
    let cp = store.checkpoint();
    let proxy = cp.proxies.iter().find(|p| p.key == key("a")).unwrap();
    assert!(proxy.leases.is_empty());
    assert_eq!(proxy.cooldown_until_ms, Some(lease.expires_at_ms + 30_000));
}

#[test]
fn one_thread_draws_from_every_shard_in_turn() {
    let (store, _) = store(4);
    for i in 0..40 {
        add_open(&store, target(&format!("p{i}"), &[], 1, 0));
    }
    let all = sel(&store, "");
    // A fresh thread: its cursor starts at the beginning of a burst.
    let (per_shard, per_proxy) = std::thread::scope(|s| {
        s.spawn(|| {
            let mut per_shard = [0usize; 4];
            let mut per_proxy = BTreeMap::<String, usize>::new();
            for _ in 0..BURST * 4 * 4 {
                let lease = acquire(&store, &all).unwrap();
                per_shard[lease.id.hint.shard as usize] += 1;
                *per_proxy.entry(name(&lease).to_owned()).or_default() += 1;
                release_ok(&store, &lease);
            }
            (per_shard, per_proxy)
        })
        .join()
        .unwrap()
    });
    // BURST acquires per shard in turn: every shard the same share, every proxy used.
    assert_eq!(per_shard, [BURST as usize * 4; 4]);
    assert_eq!(per_proxy.len(), 40, "{per_proxy:?}");
}

/// An acquire by `holder` with request ID `request_id` for a one-proxy store's selector.
fn acquire_once(
    store: &LeaseStore,
    all: &CompiledSelector,
    holder: &str,
    request_id: &str,
) -> Result<Granted, LeaseError> {
    let req = AcquireRequest {
        selector: all,
        holder,
        ttl: Duration::from_secs(60),
        target_domain: Some("Shop.Example"),
        session_key: Some("s-1"),
        request_id: Some(request_id),
    };
    store.acquire_granted_at(&req, store.now_ms())
}

#[test]
fn a_repeated_request_id_gets_its_lease_again_until_the_lease_ends() {
    let (store, clock, all) = one_proxy(4, 3, 0);
    let first = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    assert!(first.repeat_of.is_none(), "a new grant");
    let granted = first.lease.claim("crawler-1", Some("Shop.Example"), Some("s-1"));
    // Before the caller made it durable, a repeat is refused, not answered.
    assert_eq!(
        acquire_once(&store, &all, "crawler-1", "r-1").unwrap_err(),
        LeaseError::RequestInProgress
    );
    store.confirm_request("crawler-1", "r-1");

    clock.advance(Duration::from_secs(5));
    let again = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    assert_eq!(again.lease.id, first.lease.id, "the same lease");
    assert_eq!(again.lease.fencing_token, first.lease.fencing_token);
    assert_eq!(
        again.repeat_of.as_ref(),
        Some(&granted),
        "signed again, the same lease ID"
    );
    assert_eq!(store.active_total(), 1, "no second slot taken");
    // Renewed since: the repeat tells the current token and expiry.
    let renewed = store
        .renew(&first.lease.id, first.lease.fencing_token, None)
        .unwrap();
    let again = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    assert_eq!(
        (again.lease.fencing_token, again.lease.expires_at_ms),
        (renewed.fencing_token, renewed.expires_at_ms)
    );
    assert_eq!(
        again.repeat_of.as_ref(),
        Some(&granted),
        "the claim it was granted with"
    );

    // Another holder's request with the same ID is another request.
    let other = acquire_once(&store, &all, "crawler-2", "r-1").unwrap();
    assert_ne!(other.lease.id, first.lease.id);

    // Once the lease ends, the ID may take a new one.
    store
        .release(&first.lease.id, renewed.fencing_token, Outcome::Ok, None)
        .unwrap();
    let next = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    assert!(next.repeat_of.is_none());
    assert_ne!(next.lease.id.first_token, first.lease.id.first_token);
}

#[test]
fn a_request_whose_grant_was_undone_may_be_sent_again() {
    let (store, _, all) = one_proxy(1, 1, 0);
    let first = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    // What the API does when the journal cannot make the grant durable.
    release_ok(&store, &first.lease);
    store.forget_request("crawler-1", "r-1");
    let second = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    assert!(second.repeat_of.is_none(), "a new grant, not the undone one");
}

#[test]
fn ended_leases_leave_the_request_index_and_expired_ones_never_answer() {
    let (store, clock, all) = one_proxy(2, 1000, 0);
    let first = acquire_once(&store, &all, "crawler-1", "old").unwrap();
    store.confirm_request("crawler-1", "old");
    clock.advance(Duration::from_secs(61));
    let fresh = acquire_once(&store, &all, "crawler-1", "old").unwrap();
    assert!(fresh.repeat_of.is_none(), "the expired lease is not answered");
    assert_ne!(fresh.lease.id.first_token, first.lease.id.first_token);
    // Many requests whose leases end: the index is pruned as it grows (each of its 16 shards
    // holds at most 64 entries of ended leases before a prune).
    for i in 0..4000 {
        let lease = acquire_once(&store, &all, "crawler-1", &format!("r-{i}")).unwrap();
        release_ok(&store, &lease.lease);
    }
    assert!(
        store.request_index_len() <= 16 * 64,
        "ended leases pruned: {} entries left",
        store.request_index_len()
    );
}

#[tokio::test]
async fn request_ids_survive_a_checkpoint_and_its_restore() {
    let (store, clock, all) = one_proxy(4, 3, 0);
    let first = acquire_once(&store, &all, "crawler-1", "r-1").unwrap();
    store.confirm_request("crawler-1", "r-1");
    let granted = first.lease.claim("crawler-1", Some("Shop.Example"), Some("s-1"));
    let cp = store.checkpoint();
    let json = serde_json::to_string(&cp).unwrap();
    assert!(json.contains("\"requestId\":\"r-1\""), "{json}");

    let after = store_with_clock(&clock);
    after.restore(&serde_json::from_str(&json).unwrap());
    // Restored, its proxy not configured again yet: the lease stands, the repeat waits.
    assert_eq!(
        acquire_once(&after, &all_of(&after), "crawler-1", "r-1").unwrap_err(),
        LeaseError::RequestInProgress
    );
    add_open(&after, target("a", &[], 3, 0));
    let again = acquire_once(&after, &all_of(&after), "crawler-1", "r-1").unwrap();
    assert_eq!(again.lease.id.first_token, first.lease.id.first_token);
    assert_eq!(again.repeat_of, Some(granted));
    assert_eq!(after.active_total(), 1);
}

fn all_of(store: &LeaseStore) -> CompiledSelector {
    sel(store, "")
}

/// What a restore takes from a checkpoint at `now`: leases, bans, cooldowns and bindings that
/// have not ended, and only proxies with something left worth keeping (as
/// [`LeaseStore::checkpoint`] writes them).
fn as_restored(cp: &checkpoint::Checkpoint, now: u64) -> String {
    use checkpoint::CheckpointAdmission;
    let mut proxies = Vec::new();
    for p in &cp.proxies {
        let mut p = p.clone();
        p.leases.retain(|l| l.expires_at_ms > now);
        p.bans.retain(|b| b.until_ms > now);
        p.cooldown_until_ms = p.cooldown_until_ms.filter(|until| *until > now);
        let empty = p.leases.is_empty()
            && p.bans.is_empty()
            && p.cooldown_until_ms.is_none()
            && p.revoked_below == 0
            && p.admission == CheckpointAdmission::Closed;
        if !empty {
            p.leases.sort_by_key(|l| l.first_token);
            p.bans.sort_by(|a, b| a.domain.cmp(&b.domain));
            proxies.push(p);
        }
    }
    proxies.sort_by(|a, b| a.key.cmp(&b.key));
    let mut sessions: Vec<_> = cp
        .sessions
        .iter()
        .filter(|s| s.expires_at_ms > now)
        .cloned()
        .collect();
    sessions.sort_by(|a, b| a.session_key.cmp(&b.session_key));
    format!("{:?}\n{proxies:#?}\n{sessions:#?}", cp.token_hwm)
}

/// `want == got`, showing the first lines that differ.
fn assert_same(got: &str, want: &str, context: &str) {
    if got == want {
        return;
    }
    let (g, w): (Vec<_>, Vec<_>) = (got.lines().collect(), want.lines().collect());
    let at = g
        .iter()
        .zip(&w)
        .position(|(a, b)| a != b)
        .unwrap_or(g.len().min(w.len()));
    let from = at.saturating_sub(12);
    panic!(
        "{context}: differs at line {at}\n--- got\n{}\n--- want\n{}",
        g[from..(at + 12).min(g.len())].join("\n"),
        w[from..(at + 12).min(w.len())].join("\n")
    );
}

/// Random lease traffic on `store` (30 proxies a..): acquires (some with a domain or a sticky
/// session), renewals, releases (some banned), expiries, revocations, drains, closings and
/// removals.
fn churn(store: &LeaseStore, clock: &Clock, rng: &mut fastrand::Rng, held: &mut Vec<Lease>, steps: usize) {
    let all = sel(store, "");
    for _ in 0..steps {
        match rng.u8(..20) {
            0..=6 => {
                let domain = rng.bool().then_some("shop.example");
                let session = ["s1", "s2", "s3"][rng.usize(..3)];
                if let Ok(lease) = acquire_with(store, &all, domain, rng.bool().then_some(session)) {
                    held.push(lease);
                }
            }
            7..=9 if !held.is_empty() => {
                let i = rng.usize(..held.len());
                if let Ok(r) = store.renew(&held[i].id, held[i].fencing_token, None) {
                    held[i].fencing_token = r.fencing_token;
                }
            }
            10..=12 if !held.is_empty() => {
                let lease = held.swap_remove(rng.usize(..held.len()));
                let outcome = if rng.bool() { Outcome::Banned } else { Outcome::Ok };
                let _ = store.release(&lease.id, lease.fencing_token, outcome, Some("news.example"));
            }
            13 => clock.advance(Duration::from_secs(rng.u64(1..90))),
            14 => {
                store.revoke_all(&key(&format!("p{}", rng.usize(..30))));
            }
            15 => {
                store.drain(&key(&format!("p{}", rng.usize(..30))));
            }
            16 => {
                let _ = store.set_admission(&key(&format!("p{}", rng.usize(..30))), Admission::Closed);
            }
            17 => {
                let name = format!("p{}", rng.usize(..30));
                store.remove_proxy(&key(&name));
                if rng.bool() {
                    add_open(store, target(&name, &[], 2, 20));
                }
            }
            _ => {
                let _ = store.set_admission(&key(&format!("p{}", rng.usize(..30))), Admission::Open);
            }
        }
    }
}

/// 30 open proxies with two slots each, saved to a checkpoint file in a fresh directory, to be
/// churned at random (`rng`, `held`) between saves.
struct Churned {
    dir: tempfile::TempDir,
    path: std::path::PathBuf,
    file: FileCheckpoint,
    store: LeaseStore,
    clock: Clock,
    report: checkpoint::CheckpointReport,
    saver: checkpoint::CheckpointSaver,
    rng: fastrand::Rng,
    held: Vec<Lease>,
}

/// [`Churned`] whose file folds deltas into a snapshot past `fold_min_bytes`, with `seed`.
fn churned(fold_min_bytes: u64, seed: u64) -> Churned {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("leases.checkpoint");
    let file = FileCheckpoint::new(&path).with_fold_min_bytes(fold_min_bytes);
    let (store, clock) = store(4);
    for i in 0..30 {
        add_open(&store, target(&format!("p{i}"), &[], 2, 20));
    }
    Churned {
        dir,
        path,
        file,
        store,
        clock,
        report: checkpoint::CheckpointReport::default(),
        saver: checkpoint::CheckpointSaver::default(),
        rng: fastrand::Rng::with_seed(seed),
        held: Vec::new(),
    }
}

/// The standalone checkpoint writes a snapshot, then only deltas of what changed, folded into
/// a new snapshot when they outgrow it; read back at any save, it is what a whole checkpoint of
/// the store would have been.
#[tokio::test]
async fn delta_checkpoints_read_back_as_the_whole_store() {
    let mut c = churned(4096, 25);
    let (mut folds, mut deltas) = (0, 0);
    let mut snapshot = Vec::new();
    for round in 0..200 {
        let steps = c.rng.usize(0..6);
        churn(&c.store, &c.clock, &mut c.rng, &mut c.held, steps);
        let delta_len = std::fs::metadata(FileCheckpoint::delta_path(&c.path)).map_or(0, |m| m.len());
        c.saver.save(&c.store, &c.file, &c.report).await.unwrap();
        let now = c.clock.now_ms();
        let back = FileCheckpoint::read(&c.path).unwrap().unwrap();
        assert_same(
            &as_restored(&back, now),
            &as_restored(&c.store.checkpoint(), now),
            &format!("round {round}"),
        );
        let written = std::fs::read(&c.path).unwrap();
        if written != snapshot {
            folds += 1;
            snapshot = written;
        } else if std::fs::metadata(FileCheckpoint::delta_path(&c.path))
            .unwrap()
            .len()
            > delta_len
        {
            deltas += 1;
        }
    }
    assert!(folds >= 3 && deltas >= 100, "{folds} snapshots, {deltas} deltas");
}

/// Bytes a delta checkpoint writes, and the proxies it names, for 10 changes among `proxies`
/// proxies that are otherwise left alone.
async fn delta_cost(proxies: usize) -> (u64, usize) {
    let dir = tempfile::tempdir().unwrap();
    let file = FileCheckpoint::new(dir.path().join("leases.checkpoint"));
    let (store, _clock) = store(16);
    for i in 0..proxies {
        add_open(&store, target(&format!("p{i:06}"), &[], 1, 0));
    }
    // Every proxy has state worth keeping (open), so the snapshot names them all.
    let report = checkpoint::CheckpointReport::default();
    let mut saver = checkpoint::CheckpointSaver::default();
    saver.save(&store, &file, &report).await.unwrap();
    let all = sel(&store, "");
    let changes = || {
        for _ in 0..10 {
            acquire(&store, &all).unwrap();
        }
    };
    changes();
    let before = report.written();
    saver.save(&store, &file, &report).await.unwrap();
    let bytes = report.written().bytes - before.bytes;
    changes();
    let named = store.checkpoint_delta().proxies.len();
    (bytes, named)
}

/// A save after a few changes writes those (a delta naming them) however many proxies did not
/// change: the same bytes for 1,000 and 30,000 proxies.
#[tokio::test]
async fn a_checkpoint_writes_what_changed_not_the_whole_store() {
    let (small_bytes, small_named) = delta_cost(1_000).await;
    let (large_bytes, large_named) = delta_cost(30_000).await;
    assert_eq!((small_named, large_named), (10, 10));
    assert!(small_bytes < 4_000, "{small_bytes} bytes for 10 changes");
    assert!(
        small_bytes.abs_diff(large_bytes) * 20 < small_bytes,
        "1k proxies: {small_bytes} bytes, 30k: {large_bytes} bytes"
    );
}

/// A crash at any point of a save leaves a checkpoint that reads back as a state the store was
/// in at a save: a torn delta frame is ignored from there, a fold cut off after its snapshot
/// ignores the old delta file (the snapshot holds it all), temporary files are never read.
#[tokio::test]
async fn a_crash_in_a_checkpoint_save_reads_back_as_the_save_before_or_after() {
    let mut c = churned(8192, 18);
    let delta_path = FileCheckpoint::delta_path(&c.path);
    c.saver.save(&c.store, &c.file, &c.report).await.unwrap();
    let mut states = vec![c.store.checkpoint()];
    let (mut torn_checked, mut folds_checked) = (0, 0);
    for _ in 0..150 {
        let steps = 1 + c.rng.usize(0..5);
        churn(&c.store, &c.clock, &mut c.rng, &mut c.held, steps);
        let snapshot_before = std::fs::read(&c.path).unwrap();
        let delta_before = std::fs::read(&delta_path).unwrap();
        c.saver.save(&c.store, &c.file, &c.report).await.unwrap();
        let now = c.clock.now_ms();
        states.push(c.store.checkpoint());
        let (before, after) = (
            as_restored(&states[states.len() - 2], now),
            as_restored(&states[states.len() - 1], now),
        );
        let delta_after = std::fs::read(&delta_path).unwrap();
        let read_as = |snapshot: &[u8], delta: &[u8]| {
            std::fs::write(&c.path, snapshot).unwrap();
            std::fs::write(&delta_path, delta).unwrap();
            as_restored(&FileCheckpoint::read(&c.path).unwrap().unwrap(), now)
        };
        let snapshot_after = std::fs::read(&c.path).unwrap();
        if snapshot_after == snapshot_before && delta_after == delta_before {
            // Nothing changed, nothing written.
            assert_same(&before, &after, "an unchanged store");
        } else if snapshot_after == snapshot_before {
            // A delta was appended: cut anywhere in it, the file reads as the save before.
            assert!(delta_after.starts_with(&delta_before));
            for cut in [
                delta_before.len() + 1,
                delta_before.len() + 8,
                delta_after.len() - 1,
            ] {
                assert_same(
                    &read_as(&snapshot_after, &delta_after[..cut]),
                    &before,
                    "torn delta",
                );
            }
            torn_checked += 1;
        } else {
            // A fold: the new snapshot with the old delta file (a crash before its
            // replacement) or with a half-written new one reads as the new state.
            assert_same(
                &read_as(&snapshot_after, &delta_before),
                &after,
                "fold, old delta file",
            );
            assert_same(
                &read_as(&snapshot_after, &delta_after[..4]),
                &after,
                "fold, torn header",
            );
            // Before its rename, the new snapshot is a temporary file nobody reads.
            std::fs::write(c.dir.path().join("leases.checkpoint.tmp"), b"{torn").unwrap();
            assert_same(
                &read_as(&snapshot_before, &delta_before),
                &before,
                "fold before its rename",
            );
            folds_checked += 1;
        }
        // Put the real files back for the next save.
        std::fs::write(&c.path, &snapshot_after).unwrap();
        std::fs::write(&delta_path, &delta_after).unwrap();
        let back = as_restored(&FileCheckpoint::read(&c.path).unwrap().unwrap(), now);
        assert_same(&back, &after, "after the save");
    }
    assert!(
        torn_checked >= 50 && folds_checked >= 2,
        "{torn_checked} deltas, {folds_checked} folds"
    );
}

/// The kept ID matches itself only: any one byte changed anywhere (in the words compared eight
/// bytes at a time or in the tail), a byte dropped or added, is another ID.
#[test]
fn an_issued_id_matches_only_itself() {
    let id = LeaseSigner::new(&[9u8; 32]).unwrap().sign(&LeaseClaim {
        id: LeaseId {
            key: key("a"),
            first_token: 77,
            hint: LeaseHint::default(),
        },
        holder: "crawler-1".into(),
        acquired_at_ms: T0,
        expires_at_ms: T0 + 60_000,
        target_domain: Some("shop.example".into()),
        session_key: None,
    });
    let kept = token::IssuedId::new(&id);
    assert!(kept.matches(id.as_bytes()));
    for i in 0..id.len() {
        let mut other = id.clone().into_bytes();
        other[i] ^= 1;
        assert!(!kept.matches(&other), "byte {i} of {}", id.len());
    }
    assert!(!kept.matches(&id.as_bytes()[..id.len() - 1]));
    assert!(!kept.matches(format!("{id}A").as_bytes()));
    assert!(!kept.matches(b""));
}

/// A small pool spread over many shards (a proxy or none a shard, as three local Squids in the
/// default 16 shards are) rotates: acquire-and-release in a loop from one thread uses every
/// proxy in turn, not the first free one each time (what a crawler leasing per request, and
/// the gateway without a session, rely on).
#[test]
fn a_small_pool_over_many_shards_rotates_through_its_proxies() {
    let store = plain_pool(16, &["a", "b", "c"], 1, 0);
    let all = sel(&store, "");
    let mut uses = std::collections::BTreeMap::<String, usize>::new();
    let mut order = Vec::new();
    for _ in 0..9 {
        let lease = acquire(&store, &all).unwrap();
        order.push(lease.id.key.to_string());
        *uses.entry(lease.id.key.to_string()).or_default() += 1;
        store
            .release(&lease.id, lease.fencing_token, Outcome::Ok, None)
            .unwrap();
    }
    assert_eq!(
        uses.values().copied().collect::<Vec<_>>(),
        vec![3, 3, 3],
        "{order:?}"
    );
    assert!(
        order.windows(2).all(|w| w[0] != w[1]),
        "the same proxy twice in a row: {order:?}"
    );
}
