//! Opt-in: the controller against a REAL Kubernetes cluster, named by the kubeconfig in
//! `EPO_TEST_KUBECONFIG` (for example a kind cluster with the CRDs applied:
//! `cargo run -- crd | kubectl apply -f -`). It compiles in every run; without the variable it
//! returns at once and says so. It uses its own namespace and deletes it afterwards.

mod support {
    pub mod controller;
    pub mod scripted;
}

use std::{sync::Arc, time::Duration};

use egress_proxies_operator::{
    api::Proxy,
    effects::HealthVerdict,
    provider::{ProviderRegistry, memory::MemoryProvider},
};
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, Config,
    api::{DeleteParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::json;
use support::{
    controller::ControllerSetup,
    scripted::{ScriptedHealth, ScriptedLeases, key},
};

async fn wait_for(api: &Api<Proxy>, name: &str, done: impl Fn(Option<&Proxy>) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let current = api.get_opt(name).await.expect("readable");
        if done(current.as_ref()) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out; last: {current:#?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn phase(p: Option<&Proxy>) -> Option<&str> {
    p?.status.as_ref()?.phase.as_deref()
}

#[tokio::test]
async fn controller_converges_on_a_real_cluster() {
    let Ok(path) = std::env::var("EPO_TEST_KUBECONFIG") else {
        eprintln!(
            "not run: set EPO_TEST_KUBECONFIG to a kubeconfig of a disposable cluster (see docs/testing.md)"
        );
        return;
    };
    let kubeconfig = Kubeconfig::read_from(&path).expect("readable kubeconfig");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("valid kubeconfig");
    let client = Client::try_from(config).expect("client");
    let namespace = format!("epo-test-{:08x}", fastrand::u32(..));
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap();
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace created");

    let provider = Arc::new(MemoryProvider::new("mem"));
    let mut providers = ProviderRegistry::new();
    providers.insert(provider.clone());
    let health = ScriptedHealth::new();
    let mut setup = ControllerSetup::new(client.clone(), providers, ScriptedLeases::new(), health.clone());
    setup.deps.namespace = Some(namespace.clone());
    setup.deps.debounce = Duration::from_millis(100);
    setup.deps.identity = "real-cluster-test".into();
    let controller = setup.start().await;

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), &namespace);
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": "real-1", "namespace": namespace},
        "spec": {"provider": "mem"},
    }))
    .unwrap();
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created (are the CRDs applied?)");
    wait_for(&proxies, "real-1", |p| phase(p) == Some("provisioning")).await;
    health.set(&key(&namespace, "real-1"), HealthVerdict::Passing);
    controller.trigger(key(&namespace, "real-1")).await;
    wait_for(&proxies, "real-1", |p| phase(p) == Some("healthy")).await;
    proxies
        .delete("real-1", &DeleteParams::default())
        .await
        .expect("deleted");
    wait_for(&proxies, "real-1", |p| p.is_none()).await;
    assert!(provider.names().is_empty());

    controller.stop().await;
    namespaces
        .delete(&namespace, &DeleteParams::default())
        .await
        .expect("namespace deleted");
}
