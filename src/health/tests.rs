//! Verdict rules without the network; probing through real Squid is tested in tests/health.rs.

use super::*;

fn target(failures: u32, successes: u32) -> HealthTarget {
    HealthTarget {
        key: ProxyKey::new("ns", "p"),
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 1,
        },
        url: "http://127.0.0.1/".into(),
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(500),
        failure_threshold: failures,
        success_threshold: successes,
        expected_egress: None,
        credentials: None,
    }
}

fn run(target: &HealthTarget, results: &str) -> Vec<Option<(Verdict, Verdict)>> {
    let mut snapshot = HealthSnapshot::default();
    results
        .chars()
        .map(|c| {
            let r = if c == '+' {
                Ok(Duration::from_millis(1))
            } else {
                Err(ProbeError::Timeout(Duration::from_secs(1)))
            };
            apply(&mut snapshot, target, r, None, jiff::Timestamp::UNIX_EPOCH)
        })
        .collect()
}

#[test]
fn events_only_when_a_threshold_is_crossed() {
    use Verdict::*;
    let t = target(3, 2);
    assert_eq!(
        run(&t, "+-+--+-+++---"),
        vec![
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            Some((Unknown, Passing)),
            None,
            None,
            None,
            Some((Passing, Failing)),
        ]
    );
    assert_eq!(
        run(&t, "---++"),
        vec![
            None,
            None,
            Some((Unknown, Failing)),
            None,
            Some((Failing, Passing))
        ]
    );
}

#[test]
fn a_hold_keeps_the_verdict_failing_until_it_ends() {
    use Verdict::*;
    let t = target(2, 2);
    let mut snapshot = HealthSnapshot::default();
    let step = |snapshot: &mut HealthSnapshot, held: Option<&str>| {
        apply(
            snapshot,
            &t,
            Ok(Duration::from_millis(1)),
            held,
            jiff::Timestamp::UNIX_EPOCH,
        )
    };
    assert_eq!(step(&mut snapshot, None), None);
    assert_eq!(step(&mut snapshot, None), Some((Unknown, Passing)));
    // Held: passes keep counting but the verdict stays failing, its error saying why.
    assert_eq!(
        step(&mut snapshot, Some("held by rule r")),
        Some((Passing, Failing))
    );
    assert_eq!(step(&mut snapshot, Some("held by rule r")), None);
    assert_eq!(snapshot.last_error.as_deref(), Some("held by rule r"));
    // Over: the passes made during the hold count, as for any recovery.
    assert_eq!(step(&mut snapshot, None), Some((Failing, Passing)));
    assert!(snapshot.recovered);
}

#[test]
fn a_hold_ends_by_itself() {
    let mut hold = Some(hold::Hold::until(tokio::time::Instant::now(), "over".into()));
    assert_eq!(hold::active(&mut hold), None);
    assert!(hold.is_none());
    let mut hold = Some(hold::Hold::until(
        tokio::time::Instant::now() + Duration::from_secs(60),
        "on".into(),
    ));
    assert_eq!(hold::active(&mut hold), Some("on"));
}

#[test]
fn errors_are_bounded() {
    let t = target(1, 1);
    let mut snapshot = HealthSnapshot::default();
    let long = ProbeError::Http("x".repeat(10_000));
    apply(&mut snapshot, &t, Err(long), None, jiff::Timestamp::UNIX_EPOCH);
    assert!(snapshot.last_error.unwrap().len() <= MAX_ERROR_LEN);
}

#[tokio::test]
async fn the_health_executor_interface_maps_targets_and_verdicts() {
    let (handle, _events) = HealthEngine::start(HealthConfig {
        tls_roots: Some(Arc::new(rustls::RootCertStore::empty())),
        ..HealthConfig::default()
    })
    .unwrap();
    let key = ProxyKey::new("ns", "p");
    let control: &dyn HealthControl = &handle;
    assert_eq!(control.verdict(&key), Verdict::Unknown);
    let target = HealthTarget::from_check(
        key.clone(),
        Endpoint {
            host: "127.0.0.1".into(),
            port: 9,
        },
        &crate::api::HealthCheck {
            url: "http://127.0.0.1/".into(),
            interval_seconds: 3600,
            timeout_seconds: 1,
            failure_threshold: 2,
            success_threshold: 1,
            expected_egress_address: Some("192.0.2.1".into()),
        },
        None,
    );
    assert_eq!(target.interval, Duration::from_secs(3600));
    assert_eq!(target.timeout, Duration::from_secs(1));
    assert_eq!((target.failure_threshold, target.success_threshold), (2, 1));
    assert_eq!(target.expected_egress, Some("192.0.2.1".parse().unwrap()));
    control.upsert(target);
    assert_eq!(handle.len(), 1);
    let snapshot = handle.snapshot(&ProxyKey::new("ns", "p")).unwrap();
    assert_eq!(snapshot.verdict, Verdict::Unknown);
    assert_eq!(control.verdict(&key), Verdict::Unknown);
    control.remove(&key);
    assert!(handle.is_empty());
}

#[tokio::test]
async fn holding_a_proxy_failing_sends_the_verdict_change_once() {
    let (handle, mut events) = HealthEngine::start(HealthConfig {
        tls_roots: Some(Arc::new(rustls::RootCertStore::empty())),
        ..HealthConfig::default()
    })
    .unwrap();
    let key = ProxyKey::new("ns", "p");
    let mut t = target(2, 1);
    t.interval = Duration::from_secs(3600);
    handle.upsert(t);
    // Not probed: left alone, no event.
    handle
        .hold_failing(&ProxyKey::new("ns", "other"), Duration::from_secs(60), "r".into())
        .await;
    handle
        .hold_failing(&key, Duration::from_secs(60), "held by gateway rule r".into())
        .await;
    let event = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("an event")
        .expect("the engine runs");
    assert_eq!(
        (event.key.clone(), event.verdict),
        (key.clone(), Verdict::Failing)
    );
    assert_eq!(event.last_error.as_deref(), Some("held by gateway rule r"));
    assert_eq!(handle.snapshot(&key).unwrap().verdict, Verdict::Failing);
    // Held again while failing: no second event.
    handle
        .hold_failing(&key, Duration::from_secs(60), "again".into())
        .await;
    assert!(events.try_recv().is_err());
}

/// Proxies added together are probed together at once; if every later probe came one jittered
/// interval after the last, 10,000 of them would stay a wave for many intervals (the pool
/// benchmark saw the lease API lose a third of its rate while each wave passed). The probe
/// after a proxy's first verdict comes at a random point within its interval instead; later
/// ones keep the ±10 % jitter.
#[test]
fn the_probe_after_the_first_verdict_spreads_proxies_over_the_interval() {
    let interval = Duration::from_secs(30);
    let spread: Vec<Duration> = (0..1000).map(|_| next_probe_in(interval, 0.1, true)).collect();
    assert!(spread.iter().all(|d| *d <= interval), "later than one interval");
    assert!(
        spread.iter().any(|d| *d < interval / 10),
        "none in the interval's first tenth"
    );
    assert!(
        spread.iter().any(|d| *d > interval * 9 / 10),
        "none in its last tenth"
    );
    for _ in 0..1000 {
        let d = next_probe_in(interval, 0.1, false);
        assert!(d >= interval.mul_f64(0.9) && d <= interval.mul_f64(1.1), "{d:?}");
    }
}
