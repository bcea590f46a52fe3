//! The provider-health monitor over a `kvm2` instance on a private libvirtd, publishing
//! `ProviderHealth` objects to a real kube-apiserver, next to the cluster controller: when the
//! daemon goes away the object flips to unavailable with the reason, a new Proxy on it is held
//! in `pending` saying why, and when the daemon comes back on the same socket the object flips
//! back and the held Proxy is provisioned at once; its instance is counted by the next probe.
//! Writes happen only when what the object shows changes (counted by the API server itself),
//! and only a flip moves the condition's transition time, also across a restart.

mod support {
    pub mod control_plane;
    pub mod ports;
    pub mod process;
    pub mod wait;
}
#[path = "support/libvirt_requests.rs"]
mod libvirt_requests;
#[path = "support/libvirtd.rs"]
mod libvirtd;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use egress_proxies_operator::{
    api::{ProviderHealth, Proxy},
    cluster::{ClusterDeps, KubeHealthSink, run_controller},
    controller::{ProviderAvailability, ReconcilerConfig},
    health::{HealthConfig, HealthEngine},
    lease::{LeaseStore, LeaseStoreConfig},
    monitor::Monitor,
    provider::{ProviderRegistry, kvm2::Kvm2Provider},
    telemetry::Metrics,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use libvirt_requests::{settings, user_network};
use libvirtd::PrivateLibvirtd;
use prometheus_client::registry::Registry;
use serde_json::json;
use support::{
    control_plane::{ControlPlane, RequestCounts},
    wait::wait_until,
};
use tokio::sync::{mpsc, oneshot, watch};

const PROVIDER: &str = "kvm2-mon";
const DEADLINE: Duration = Duration::from_secs(30);

fn available(health: &ProviderHealth) -> Condition {
    health
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Available"))
        .cloned()
        .expect("an Available condition")
}

/// Successful writes to ProviderHealth objects (and their status) since `start`.
async fn health_writes(plane: &ControlPlane, start: &RequestCounts) -> usize {
    let now = plane.settled_request_counts().await;
    now.successful_writes_since(start, "providerhealths") as usize
}

fn gauge(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("encodes");
    text.lines()
        .find(|l| l.starts_with(&format!("epo_provider_available{{provider=\"{PROVIDER}\"}}")))
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_health_follows_a_libvirt_daemon_away_and_back_and_holds_provisioning_meanwhile() {
    virt::error::clear_error_callback();
    let mut daemon = PrivateLibvirtd::start();
    daemon.dir_pool_with_base("epo", "base.qcow2");
    let socket = daemon
        .uri()
        .split_once("socket=")
        .map(|(_, path)| path.to_owned())
        .expect("socket in the URI");
    let mut providers = ProviderRegistry::new();
    providers.insert(Arc::new(Kvm2Provider::new(
        PROVIDER,
        settings(daemon.uri(), "epo", user_network(24600)),
    )));
    let (plane, client) = ControlPlane::with_crds(&["crawl"]).await;
    let start = plane.settled_request_counts().await;
    let healths: Api<ProviderHealth> = Api::all(client.clone());

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let availability = ProviderAvailability::default();
    let flips = Arc::new(Mutex::new(Vec::new()));
    let (flipped_tx, flipped_rx) = mpsc::unbounded_channel();
    let mut monitor = Monitor::new(
        providers.clone(),
        availability.clone(),
        Arc::new(KubeHealthSink::new(client.clone())),
        Duration::from_secs(10),
    )
    .with_metrics(metrics.clone())
    .on_change({
        let flips = flips.clone();
        Arc::new(move |name: &str| {
            flips.lock().unwrap().push(name.to_owned());
            let _ = flipped_tx.send(name.to_owned());
        })
    });

    // Available: one object, written once however often it is probed.
    monitor.probe_all().await;
    let health = healths.get(PROVIDER).await.expect("ProviderHealth exists");
    let condition = available(&health);
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        ("True", "ProbeSucceeded")
    );
    let status = health.status.as_ref().expect("status");
    assert_eq!(status.provider_type.as_deref(), Some("kvm2"));
    assert!(status.message.as_deref().unwrap_or_default().contains("libvirt"));
    let writes = health_writes(&plane, &start).await;
    assert_eq!(writes, 2, "create, then its status");
    monitor.probe_all().await;
    assert_eq!(health_writes(&plane, &start).await, writes, "no change, no write");
    assert!(gauge(&registry).ends_with(" 1"), "{}", gauge(&registry));
    assert!(flips.lock().unwrap().is_empty(), "the first probe is no flip");

    // The daemon goes away.
    daemon.stop();
    monitor.probe_all().await;
    let condition = available(&healths.get(PROVIDER).await.expect("exists"));
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        ("False", "ProbeFailed")
    );
    assert!(
        condition.message.contains(&socket),
        "the reason names what is unreachable: {}",
        condition.message
    );
    assert_eq!(health_writes(&plane, &start).await, writes + 1);
    monitor.probe_all().await;
    assert_eq!(
        health_writes(&plane, &start).await,
        writes + 1,
        "still down, no write"
    );
    assert!(gauge(&registry).ends_with(" 0"), "{}", gauge(&registry));
    assert_eq!(*flips.lock().unwrap(), [PROVIDER]);
    let down = availability.down_reason(PROVIDER).expect("down");

