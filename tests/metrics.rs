//! Metrics after a scripted lifecycle in cluster mode (`run_cluster` against a real
//! kube-apiserver, the `local` provider running real Squid): a Proxy is created and becomes Healthy,
//! a lease is acquired and released, one acquisition is refused, the Proxy is deleted, and
//! orphan GC removes a planted orphan (and leaves another installation's alone). Then the admin server's `/metrics`, scraped over HTTP,
//! must show exactly the metric names docs/operations.md lists, with values that tell the
//! story.

#[allow(dead_code)]
mod support {
    pub mod cluster_app;
    pub mod contract;
    pub mod control_plane;
    pub mod http;
    pub mod local;
    pub mod operations_doc;
    pub mod origin;
    pub mod ports;
    pub mod process;
    pub mod wait;
}

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use bytes::Bytes;
use egress_proxies_operator::{
    api::Proxy,
    provider::{Installation, Owner, Provider, local::LocalProvider},
};
use http_body_util::Full;
use hyper::{Request, StatusCode};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::{
    Api,
    api::{DeleteParams, ListParams, PostParams},
};
use serde_json::json;
use support::{
    cluster_app::{ClusterApp, installation, local_cluster, local_proxy},
    contract::plain_request,
    control_plane::ControlPlane,
    http::{get, request},
    local::{StateDir, free_port},
    operations_doc::documented_metrics,
    origin::OriginServer,
    process::squids,
    wait::wait_until,
};

const DEADLINE: Duration = Duration::from_secs(60);
const TOKEN: &str = "metrics-token-0123456789abcdef";

