//! The health engine against real Squid on loopback and a loopback target: passes, failures
//! past the threshold with an event, recovery, timeouts, Squid's own denials, HTTPS through
//! CONNECT, and the egress check.

mod support;

use std::{net::IpAddr, time::Duration};

use egress_proxies_operator::{
    api::ProxyKey,
    health::{HealthConfig, HealthEngine, HealthEvent, HealthHandle, HealthTarget, Verdict},
    provider::{Credentials, Endpoint},
};
use support::{Origin, Squid, eventually};
use tokio::sync::mpsc::Receiver;

fn target(key: &ProxyKey, squid: &Squid, url: String) -> HealthTarget {
    HealthTarget {
        key: key.clone(),
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: squid.port,
        },
        url,
        interval: Duration::from_millis(150),
        timeout: Duration::from_secs(2),
        failure_threshold: 2,
        success_threshold: 1,
        expected_egress: None,
        credentials: None,
    }
}

fn engine(origin: &Origin) -> (HealthHandle, Receiver<HealthEvent>) {
    HealthEngine::start(HealthConfig {
        tls_roots: Some(origin.roots.clone()),
        ..HealthConfig::default()
    })
    .expect("engine starts")
}

async fn next_event(events: &mut Receiver<HealthEvent>) -> HealthEvent {
    tokio::time::timeout(Duration::from_secs(20), events.recv())
        .await
        .expect("an event within 20 s")
        .expect("engine alive")
}

#[tokio::test]
async fn squid_passes_fails_when_stopped_and_recovers_when_restarted() {
    let origin = Origin::start().await;
    let mut squid = Squid::start().await;
    let (health, mut events) = engine(&origin);
    let key = ProxyKey::new("crawl", "squid-1");
    health.upsert(target(&key, &squid, origin.http_url("/ip")));
    health.probe_now(&key);

    let passed = next_event(&mut events).await;
    assert_eq!((passed.verdict, passed.recovered), (Verdict::Passing, false));
    let snap = health.snapshot(&key).unwrap();
    assert!(snap.last_latency.is_some() && snap.last_error.is_none());

    squid.stop();
    let failed = next_event(&mut events).await;
    assert_eq!((failed.verdict, failed.recovered), (Verdict::Failing, false));
    let snap = health.snapshot(&key).unwrap();
    assert!(snap.consecutive_failures >= 2, "{snap:?}");
    assert!(
        snap.last_error
            .as_deref()
            .unwrap()
            .starts_with("connecting to the proxy"),
        "{snap:?}"
    );

    squid.restart().await;
    let recovered = next_event(&mut events).await;
    assert_eq!((recovered.verdict, recovered.recovered), (Verdict::Passing, true));
    let snap = health.snapshot(&key).unwrap();
    assert!(snap.recovered);
    // No event while nothing crosses a threshold: three more probes pass, and the engine
    // says nothing of them.
    let passes_at_recovery = snap.consecutive_successes;
    eventually(Duration::from_secs(20), "three more passing probes", || {
        health.snapshot(&key).unwrap().consecutive_successes >= passes_at_recovery + 3
    })
    .await;
    assert!(events.try_recv().is_err());
}

#[tokio::test]
async fn https_through_connect_and_the_egress_check() {
    let origin = Origin::start().await;
    let squid = Squid::start().await;
    let (health, mut events) = engine(&origin);
    let good = ProxyKey::new("crawl", "tls-egress-ok");
    let mut t = target(&good, &squid, origin.https_url("/ip"));
    t.expected_egress = Some("127.0.0.1".parse::<IpAddr>().unwrap());
    health.upsert(t.clone());
    health.probe_now(&good);
    let e = next_event(&mut events).await;
    assert_eq!(
        (e.key.clone(), e.verdict),
        (good.clone(), Verdict::Passing),
        "{e:?}"
    );

    let wrong = ProxyKey::new("crawl", "tls-egress-wrong");
    let mut t = target(&wrong, &squid, origin.https_url("/ip"));
    // A documentation address (TEST-NET-1): only compared with the body, never contacted.
    t.expected_egress = Some("192.0.2.1".parse::<IpAddr>().unwrap());
    health.upsert(t);
    health.probe_now(&wrong);
    let e = next_event(&mut events).await;
    assert_eq!((e.key.clone(), e.verdict), (wrong.clone(), Verdict::Failing));
    assert!(
        e.last_error
            .unwrap()
            .contains("expected egress address 192.0.2.1")
    );
}

