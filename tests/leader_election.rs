//! Leader election over a coordination.k8s.io Lease on a real kube-apiserver and etcd: one
//! leader at a time, takeover only after expiry or release, and a leader that can't renew (the
//! API server is down) steps down.

mod support;

use std::time::Duration;

use egress_proxies_operator::cluster::leader::{LeaderElector, LeaderTimings, Leadership};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use support::control_plane::ControlPlane;
use tokio::sync::{oneshot, watch};

fn timings() -> LeaderTimings {
    LeaderTimings {
        lease_duration: Duration::from_secs(1),
        renew_deadline: Duration::from_millis(600),
        retry_period: Duration::from_millis(50),
    }
}

struct Candidate {
    state: watch::Receiver<Leadership>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

fn candidate(api: Api<Lease>, identity: &str) -> Candidate {
    let (tx, state) = watch::channel(Leadership::Unknown);
    let (stop, stopped) = oneshot::channel::<()>();
    let elector = LeaderElector::new(api, "egress-proxies-operator", identity, timings());
    let task = tokio::spawn(elector.run(tx, async {
        let _ = stopped.await;
    }));
    Candidate {
        state,
        stop: Some(stop),
        task,
    }
}

async fn wait(state: &mut watch::Receiver<Leadership>, want: impl Fn(&Leadership) -> bool) {
    tokio::time::timeout(Duration::from_secs(10), state.wait_for(|s| want(s)))
        .await
        .expect("leadership reached in time")
        .expect("elector running");
}

#[tokio::test]
async fn one_leader_at_a_time_and_a_clean_handover() {
    let plane = ControlPlane::start().await;
    plane.create_namespace("egress-proxies-system").await;
    let api: Api<Lease> = Api::namespaced(plane.client().await, "egress-proxies-system");
    let mut a = candidate(api.clone(), "replica-a");
    wait(&mut a.state, |s| *s == Leadership::Leader).await;
    let mut b = candidate(api.clone(), "replica-b");
    wait(
        &mut b.state,
        |s| matches!(s, Leadership::Follower { holder } if holder == "replica-a"),
    )
    .await;
    // While a renews, b never leads.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_ne!(*b.state.borrow(), Leadership::Leader, "two leaders at once");
    }
    // a shuts down and releases the Lease: b takes over without waiting for expiry.
    a.stop.take().expect("running").send(()).expect("stop");
    a.task.await.expect("a stops");
    wait(&mut b.state, |s| *s == Leadership::Leader).await;
    let lease = api.get("egress-proxies-operator").await.expect("lease exists");
    let spec = lease.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-b"));
    assert_eq!(spec.lease_transitions, Some(1));
    b.stop.take().expect("running").send(()).expect("stop");
    b.task.await.expect("b stops");
}

#[tokio::test]
async fn a_leader_that_cannot_renew_steps_down_and_a_crashed_leader_is_replaced_after_expiry() {
    let mut plane = ControlPlane::start().await;
    plane.create_namespace("egress-proxies-system").await;
    let api: Api<Lease> = Api::namespaced(plane.client().await, "egress-proxies-system");
    let mut a = candidate(api.clone(), "replica-a");
    wait(&mut a.state, |s| *s == Leadership::Leader).await;
    // The API server goes away for longer than the renew deadline: a cannot renew.
    plane.stop_apiserver().await;
    wait(&mut a.state, |s| *s != Leadership::Leader).await;
    plane.start_apiserver_again().await;

    // a crashes without releasing the Lease: b must wait for it to expire, then take over.
    a.task.abort();
    let _ = a.task.await;
    let mut b = candidate(api.clone(), "replica-b");
    wait(&mut b.state, |s| *s == Leadership::Leader).await;
    let spec = api
        .get("egress-proxies-operator")
        .await
        .expect("lease")
        .spec
        .expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-b"));
    assert!(spec.lease_transitions >= Some(1), "{spec:?}");
    b.stop.take().expect("running").send(()).expect("stop");
    b.task.await.expect("b stops");
}
