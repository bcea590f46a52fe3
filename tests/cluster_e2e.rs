//! Cluster mode end to end in one process: `run_cluster` (leader election, controller, health
//! engine, lease store with its ConfigMap checkpoint, discovery API, admin server) against a
//! real kube-apiserver, with the `local` provider running real Squid. A Proxy object becomes
//! Healthy, a crawler leases it and fetches through it, metrics show the lifecycle, and deleting
//! the object removes its Squid.

mod support;

use std::time::Duration;

use bytes::Bytes;
use egress_proxies_operator::api::Proxy;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{DeleteParams, ListParams, PostParams},
};
use serde_json::json;
use support::{
    Origin,
    cluster_app::{ClusterApp, local_cluster, local_proxy},
    control_plane::ControlPlane,
    free_port,
    process::KillSquidsUnder,
    wait_until,
};

async fn send(port: u16, method: &str, path: &str, token: Option<&str>, body: &str) -> (StatusCode, String) {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    if let Some(token) = token {
        request = request
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json");
    }
    let response = sender
        .send_request(request.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .expect("response");
    let status = response.status();
    let bytes = response.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_object_becomes_a_leased_squid_and_goes_away() {
    let origin = Origin::start().await;
    let plane = ControlPlane::start().await;
    let operator_client = plane.install_default().await;
    plane.create_namespace("crawl").await;
    // The test writes as the admin; the operator may do only what its RBAC grants.
    let client = plane.client().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let _squids = KillSquidsUnder(dir.path().to_owned());
    let token = "e2e-token-0123456789abcdef";
    let (admin_port, discovery_port, proxy_port) = (free_port(), free_port(), free_port());
    let mut options = local_cluster(
        dir.path(),
        &dir.path().join("local"),
        token,
        format!("127.0.0.1:{admin_port}").parse().unwrap(),
        format!("127.0.0.1:{discovery_port}").parse().unwrap(),
    );
    options.identity = "replica-a".into();
    // Nothing but a change may move a draining Proxy on within the test: the poll of a state
    // that waits for the world, and the resync, are longer than the test.
    options.reconciler.timers.poll = Duration::from_secs(3600);
    options.reconciler.timers.resync = Duration::from_secs(3600);
    let operator = ClusterApp::start(operator_client, options);

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    let proxy = local_proxy(
        "squid-1",
        proxy_port,
        &origin.http_url("/health"),
        2,
        json!({"attributes": {"region": "eu"}}),
    );
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created");
    let reaches = async |phase: &str| {
        wait_until(
            Duration::from_secs(60),
            &format!("the Proxy {phase}"),
            async || {
                let p = proxies.get("squid-1").await.ok()?;
                (p.status?.phase.as_deref() == Some(phase)).then_some(())
            },
        )
        .await
    };
    reaches("healthy").await;
    wait_until(Duration::from_secs(60), "the leader is ready", async || {
        (send(admin_port, "GET", "/readyz", None, "").await.0 == StatusCode::OK).then_some(())
    })
    .await;

    let (code, lease) = send(
        discovery_port,
        "POST",
        "/v1/leases",
        Some(token),
        r#"{"selector":{"region":"eu"},"holder":"crawler-1","ttlSeconds":60}"#,
    )
    .await;
    assert_eq!(code, StatusCode::CREATED, "{lease}");
    let lease: serde_json::Value = serde_json::from_str(&lease).unwrap();
    assert_eq!(lease["proxyUrl"], format!("http://127.0.0.1:{proxy_port}"));
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", proxy_port))
        .await
        .expect("proxy");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let response = sender
        .send_request(
            Request::get(origin.http_url("/ip"))
                .header("host", "127.0.0.1")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .expect("through the proxy");
    assert_eq!(response.status(), StatusCode::OK);

    // The lease checkpoint lands in the cluster, in the operator's namespace: one part per
    // changed lease-store shard, found by label.
    wait_until(Duration::from_secs(60), "the lease checkpoint", async || {
        let parts = Api::<ConfigMap>::namespaced(client.clone(), "egress-proxies-system")
            .list(&ListParams::default().labels("crawl.example.com/lease-checkpoint=egress-proxies-operator"))
            .await
            .ok()?;
        parts
            .items
            .into_iter()
            .filter_map(|cm| cm.data)
            .any(|data| data.values().any(|v| v.contains("crawler-1")))
            .then_some(())
    })
    .await;
    let (code, metrics) = send(admin_port, "GET", "/metrics", None, "").await;
    assert_eq!(code, StatusCode::OK);
    assert!(
        metrics.contains(r#"epo_transitions_total{from="provisioning",to="healthy",reason="Healthy"} 1"#),
        "{metrics}"
    );

    // Deleting the object drains: the Squid serves the held lease until it is released, and the
    // release itself moves the deletion on (the poll would be an hour away).
    proxies
        .delete("squid-1", &DeleteParams::default())
        .await
        .expect("delete");
    reaches("deleting").await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", proxy_port)).is_ok(),
        "the Squid serves the held lease while the Proxy drains"
    );
    let lease_id = lease["leaseId"].as_str().unwrap();
    let (code, _) = send(
        discovery_port,
        "POST",
        &format!("/v1/leases/{lease_id}/release"),
        Some(token),
        &format!(r#"{{"fencingToken":{},"outcome":"ok"}}"#, lease["fencingToken"]),
    )
    .await;
    assert!(code.is_success());
    wait_until(Duration::from_secs(60), "the Proxy is gone", async || {
        proxies.get_opt("squid-1").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", proxy_port)).is_err(),
        "the Squid is gone"
    );

    operator.stop().await;
}
