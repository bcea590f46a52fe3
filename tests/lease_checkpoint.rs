//! The cluster-mode lease checkpoint (ConfigMap parts per lease-store shard) against a real
//! kube-apiserver and etcd: 100,000 active leases checkpoint and restore, only changed shards are
//! written, and a save that fails while the API server is down is reported and retried.

mod support;

use std::{collections::BTreeMap, time::Duration};

use egress_proxies_operator::{
    cluster::{CHECKPOINT_LABEL, ConfigMapCheckpoint},
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{CheckpointReport, CheckpointSaver, CheckpointStore, encode_chunks},
    },
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api, Client,
    api::{ListParams, ObjectMeta, PostParams},
};
use support::{control_plane::ControlPlane, leases::filled_store};

/// The checkpoint's parts in `namespace`, by name, with their resourceVersions.
async fn parts(client: &Client, namespace: &str) -> BTreeMap<String, String> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    api.list(&ListParams::default().labels(&format!("{CHECKPOINT_LABEL}=egress-proxies-operator")))
        .await
        .expect("listing checkpoint parts")
        .items
        .into_iter()
        .map(|cm| {
            (
                cm.metadata.name.unwrap_or_default(),
                cm.metadata.resource_version.unwrap_or_default(),
            )
        })
        .collect()
}

