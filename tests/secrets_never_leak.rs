//! A canary secret value, set in a cloud-init Secret and in proxy credentials, never appears in
//! the operator's logs (at the most verbose level), in the Proxy's status or in Events — through
//! a whole lifecycle in cluster mode against a real kube-apiserver and etcd.

mod support {
    pub mod control_plane;
    pub mod controller;
    pub mod ports;
    pub mod process;
    pub mod scripted;
}

use std::{
    io::Write,
    sync::{Arc, Mutex},
    time::Duration,
};

use egress_proxies_operator::{
    api::Proxy,
    health::Verdict,
    provider::{ProviderRegistry, memory::MemoryProvider},
};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use serde_json::json;
use support::{
    control_plane::ControlPlane,
    controller::ControllerSetup,
    scripted::{ScriptedHealth, ScriptedLeases, key},
};

const CANARY: &str = "canary-7f3a9c2e-do-not-log";

/// Collects everything the subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn canary_secrets_stay_out_of_logs_status_and_events() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("trace"))
        .with_writer(move || writer.clone())
        .init();

    let (plane, client) = ControlPlane::with_crds(&["crawl"]).await;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "crawl");
    for (name, labels, data) in [
        (
            "init",
            json!({"crawl.example.com/cloud-init": "true"}),
            json!({"user-data": format!("#cloud-config\npassword: {CANARY}\n")}),
        ),
        (
            "creds",
            json!({}),
            json!({"username": "crawler", "password": CANARY}),
        ),
    ] {
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": "crawl", "labels": labels},
            "stringData": data,
        }))
        .unwrap();
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .expect("secret");
    }

    let mut providers = ProviderRegistry::new();
    providers.insert(Arc::new(MemoryProvider::new("mem")));
    let health = ScriptedHealth::new();
    let mut setup = ControllerSetup::new(client.clone(), providers, ScriptedLeases::new(), health.clone());
    setup.deps.identity = "canary-test".into();
    let controller = setup.start().await;

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": "secretive", "namespace": "crawl"},
        "spec": {"provider": "mem", "cloudInit": {"secretRef": {"name": "init"}}, "auth": {"secretRef": {"name": "creds"}}},
    }))
    .unwrap();
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("proxy");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut passed = false;
    loop {
        let phase = proxies.get("secretive").await.ok().and_then(|p| p.status?.phase);
        if phase.as_deref() == Some("provisioning") && !passed {
            health.set(&key("crawl", "secretive"), Verdict::Passing);
            controller.trigger(key("crawl", "secretive")).await;
            passed = true;
        }
        if phase.as_deref() == Some("healthy") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no Healthy; phase {phase:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = serde_json::to_string(&proxies.get("secretive").await.unwrap().status).unwrap();
    proxies
        .delete("secretive", &DeleteParams::default())
        .await
        .unwrap();
    while proxies.get_opt("secretive").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline + Duration::from_secs(15),
            "not deleted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    controller.stop().await;

    let events: Vec<String> = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), "crawl")
        .list(&Default::default())
        .await
        .expect("Events")
        .items
        .iter()
        .map(|e| serde_json::to_value(e).expect("JSON").to_string())
        .collect();
    drop(plane);
    let logs = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(logs.contains("transition"), "trace logs were captured");
    assert!(!events.is_empty(), "events were recorded");
    assert!(!logs.contains(CANARY), "the canary leaked into the logs");
    assert!(
        !status.contains(CANARY),
        "the canary leaked into the status: {status}"
    );
    for event in &events {
        assert!(
            !event.contains(CANARY),
            "the canary leaked into an Event: {event}"
        );
    }
}