#[tokio::test]
async fn slow_targets_time_out_and_squid_denials_fail() {
    let origin = Origin::start().await;
    let squid = Squid::start().await;
    let (health, mut events) = engine(&origin);

    let slow = ProxyKey::new("crawl", "slow");
    let mut t = target(&slow, &squid, origin.http_url("/slow"));
    t.timeout = Duration::from_millis(300);
    t.failure_threshold = 1;
    health.upsert(t);
    health.probe_now(&slow);
    let e = next_event(&mut events).await;
    assert_eq!((e.key.clone(), e.verdict), (slow.clone(), Verdict::Failing));
    assert!(e.last_error.as_deref().unwrap().starts_with("timed out"), "{e:?}");
    health.remove(&slow);

    let denied = ProxyKey::new("crawl", "denied");
    let mut t = target(&denied, &squid, origin.http_url("/forbidden/page"));
    t.failure_threshold = 1;
    health.upsert(t);
    health.probe_now(&denied);
    let e = next_event(&mut events).await;
    assert_eq!((e.key.clone(), e.verdict), (denied.clone(), Verdict::Failing));
    assert_eq!(e.last_error.as_deref(), Some("the proxy answered 403 Forbidden"));

    let broken = ProxyKey::new("crawl", "target-500");
    let mut t = target(&broken, &squid, origin.http_url("/status/500"));
    t.failure_threshold = 1;
    health.upsert(t);
    health.probe_now(&broken);
    let e = next_event(&mut events).await;
    assert_eq!(
        e.last_error.as_deref(),
        Some("the target answered 500 Internal Server Error")
    );
}

#[tokio::test]
async fn upserting_again_keeps_counters_unless_endpoint_or_url_change() {
    let origin = Origin::start().await;
    let squid = Squid::start().await;
    let (health, mut events) = engine(&origin);
    let key = ProxyKey::new("crawl", "steady");
    let t = target(&key, &squid, origin.http_url("/"));
    health.upsert(t.clone());
    health.probe_now(&key);
    assert_eq!(next_event(&mut events).await.verdict, Verdict::Passing);
    eventually(Duration::from_secs(10), "three passes", || {
        health.snapshot(&key).unwrap().consecutive_successes >= 3
    })
    .await;
    let mut slower = t.clone();
    slower.interval = Duration::from_millis(200);
    slower.failure_threshold = 5;
    health.upsert(slower);
    let snap = health.snapshot(&key).unwrap();
    assert_eq!(snap.verdict, Verdict::Passing);
    assert!(snap.consecutive_successes >= 3);

    let mut moved = t.clone();
    moved.url = origin.http_url("/ip");
    health.upsert(moved);
    let snap = health.snapshot(&key).unwrap();
    assert_eq!((snap.verdict, snap.consecutive_successes), (Verdict::Unknown, 0));
    let again = next_event(&mut events).await;
    assert_eq!((again.verdict, again.recovered), (Verdict::Passing, false));
    assert_eq!(health.len(), 1);
    health.remove(&key);
    assert!(health.snapshot(&key).is_none());
}

#[tokio::test]
async fn credentials_go_in_proxy_authorization_and_never_in_errors() {
    let origin = Origin::start().await;
    let squid = Squid::start_with_auth().await;
    let (health, mut events) = engine(&origin);

    let without = ProxyKey::new("crawl", "no-credentials");
    let mut t = target(&without, &squid, origin.http_url("/"));
    t.failure_threshold = 1;
    health.upsert(t);
    health.probe_now(&without);
    let e = next_event(&mut events).await;
    assert_eq!(e.verdict, Verdict::Failing);
    assert_eq!(
        e.last_error.as_deref(),
        Some("the proxy answered 407 Proxy Authentication Required")
    );
    health.remove(&without);

    for (name, url) in [
        ("with-credentials", origin.http_url("/")),
        ("with-credentials-tls", origin.https_url("/ip")),
    ] {
        let key = ProxyKey::new("crawl", name);
        let mut t = target(&key, &squid, url);
        t.credentials = Some(Credentials {
            username: "crawler".into(),
            password: "hunter2-secret".into(),
        });
        health.upsert(t);
        health.probe_now(&key);
        let e = next_event(&mut events).await;
        assert_eq!(
            (e.key.clone(), e.verdict),
            (key.clone(), Verdict::Passing),
            "{e:?}"
        );
        health.remove(&key);
    }

    // A failing probe with credentials: the error says what failed and nothing secret.
    let failing = ProxyKey::new("crawl", "credentials-denied");
    let mut t = target(&failing, &squid, origin.http_url("/forbidden"));
    t.failure_threshold = 1;
    t.credentials = Some(Credentials {
        username: "crawler".into(),
        password: "hunter2-secret".into(),
    });
    health.upsert(t);
    health.probe_now(&failing);
    let e = next_event(&mut events).await;
    let text = format!("{e:?} {:?}", health.snapshot(&failing));
    assert!(!text.contains("hunter2") && !text.contains("crawler:"), "{text}");
}

/// A new proxy is probed at once, not at a random point of its first interval: time to Healthy
/// must not depend on luck (with a one-hour interval, a random first probe would almost never
/// come within the test's deadline).
#[tokio::test]
async fn a_new_target_is_probed_at_once() {
    let origin = Origin::start().await;
    let squid = Squid::start().await;
    let (health, mut events) = engine(&origin);
    let key = ProxyKey::new("crawl", "fresh");
    let mut fresh = target(&key, &squid, origin.http_url("/ip"));
    fresh.interval = Duration::from_secs(3600);
    health.upsert(fresh);
    let passed = next_event(&mut events).await;
    assert_eq!((passed.key, passed.verdict), (key, Verdict::Passing));
}