/// Parts whose resourceVersion differs between two listings (written in between).
fn changed(before: &BTreeMap<String, String>, after: &BTreeMap<String, String>) -> Vec<String> {
    after
        .iter()
        .filter(|(name, version)| before.get(*name) != Some(version))
        .map(|(name, _)| name.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_leases_checkpoint_in_parts_and_restore_on_a_new_leader() {
    let plane = ControlPlane::start().await;
    let client = plane.client().await;
    let namespace = plane.namespace("checkpoint").await;
    let (store, _) = filled_store(100_000);
    assert_eq!(store.active_total(), 100_000);

    let sink = ConfigMapCheckpoint::new(client.clone(), &namespace);
    let report = CheckpointReport::default();
    // The API server's own counts of ConfigMap writes: etcd's revision also moves with what the
    // control plane writes meanwhile (the new namespace's default ServiceAccount, its own
    // leases), so it cannot tell the checkpoint's writes apart.
    let requests_before = plane.settled_request_counts().await;
    CheckpointSaver::default()
        .save(&store, &sink, &report)
        .await
        .expect("every part fits a ConfigMap");
    let written = report.written();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let listed = api
        .list(&ListParams::default().labels(&format!("{CHECKPOINT_LABEL}=egress-proxies-operator")))
        .await
        .unwrap()
        .items;
    assert_eq!(written.objects, listed.len() as u64);
    assert_eq!(
        plane
            .request_counts()
            .await
            .successful_writes_since(&requests_before, "configmaps"),
        listed.len() as f64,
        "one write per part"
    );
    assert!(
        listed.len() > store.shard_count(),
        "a 100k-lease shard needs more than one part: {} parts",
        listed.len()
    );
    for cm in &listed {
        let size: usize = cm.data.as_ref().unwrap().values().map(String::len).sum();
        assert!(
            size <= 512 * 1024,
            "{} holds {size} bytes",
            cm.metadata.name.as_deref().unwrap()
        );
    }

    // A new leader: a fresh process loads the parts and restores every lease.
    let loaded = ConfigMapCheckpoint::new(plane.client().await, &namespace)
        .load()
        .await
        .unwrap()
        .expect("a checkpoint was saved");
    assert_eq!(loaded.lease_count(), 100_000);
    let want = store.checkpoint();
    assert_eq!(loaded.proxies, want.proxies);
    assert_eq!(loaded.token_hwm, want.token_hwm);
    let successor = LeaseStore::new(LeaseStoreConfig::default());
    successor.restore(&loaded);
    assert_eq!(successor.active_total(), 100_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_configmap_layout_fails_at_scale() {
    // What cluster mode did before parts: every chunk a key of one ConfigMap.
    let plane = ControlPlane::start().await;
    let (store, _) = filled_store(100_000);
    let data: BTreeMap<String, String> = encode_chunks(&store.checkpoint(), 256 * 1024)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (format!("chunk-{i:04}"), c))
        .collect();
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("egress-proxies-operator".to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(data),
        ..ConfigMap::default()
    };
    let api: Api<ConfigMap> = Api::namespaced(plane.client().await, "default");
    match api.create(&PostParams::default(), &cm).await {
        Err(kube::Error::Api(status)) => assert!(
            status.code == 413 || status.code == 422,
            "refused by the server: {status:?}"
        ),
        other => panic!("a {}-lease ConfigMap must not fit: {other:?}", 100_000),
    }
}

#[tokio::test]
async fn only_changed_shards_are_written() {
    let plane = ControlPlane::start().await;
    let client = plane.client().await;
    let namespace = plane.namespace("checkpoint").await;
    let (store, held) = filled_store(2_000);
    let sink = ConfigMapCheckpoint::new(client.clone(), &namespace);
    let report = CheckpointReport::default();
    let mut saver = CheckpointSaver::default();
    saver.save(&store, &sink, &report).await.unwrap();
    let first = parts(&client, &namespace).await;
    assert_eq!(first.len(), store.shard_count(), "one part per shard: {first:?}");

    // Nothing changed: nothing is written.
    let requests = plane.request_counts().await;
    saver.save(&store, &sink, &report).await.unwrap();
    assert_eq!(
        plane.request_counts().await.writes_since(&requests, "configmaps"),
        0.0
    );
    assert_eq!(parts(&client, &namespace).await, first);

    // One renewal: only its shard's part is written.
    let (id, token) = &held[7];
    store.renew(id, *token, None).unwrap();
    let requests = plane.request_counts().await;
    saver.save(&store, &sink, &report).await.unwrap();
    assert_eq!(
        plane.request_counts().await.writes_since(&requests, "configmaps"),
        1.0
    );
    let renewed = changed(&first, &parts(&client, &namespace).await);
    assert_eq!(renewed.len(), 1, "{renewed:?}");
    assert!(first.contains_key(&renewed[0]));

    // And the renewal is in what a successor loads.
    let loaded = ConfigMapCheckpoint::new(client, &namespace)
        .load()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.proxies, store.checkpoint().proxies);
}

#[tokio::test]
async fn a_checkpoint_that_cannot_be_written_is_reported_and_retried() {
    let mut plane = ControlPlane::start().await;
    let client = plane.client().await;
    let namespace = plane.namespace("checkpoint").await;
    let (store, held) = filled_store(500);
    let sink = ConfigMapCheckpoint::new(client.clone(), &namespace);
    let report = CheckpointReport::default();
    let mut health = report.subscribe();
    let mut saver = CheckpointSaver::default();
    saver.save(&store, &sink, &report).await.unwrap();
    let saved = parts(&client, &namespace).await;
    let objects_before = report.written().objects;

    // Two leases renewed while the API server is down: the save fails and says so.
    for (id, token) in &held[..2] {
        store.renew(id, *token, None).unwrap();
    }
    plane.stop_apiserver().await;
    let error = saver.save(&store, &sink, &report).await.unwrap_err();
    assert!(error.to_string().contains("checkpoint backend"), "{error}");
    assert_eq!(report.failures(), 1);
    assert!(health.has_changed().unwrap());
    let now = health.borrow_and_update().clone();
    assert!(now.failing.is_some(), "{now:?}");
    assert_eq!(now.consecutive_failures, 1);
    assert_eq!(report.written().objects, objects_before);

    // The outage ends: the next save writes the shards that failed, and only those.
    plane.start_apiserver_again().await;
    let requests = plane.request_counts().await;
    saver.save(&store, &sink, &report).await.unwrap();
    assert_eq!(report.failures(), 1);
    assert_eq!(report.health().failing, None);
    let rewritten = changed(&saved, &parts(&client, &namespace).await);
    assert!(
        (1..=2).contains(&rewritten.len()),
        "the renewed leases' shards: {rewritten:?}"
    );
    assert_eq!(
        plane.request_counts().await.writes_since(&requests, "configmaps"),
        rewritten.len() as f64
    );
    assert_eq!(report.written().objects, objects_before + rewritten.len() as u64);
    let loaded = sink.load().await.unwrap().unwrap();
    assert_eq!(loaded.lease_count(), 500);
    assert_eq!(loaded.proxies, store.checkpoint().proxies);
}

#[tokio::test]
async fn maintenance_reports_failures_until_saves_succeed() {
    // The loop cluster mode runs: its failures reach the report while it keeps serving.
    let mut plane = ControlPlane::start().await;
    let namespace = plane.namespace("checkpoint").await;
    let (store, _) = filled_store(100);
    let sink = std::sync::Arc::new(ConfigMapCheckpoint::new(plane.client().await, &namespace));
    let report = CheckpointReport::default();
    plane.stop_apiserver().await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(egress_proxies_operator::lease::checkpoint::maintenance(
        store.clone(),
        Some(sink as std::sync::Arc<dyn CheckpointStore>),
        egress_proxies_operator::lease::checkpoint::MaintenanceConfig {
            reap_interval: Duration::from_millis(20),
            checkpoint_interval: Duration::from_millis(20),
            report: report.clone(),
        },
        async {
            let _ = stopped.await;
        },
    ));
    let mut health = report.subscribe();
    tokio::time::timeout(
        Duration::from_secs(10),
        health.wait_for(|h| h.consecutive_failures >= 2),
    )
    .await
    .expect("failures are reported")
    .unwrap();
    plane.start_apiserver_again().await;
    tokio::time::timeout(Duration::from_secs(30), health.wait_for(|h| h.failing.is_none()))
        .await
        .expect("a successful save clears the failure")
        .unwrap();
    assert!(report.failures() >= 2);
    assert_eq!(
        parts(&plane.client().await, &namespace).await.len(),
        report.written().objects as usize,
        "every shard written once the server is back"
    );
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[test]
fn parts_written_at_different_times_merge_to_the_newest_state() {
    use egress_proxies_operator::{
        api::ProxyKey,
        lease::checkpoint::{Checkpoint, CheckpointAdmission, ProxyCheckpoint, SessionCheckpoint},
    };
    let proxy = |name: &str, admission| ProxyCheckpoint {
        key: ProxyKey::new("ns", name),
        admission,
        cooldown_until_ms: None,
        revoked_below: 0,
        bans: Vec::new(),
        leases: Vec::new(),
    };
    let session = |proxy: &str, expires_at_ms| SessionCheckpoint {
        session_key: "s1".to_owned(),
        proxy: ProxyKey::new("ns", proxy),
        expires_at_ms,
    };
    // `a` moved from an older part to a newer one; the session was bound again elsewhere.
    let older = Checkpoint {
        version: Checkpoint::VERSION,
        saved_at_ms: 1_000,
        token_hwm: BTreeMap::from([(0, 500), (1, 900)]),
        proxies: vec![
            proxy("a", CheckpointAdmission::Open),
            proxy("b", CheckpointAdmission::Open),
        ],
        sessions: vec![session("a", 5_000)],
        journal_seq: None,
    };
    let newer = Checkpoint {
        version: Checkpoint::VERSION,
        saved_at_ms: 2_000,
        token_hwm: BTreeMap::from([(0, 700)]),
        proxies: vec![proxy("a", CheckpointAdmission::Draining)],
        sessions: vec![session("c", 9_000)],
        journal_seq: None,
    };
    let merged = Checkpoint::merge([newer, older]).unwrap();
    assert_eq!(merged.saved_at_ms, 2_000);
    assert_eq!(merged.token_hwm, BTreeMap::from([(0, 700), (1, 900)]));
    assert_eq!(
        merged.proxies,
        vec![
            proxy("a", CheckpointAdmission::Draining),
            proxy("b", CheckpointAdmission::Open)
        ]
    );
    assert_eq!(merged.sessions, vec![session("c", 9_000)]);
    assert_eq!(Checkpoint::merge(Vec::new()), None);
}

#[test]
fn shard_parts_together_are_the_whole_checkpoint() {
    let (store, _) = filled_store(1_000);
    let all: Vec<usize> = (0..store.shard_count()).collect();
    let parts = store.checkpoint_shards(&all);
    assert_eq!(parts.len(), store.shard_count());
    assert!(
        parts.iter().all(|p| p.lease_count() < 1_000),
        "the leases are spread"
    );
    let whole = store.checkpoint();
    let merged = egress_proxies_operator::lease::checkpoint::Checkpoint::merge(parts).unwrap();
    assert_eq!(merged.proxies, whole.proxies);
    assert_eq!(merged.sessions, whole.sessions);
    assert_eq!(merged.token_hwm, whole.token_hwm);
    assert_eq!(merged.lease_count(), 1_000);
}