async fn post(addr: SocketAddr, path: &str, body: serde_json::Value) -> (StatusCode, serde_json::Value) {
    let (status, text) = request(
        addr,
        Request::post(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request"),
    )
    .await;
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

/// The value of the sample `series` (name with labels, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.split(' ').next()?.parse().ok())
}

/// Metric names as a scrape exposes them: counters with `_total`, others as declared.
fn exposed_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| {
            let (name, kind) = rest.split_once(' ')?;
            Some(match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_tell_the_lifecycle_and_match_the_documented_names() {
    let origin = OriginServer::start().await;
    let (plane, client) = ControlPlane::with_crds(&["crawl"]).await;
    let state = StateDir::new();
    let dir = tempfile::tempdir().expect("temp dir");

    // An orphan from before, of this installation: its Proxy is long gone.
    let orphan = {
        let local = LocalProvider::for_installation(installation(&client).await, "local", state.settings())
            .expect("settings");
        let owner = Owner {
            uid: format!("{:016x}-gone", fastrand::u64(..)),
            namespace: "crawl".into(),
            name: "gone".into(),
        };
        local
            .create(&plain_request(owner, free_port()))
            .await
            .expect("orphan created")
            .id
            .native_id
    };

    // And one of another installation sharing the stateDir: GC leaves it alone and counts it.
    let (foreign, foreign_name) = {
        let other = Installation::new("another-cluster", "another");
        let local = LocalProvider::for_installation(other, "local", state.settings()).expect("settings");
        let owner = Owner {
            uid: format!("{:016x}-theirs", fastrand::u64(..)),
            namespace: "crawl".into(),
            name: "theirs".into(),
        };
        let name = local
            .create(&plain_request(owner, free_port()))
            .await
            .expect("foreign instance created")
            .id
            .native_id;
        (local, name)
    };

    let (admin_port, discovery_port, proxy_port) = (free_port(), free_port(), free_port());
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    let discovery: SocketAddr = format!("127.0.0.1:{discovery_port}").parse().unwrap();
    let mut options = local_cluster(dir.path(), &state.path(), TOKEN, admin, discovery);
    options.gc_grace = Duration::ZERO;
    options.gc_interval = Duration::from_secs(1);
    options.identity = "metrics-test".into();
    options.concurrency = 2;
    let operator = ClusterApp::start(client.clone(), options);

    // Create → Healthy.
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    let proxy = local_proxy(
        "squid-1",
        proxy_port,
        &origin.url("/health"),
        2,
        json!({"attributes": {"region": "eu"}}),
    );
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created");
    wait_until(DEADLINE, "the Proxy healthy", async || {
        let p = proxies.get("squid-1").await.ok()?;
        (p.status?.phase.as_deref() == Some("healthy")).then_some(())
    })
    .await;
    wait_until(DEADLINE, "the leader ready", async || {
        (get(admin, "/readyz").await.0 == StatusCode::OK).then_some(())
    })
    .await;

    // A lease acquired and released; an acquisition nothing matches is refused.
    let (code, lease) = post(
        discovery,
        "/v1/leases",
        json!({"selector": {"region": "eu"}, "holder": "crawler-1", "ttlSeconds": 60}),
    )
    .await;
    assert_eq!(code, StatusCode::CREATED, "{lease}");
    let (code, refused) = post(
        discovery,
        "/v1/leases",
        json!({"selector": {"region": "nowhere"}, "holder": "crawler-1"}),
    )
    .await;
    assert!(code.is_client_error() || code.is_server_error(), "{refused}");
    let refused_code = refused["error"]["code"]
        .as_str()
        .or_else(|| refused["code"].as_str())
        .unwrap_or_default()
        .to_owned();
    let (_, mid_lease) = get(admin, "/metrics").await;
    assert_eq!(
        sample(&mid_lease, "epo_discovery_leases_active"),
        Some(1.0),
        "the admin server samples active leases at scrape"
    );
    let lease_id = lease["leaseId"].as_str().expect("lease id");
    // The lease checkpoint cannot be written (an admission policy refuses ConfigMap writes in
    // the operator's namespace) while the release changes the store: the operator says so on
    // /readyz (still ready) and with an Event on its leader Lease.
    plane
        .deny_configmap_writes("egress-proxies-system", "checkpoint writes refused by the test")
        .await;
    let (code, released) = post(
        discovery,
        &format!("/v1/leases/{lease_id}/release"),
        json!({"fencingToken": lease["fencingToken"], "outcome": "ok"}),
    )
    .await;
    assert!(code.is_success(), "{released}");
    let events: Api<K8sEvent> = Api::namespaced(client.clone(), "egress-proxies-system");
    let has_event = async |reason: &str| {
        events
            .list(&ListParams::default())
            .await
            .ok()
            .is_some_and(|list| {
                list.items.iter().any(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("Lease")
                })
            })
    };
    wait_until(DEADLINE, "the checkpoint failure reported", async || {
        let (code, body) = get(admin, "/readyz").await;
        (code == StatusCode::OK
            && body.contains("lease checkpoint failing")
            && has_event("LeaseCheckpointFailed").await)
            .then_some(())
    })
    .await;
    plane.allow_configmap_writes("egress-proxies-system").await;
    wait_until(DEADLINE, "the checkpoint saved again", async || {
        let (code, body) = get(admin, "/readyz").await;
        (code == StatusCode::OK && body == "ready\n" && has_event("LeaseCheckpointRecovered").await)
            .then_some(())
    })
    .await;

    // Delete; GC removes the orphan.
    proxies
        .delete("squid-1", &DeleteParams::default())
        .await
        .expect("delete");
    wait_until(DEADLINE, "the Proxy gone", async || {
        proxies.get_opt("squid-1").await.ok()?.is_none().then_some(())
    })
    .await;
    wait_until(DEADLINE, "the orphan collected", async || {
        squids(&state.path().join(&orphan)).is_empty().then_some(())
    })
    .await;

    // The scrape: proxies per phase is sampled, so wait for it to show the deletion.
    let text = wait_until(DEADLINE, "the metrics after the lifecycle", async || {
        let (code, text) = get(admin, "/metrics").await;
        (code == StatusCode::OK
            && sample(&text, r#"epo_proxies{phase="healthy"}"#) == Some(0.0)
            && sample(&text, r#"epo_gc_deletions_total{provider="local"}"#).is_some())
        .then_some(text)
    })
    .await;
    let value = |series: &str| sample(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"));

    assert_eq!(exposed_names(&text), documented_metrics(), "{text}");
    // create, healthy, deleting, deleted: at least three reconciles end well (the first makes
    // two transitions); every reconcile, whatever its result, is timed.
    assert!(value(r#"epo_reconciles_total{result="ok"}"#) >= 3.0, "{text}");
    let reconciles: f64 = text
        .lines()
        .filter(|l| l.starts_with("epo_reconciles_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(value("epo_reconcile_duration_seconds_count"), reconciles);
    for (from, to, reason) in [
        ("pending", "provisioning", "ProvisioningStarted"),
        ("provisioning", "healthy", "Healthy"),
        ("healthy", "deleting", "DeletionRequested"),
        ("deleting", "deleted", "Deleted"),
    ] {
        assert_eq!(
            value(&format!(
                r#"epo_transitions_total{{from="{from}",to="{to}",reason="{reason}"}}"#
            )),
            1.0,
            "{from} -> {to} ({reason})"
        );
    }
    for phase in [
        "pending",
        "provisioning",
        "healthy",
        "degraded",
        "replacing",
        "deleting",
        "deleted",
    ] {
        assert_eq!(
            value(&format!(r#"epo_proxies{{phase="{phase}"}}"#)),
            0.0,
            "{phase}"
        );
    }
    assert_eq!(value(r#"epo_gc_deletions_total{provider="local"}"#), 1.0);
    assert_eq!(
        value(r#"epo_gc_foreign_instances{provider="local",kind="foreign"}"#),
        1.0
    );
    assert_eq!(
        value(r#"epo_gc_foreign_instances{provider="local",kind="legacy"}"#),
        0.0
    );
    assert_eq!(value(r#"epo_gc_adoptions_total{provider="local"}"#), 0.0);
    assert_eq!(squids(&state.path().join(&foreign_name)).len(), 1, "left running");
    foreign.delete(&foreign_name).await.expect("clean up");
    assert_eq!(value(r#"epo_provider_available{provider="local"}"#), 1.0);
    assert!(value(r#"epo_probe_duration_seconds_count{result="ok"}"#) >= 1.0);
    assert!(value(r#"epo_probe_duration_seconds_bucket{le="+Inf",result="ok"}"#) >= 1.0);
    assert_eq!(value("epo_discovery_leases_acquired_total"), 1.0);
    assert_eq!(
        value(&format!(
            r#"epo_discovery_lease_acquire_refused_total{{code="{refused_code}"}}"#
        )),
        1.0
    );
    assert_eq!(value(r#"epo_discovery_leases_released_total{code="ok"}"#), 1.0);
    assert_eq!(value("epo_discovery_leases_active"), 0.0);
    assert!(value(r#"epo_discovery_requests_total{route="acquire",code="ok"}"#) >= 1.0);
    assert!(value("epo_lease_checkpoint_failures_total") >= 1.0);
    assert!(value("epo_lease_checkpoint_last_success_timestamp_seconds") > 1.7e9);
    assert!(value("epo_lease_checkpoint_written_objects_total") >= 2.0);
    assert!(value("epo_lease_checkpoint_written_bytes_total") > 0.0);

    operator.stop().await;
}
