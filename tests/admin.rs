//! The admin server over a real socket: liveness always, readiness only when caches are synced
//! and this replica leads, metrics in the OpenMetrics text format.

mod support {
    pub mod http;
}

use std::sync::Arc;

use egress_proxies_operator::telemetry::{
    Metrics,
    admin::{Readiness, serve_admin},
};
use hyper::StatusCode;
use prometheus_client::registry::Registry;
use support::http::get;
use tokio::sync::{oneshot, watch};

#[tokio::test]
async fn probes_follow_readiness_and_metrics_are_exposed() {
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    metrics.observe_reconcile(std::time::Duration::from_millis(3), None);
    metrics.observe_reconcile(std::time::Duration::from_millis(3), Some("Conflict"));
    metrics.observe_transition("pending", "provisioning", "ProvisioningStarted");
    let (ready_tx, ready_rx) = watch::channel(Readiness::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve_admin(listener, ready_rx, Arc::new(registry), async {
        let _ = stopped.await;
    }));

    assert_eq!(get(addr, "/healthz").await.0, StatusCode::OK);
    assert_eq!(
        get(addr, "/readyz").await,
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n".to_owned())
    );
    ready_tx.send_replace(Readiness {
        caches_synced: true,
        leader: false,
        checkpoint_failing: false,
    });
    assert_eq!(
        get(addr, "/readyz").await,
        (StatusCode::SERVICE_UNAVAILABLE, "not the leader\n".to_owned())
    );
    ready_tx.send_replace(Readiness {
        caches_synced: true,
        leader: true,
        checkpoint_failing: false,
    });
    assert_eq!(get(addr, "/readyz").await, (StatusCode::OK, "ready\n".to_owned()));
    // A failing lease checkpoint is a detail, not a reason to stop serving.
    ready_tx.send_replace(Readiness {
        caches_synced: true,
        leader: true,
        checkpoint_failing: true,
    });
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("lease checkpoint failing"), "{body}");

    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#"epo_reconciles_total{result="ok"} 1"#), "{body}");
    assert!(
        body.contains(r#"epo_reconciles_total{result="Conflict"} 1"#),
        "{body}"
    );
    assert!(
        body.contains(
            r#"epo_transitions_total{from="pending",to="provisioning",reason="ProvisioningStarted"} 1"#
        ),
        "{body}"
    );
    assert!(body.contains("epo_reconcile_duration_seconds_bucket"), "{body}");
    assert_eq!(get(addr, "/nope").await.0, StatusCode::NOT_FOUND);

    stop.send(()).expect("server running");
    server.await.expect("server stops cleanly");
}
