use proptest::prelude::*;

use super::*;

const HOUR: u64 = 3_600_000;
/// 2026-12-04T17:30:00Z.
const T0: u64 = 1_796_405_400_000;

fn quotas(yaml: &str) -> Quotas {
    Quotas::parse(yaml, "q.yaml").unwrap()
}

#[test]
fn requests_bytes_lease_time_and_bans_count_for_token_and_holder() {
    let usage = Usage::default();
    usage.admit("crawler-a", "h1", T0).unwrap();
    usage.admit("crawler-a", "h2", T0).unwrap();
    usage.add_bytes("crawler-a", "h1", 100, T0);
    usage.lease_ended("crawler-a", "h1", 1_500, true);
    usage.lease_ended("crawler-a", "h2", 500, false);
    let token = usage.token("crawler-a").unwrap();
    assert_eq!(
        (token.requests, token.bytes, token.lease_ms, token.bans),
        (2, 100, 2_000, 1)
    );
    let h1 = usage.holder("h1").unwrap();
    assert_eq!((h1.requests, h1.bytes, h1.lease_ms, h1.bans), (1, 100, 1_500, 1));
    assert_eq!(usage.holders()[0].0, "h1", "most requests (then bytes) first");
}

#[test]
fn the_least_recently_seen_is_evicted() {
    let usage = Usage::with_limits(2, 2);
    usage.admit("t", "a", T0).unwrap();
    usage.admit("t", "b", T0).unwrap();
    usage.add_bytes("t", "a", 1, T0); // a is now more recent than b
    usage.admit("t", "c", T0).unwrap();
    assert!(usage.holder("b").is_none());
    assert!(usage.holder("a").is_some() && usage.holder("c").is_some());
}

/// A full table evicts its least recently seen tenth at once, however long ago the rest were
/// added: what was seen lately stays.
#[test]
fn a_full_table_evicts_its_least_recently_seen_tenth() {
    let mut table = super::table::Table::new(100);
    for n in 0..100 {
        table.add(&format!("n{n}"), |c| c.requests += 1);
    }
    // The first 20 seen again: now n20..n29 are the least recently seen.
    for n in 0..20 {
        table.add(&format!("n{n}"), |c| c.requests += 1);
    }
    table.add("new", |c| c.requests += 1);
    assert_eq!(table.len(), 91);
    let kept = |n: u32| table.get(&format!("n{n}")).is_some();
    assert!((20..30).all(|n| !kept(n)), "the least recent tenth went");
    assert!((0..20).chain(30..100).all(kept), "the rest stayed");
    assert_eq!(table.get("n0").map(|c| c.requests), Some(2));
}

#[test]
fn a_quota_refuses_in_its_window_and_resets_at_the_next() {
    let usage = Usage::default();
    usage.set_quotas(quotas(
        "quotas:\n  - {token: crawler-a, requests: 3, period: 1h}\n",
    ));
    for _ in 0..3 {
        usage.admit("crawler-a", "h", T0).unwrap();
    }
    let refused = usage.admit("crawler-a", "h", T0).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "token crawler-a used 3 of its 3 requests per 1h; it resets at 2026-12-04T18:00:00Z"
    );
    assert_eq!(refused.retry_after_ms, HOUR / 2);
    assert_eq!(
        usage.token("crawler-a").unwrap().requests,
        3,
        "a refusal is no request"
    );
    // Other tokens are not limited; the next window admits again.
    usage.admit("crawler-b", "h", T0).unwrap();
    usage.admit("crawler-a", "h", T0 + HOUR / 2).unwrap();
    let state = &usage.tokens(T0 + HOUR / 2)[0].quotas[0];
    assert_eq!(
        (state.requests_used, state.resets_at()),
        (1, "2026-12-04T19:00:00Z".to_owned())
    );
}

#[test]
fn a_byte_quota_refuses_once_used_up() {
    let usage = Usage::default();
    usage.set_quotas(quotas("quotas:\n  - {token: t, bytes: 100, period: 1d}\n"));
    usage.admit("t", "h", T0).unwrap();
    usage.add_bytes("t", "h", 150, T0);
    let refused = usage.admit("t", "h", T0).unwrap_err();
    assert_eq!((refused.what, refused.used, refused.limit), ("bytes", 150, 100));
    assert_eq!(refused.resets_at, "2026-12-05T00:00:00Z");
}

#[test]
fn a_token_with_a_quota_is_listed_before_any_use() {
    let usage = Usage::default();
    usage.set_quotas(quotas("quotas:\n  - {token: idle, requests: 1, period: 30s}\n"));
    let tokens = usage.tokens(T0);
    assert_eq!(tokens.len(), 1);
    assert_eq!(
        (tokens[0].token.as_str(), tokens[0].counters.requests),
        ("idle", 0)
    );
}

#[test]
fn a_bad_quotas_file_names_the_entry_and_field() {
    let err = |yaml: &str| Quotas::parse(yaml, "q.yaml").unwrap_err().to_string();
    assert_eq!(
        err("quotas:\n  - {token: a, requests: 1, period: 1w}\n"),
        "the quotas q.yaml: quota for token \"a\" (quotas[0]), period: \"1w\" is no period: a number and s, m, h or d (30s, 15m, 1h, 7d), 1s to 366d"
    );
    assert!(
        err("quotas:\n  - {token: a, period: 1h}\n")
            .contains("(quotas[0]), requests: give requests, bytes or both"),
    );
    let unknown = err("quotas:\n  - {token: a, requets: 1, period: 1h}\n");
    assert!(unknown.starts_with("the quotas q.yaml: quotas[0]"), "{unknown}");
    assert!(unknown.contains("unknown field `requets`"), "{unknown}");
    assert!(err("quotas:\n  - {token: a, bytes: 0, period: 1h}\n").contains("bytes: at least 1"));
}

proptest! {
    /// Whatever the order of use, the tables stay within their caps and keep the most recently
    /// seen names.
    #[test]
    fn the_tables_stay_bounded(names in proptest::collection::vec(0u8..20, 1..200)) {
        let usage = Usage::with_limits(5, 5);
        for n in &names {
            usage.admit(&format!("t{n}"), &format!("h{n}"), T0).unwrap();
        }
        let (tokens, holders) = usage.tracked();
        prop_assert!(tokens <= 5 && holders <= 5);
        let last = format!("h{}", names.last().unwrap());
        prop_assert!(usage.holder(&last).is_some());
    }

    /// Within a window, a request quota admits exactly its limit.
    #[test]
    fn a_request_quota_admits_exactly_its_limit(limit in 1u64..50, tries in 1u64..100, offset in 0u64..HOUR) {
        let usage = Usage::default();
        usage.set_quotas(quotas(&format!("quotas:\n  - {{token: t, requests: {limit}, period: 1h}}\n")));
        let start = T0 - T0 % HOUR + offset;
        let admitted = (0..tries).filter(|_| usage.admit("t", "h", start).is_ok()).count() as u64;
        prop_assert_eq!(admitted, tries.min(limit));
    }
}
