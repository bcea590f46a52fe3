//! Cluster mode as shipped, on a real kube-apiserver and etcd: two `run` replicas of the
//! operator binary, installed by `kubectl apply -k config/default` and running as the
//! ServiceAccount it binds, with the `local` provider (real Squids). The leader is killed
//! (SIGKILL, no hand-over): the other replica takes over within the lease duration, restores
//! the crawler's lease from the checkpoint ConfigMaps, and adopts the running Squid instead of
//! starting a second one. Then kube-apiserver itself restarts, and the operator carries on.

#[path = "support/http.rs"]
mod http;
mod support;

use std::{
    path::Path,
    time::{Duration, Instant},
};

use egress_proxies_operator::api::Proxy;
use hyper::{Request, StatusCode};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{
    Origin,
    cluster_app::local_proxy,
    control_plane::{ControlPlane, OPERATOR_NAMESPACE},
    free_port,
    run_process::RunProcess,
    wait_until,
};

const TOKEN: &str = "real-cluster-token-0123456789abcdef";

/// One replica: the operator binary's `run`, as the shipped ServiceAccount.
struct Replica(RunProcess);

impl Replica {
    fn start(dir: &Path, kubeconfig: &Path, identity: &str) -> Self {
        Self(RunProcess::spawn(dir, kubeconfig, identity, &[]))
    }

    /// The admin server answers /readyz with 200 (it is not up at all at first).
    async fn ready(&self) -> bool {
        tokio::net::TcpStream::connect(self.0.admin).await.is_ok()
            && http::get(self.0.admin, "/readyz").await.0 == StatusCode::OK
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: serde_json::Value,
    ) -> (StatusCode, serde_json::Value) {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "127.0.0.1")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body.to_string())))
            .unwrap();
        let (code, text) = http::request(self.0.discovery, request).await;
        (
            code,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }
}