    // Meanwhile a new Proxy on it is held in pending, saying why.
    let (health_engine, _events) = HealthEngine::start(HealthConfig::default()).expect("health engine");
    let (_triggers_tx, triggers_rx) = mpsc::channel(16);
    let (ready_tx, mut ready) = watch::channel(false);
    let (stop, stopped) = oneshot::channel::<()>();
    let controller = tokio::spawn(run_controller(
        ClusterDeps {
            client: client.clone(),
            providers: providers.clone(),
            leases: Arc::new(LeaseStore::new(LeaseStoreConfig::default())),
            health: Arc::new(health_engine),
            availability: availability.clone(),
            // Default timers: a held Proxy retries after a minute, so resuming within the
            // deadline below is the flip's doing.
            reconciler: ReconcilerConfig::default(),
            namespace: None,
            concurrency: 2,
            debounce: Duration::from_millis(10),
            identity: "monitor-test".into(),
            metrics,
            status_feed: None,
            // Flips re-reconcile the provider's Proxies, found in the controller's cache.
            provider_flips: Some(flipped_rx),
        },
        futures::stream::unfold(
            triggers_rx,
            |mut rx| async move { rx.recv().await.map(|k| (k, rx)) },
        ),
        ready_tx,
        async {
            let _ = stopped.await;
        },
    ));
    tokio::time::timeout(DEADLINE, ready.wait_for(|r| *r))
        .await
        .expect("caches sync")
        .expect("ready");
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": "held", "namespace": "crawl"},
        "spec": {"provider": PROVIDER},
    }))
    .expect("valid");
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created");
    let ready_condition = wait_until(DEADLINE, "the Proxy held for its provider", async || {
        let status = proxies.get("held").await.ok()?.status?;
        let ready = status.conditions.iter().find(|c| c.type_ == "Ready")?.clone();
        (status.phase.as_deref() == Some("pending") && ready.reason == "ProviderUnavailable").then_some(ready)
    })
    .await;
    assert_eq!(ready_condition.status, "False");
    assert_eq!(ready_condition.message, format!("provider unavailable: {down}"));

    // The daemon comes back on the same socket: the object flips back and the held Proxy is
    // provisioned now.
    daemon.restart();
    monitor.probe_all().await;
    let condition = available(&healths.get(PROVIDER).await.expect("exists"));
    let back_since = condition.last_transition_time.clone();
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        ("True", "ProbeSucceeded")
    );
    // (No second probe here: the flip starts the held Proxy's instance, which the next probe
    // counts; the steady state is probed again below, once the instance exists.)
    assert_eq!(health_writes(&plane, &start).await, writes + 2);
    assert_eq!(*flips.lock().unwrap(), [PROVIDER, PROVIDER]);
    assert_eq!(availability.down_reason(PROVIDER), None);
    let held = wait_until(DEADLINE, "the held Proxy provisioned", async || {
        let proxy = proxies.get("held").await.ok()?;
        (proxy.status.as_ref()?.phase.as_deref() == Some("provisioning")).then_some(proxy)
    })
    .await;
    let provider_id = held.status.and_then(|s| s.provider_id).expect("a provider ID");
    let domain = provider_id
        .rsplit('/')
        .next()
        .expect("type/instance/name")
        .to_owned();
    assert!(daemon.domains().contains(&domain), "{domain} defined");

    // What the object shows follows the provider: the new domain is counted by the next probe.
    // The condition stays as it was, and so does its transition time, also once the clock has
    // moved past it (the API keeps whole seconds) and for a restarted monitor, which has
    // published nothing yet.
    wait_until(DEADLINE, "the clock a second past the flip", async || {
        (jiff::Timestamp::now() >= back_since.0 + jiff::SignedDuration::from_secs(1)).then_some(())
    })
    .await;
    monitor.probe_all().await;
    let health = healths.get(PROVIDER).await.expect("exists");
    assert_eq!(health.status.as_ref().and_then(|s| s.instance_count), Some(1));
    assert_eq!(available(&health).last_transition_time, back_since);
    assert_eq!(health_writes(&plane, &start).await, writes + 3);
    monitor.probe_all().await;
    assert_eq!(
        health_writes(&plane, &start).await,
        writes + 3,
        "the same found again, no write"
    );
    let mut restarted = Monitor::new(
        providers,
        ProviderAvailability::default(),
        Arc::new(KubeHealthSink::new(client.clone())),
        Duration::from_secs(10),
    );
    restarted.probe_all().await;
    let condition = available(&healths.get(PROVIDER).await.expect("exists"));
    assert_eq!(condition.status, "True");
    assert_eq!(
        condition.last_transition_time, back_since,
        "available since the flip, not the restart"
    );
    assert_eq!(
        health_writes(&plane, &start).await,
        writes + 3,
        "a restarted monitor finding what the object shows writes nothing"
    );

    // Deleting the Proxy removes the domain; then everything stops.
    proxies
        .delete("held", &DeleteParams::default())
        .await
        .expect("delete");
    wait_until(DEADLINE, "the Proxy gone", async || {
        proxies.get_opt("held").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(!daemon.domains().contains(&domain), "{domain} removed");
    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, controller)
        .await
        .expect("controller stops")
        .expect("no panic");
    drop(monitor);
}