fn phase(proxy: &Proxy) -> Option<&str> {
    proxy.status.as_ref()?.phase.as_deref()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_with_its_leases_and_no_duplicate_instance() {
    let origin = Origin::start().await;
    let mut plane = ControlPlane::start().await;
    plane.install_default().await;
    plane.create_namespace("crawl").await;
    let kubeconfig = plane.operator_kubeconfig().await;
    // Kills every Squid started under it on drop, also when the test fails half-way.
    let dir = support::standalone::Host::new();
    support::cluster_app::local_cluster(
        dir.path(),
        &dir.path().join("local"),
        TOKEN,
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    );
    let admin = plane.client().await;
    let proxies: Api<Proxy> = Api::namespaced(admin.clone(), "crawl");

    let a = Replica::start(dir.path(), &kubeconfig, "replica-a");
    wait_until(Duration::from_secs(60), "replica-a leads", async || {
        a.ready().await.then_some(())
    })
    .await;
    let b = Replica::start(dir.path(), &kubeconfig, "replica-b");

    let port = free_port();
    let proxy = local_proxy(
        "squid-1",
        port,
        &origin.http_url("/health"),
        2,
        json!({"attributes": {"region": "eu"}}),
    );
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created");
    let healthy = wait_until(Duration::from_secs(60), "squid-1 healthy", async || {
        let p = proxies.get("squid-1").await.ok()?;
        (phase(&p) == Some("healthy")).then_some(p)
    })
    .await;
    let provider_id = healthy.status.as_ref().unwrap().provider_id.clone();
    assert!(!b.ready().await, "the follower is not ready while a leads");

    let (code, lease) = a
        .call(
            "POST",
            "/v1/leases",
            json!({"selector": {"region": "eu"}, "holder": "crawler-1", "ttlSeconds": 300}),
        )
        .await;
    assert_eq!(code, StatusCode::CREATED, "{lease}");
    // The checkpoint (ConfigMaps in the operator's namespace) holds the lease before the kill.
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(admin.clone(), OPERATOR_NAMESPACE);
    wait_until(
        Duration::from_secs(30),
        "the lease in the checkpoint",
        async || {
            let parts = configmaps
                .list(&kube::api::ListParams::default().labels("crawl.example.com/lease-checkpoint"))
                .await
                .ok()?;
            parts
                .items
                .iter()
                .filter_map(|cm| cm.data.as_ref())
                .any(|data| data.values().any(|v| v.contains("crawler-1")))
                .then_some(())
        },
    )
    .await;

    // SIGKILL: no release of the leader Lease, no last checkpoint.
    let killed_at = Instant::now();
    drop(a);
    wait_until(Duration::from_secs(40), "replica-b leads", async || {
        b.ready().await.then_some(())
    })
    .await;
    let takeover = killed_at.elapsed();
    println!("replica-b ready {takeover:?} after replica-a was killed");
    assert!(
        takeover <= Duration::from_secs(15 + 2 + 5),
        "takeover took {takeover:?}: more than the lease duration (15 s), a retry period and a margin"
    );
    let lease_id = lease["leaseId"].as_str().expect("leaseId");
    let (code, renewed) = b
        .call(
            "POST",
            &format!("/v1/leases/{lease_id}/renew"),
            json!({"fencingToken": lease["fencingToken"], "ttlSeconds": 300}),
        )
        .await;
    assert_eq!(
        code,
        StatusCode::OK,
        "the new leader restored the lease: {renewed}"
    );
    // The crawler is done: a replacement would otherwise wait for its lease to drain.
    let (code, released) = b
        .call(
            "POST",
            &format!("/v1/leases/{lease_id}/release"),
            json!({"fencingToken": renewed["fencingToken"], "outcome": "ok"}),
        )
        .await;
    assert!(code.is_success(), "{released}");

    // The new leader adopted the running Squid: same instance, still healthy, no second create.
    let after = proxies.get("squid-1").await.expect("squid-1");
    assert_eq!(phase(&after), Some("healthy"));
    assert_eq!(after.status.as_ref().unwrap().provider_id, provider_id);
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), "crawl");
    let created: Vec<_> = events
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("InstanceCreated"))
        .collect();
    let count: i32 = created
        .iter()
        .map(|e| e.series.as_ref().map_or(1, |s| s.count))
        .sum();
    assert_eq!(count, 1, "one instance for squid-1: {created:#?}");

    // kube-apiserver restarts (an upgrade, a crash). If that takes longer than the renew
    // deadline (10 s; here it may), the leader steps down and exits, as designed, so that its
    // restart rejoins as a follower: the kubelet would restart it, and here the test does. If
    // it was quick enough, the watches and the leader Lease carry on by themselves. Either way
    // a spec change made afterwards is carried out.
    plane.restart_apiserver().await;
    let mut b = b;
    tokio::time::sleep(Duration::from_secs(1)).await;
    if let Some(status) = b.0.child.exited() {
        let log = b.0.child.log();
        assert!(
            log.contains("lost leadership: stopping so a restart rejoins as a follower"),
            "replica-b exited ({status}) without saying why:\n{log}"
        );
        println!("replica-b stepped down during the API server restart ({status}); restarting it");
        b = Replica::start(dir.path(), &kubeconfig, "replica-b-restarted");
        wait_until(
            Duration::from_secs(60),
            "the restarted replica leads",
            async || b.ready().await.then_some(()),
        )
        .await;
    }
    let proxies: Api<Proxy> = Api::namespaced(plane.client().await, "crawl");
    let new_port = free_port();
    proxies
        .patch(
            "squid-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"port": new_port}})),
        )
        .await
        .expect("patched");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let p = proxies.get("squid-1").await.ok();
        let status = p.as_ref().and_then(|p| p.status.clone());
        if status.as_ref().is_some_and(|s| {
            s.phase.as_deref() == Some("healthy")
                && s.endpoint.as_deref() == Some(format!("127.0.0.1:{new_port}").as_str())
        }) {
            break;
        }
        if Instant::now() > deadline {
            let log = b.0.child.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "squid-1 not replaced on port {new_port}: {status:#?}\nreplica-b:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        b.ready().await,
        "replica-b still leads after the API server restart"
    );
    let log = b.0.child.log();
    assert!(!log.contains("Forbidden"), "the shipped RBAC was enough:\n{log}");

    // Deleting the object removes its Squid (nothing outlives the test).
    proxies
        .delete("squid-1", &Default::default())
        .await
        .expect("deleted");
    wait_until(Duration::from_secs(60), "squid-1 gone", async || {
        proxies.get_opt("squid-1").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", new_port)).is_err(),
        "its Squid is gone"
    );
    drop(b);
}
