//! Cluster mode with the `kubernetes` provider on a real control plane (kube-apiserver, etcd,
//! the controller manager, kube-scheduler and kwok's fake node), installed by
//! `kubectl apply -k config/default` and running as the shipped ServiceAccount: a Proxy's Squid
//! Pod is accepted, labelled and Running; deleted behind the operator's back, it is made again;
//! its health check through the Pod cannot pass (kwok runs no container), so the provisioning
//! timeout replaces it as documented; deleting the Proxy removes its Pod; and a Pod whose Proxy
//! went while no operator ran is collected by orphan GC.

mod support;

use std::time::Duration;

use egress_proxies_operator::api::Proxy;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api,
    api::{DeleteParams, ListParams, PostParams},
};
use serde_json::json;
use support::{
    cluster_app::{ClusterApp, local_cluster},
    control_plane::{ControlPlane, Options},
    free_port, wait_until,
};

const POD_NAMESPACE: &str = "egress-proxies";

/// A control plane with Pods that run (the scheduler, kwok) and namespaces that get their
/// `default` ServiceAccount (the controller manager), the product installed; returns it, a
/// client that is the operator's ServiceAccount, and the admin's.
async fn cluster() -> (ControlPlane, kube::Client, kube::Client) {
    let plane = ControlPlane::start_with(Options {
        nodes: true,
        controller_manager: true,
        ..Options::default()
    })
    .await;
    let operator_client = plane.install_default().await;
    plane.create_namespace("crawl").await;
    let admin = plane.client().await;
    (plane, operator_client, admin)
}

/// Cluster mode's options with the `kubernetes` provider as config/manager ships it (Pods in
/// egress-proxies), its files written into `dir`.
fn kubernetes_cluster(dir: &std::path::Path) -> egress_proxies_operator::cluster::ClusterOptions {
    let options = local_cluster(
        dir,
        &dir.join("local"),
        "kubernetes-provider-token-0123456789",
        ([127, 0, 0, 1], free_port()).into(),
        ([127, 0, 0, 1], free_port()).into(),
    );
    std::fs::write(
        dir.join("providers.yaml"),
        "providers:\n  - name: cluster\n    type: kubernetes\n    settings:\n      namespace: egress-proxies\n      \
         image: registry.example.com/squid:5.7\n      serviceType: ClusterIP\n",
    )
    .expect("providers config");
    options
}

/// A Proxy `crawl/<name>` of that provider, probed through its Pod (which never answers).
async fn create_pod_proxy(proxies: &Api<Proxy>, name: &str) {
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": name, "namespace": "crawl"},
        "spec": {
            "provider": "cluster",
            "health": {"url": "http://127.0.0.1:9/", "intervalSeconds": 2, "timeoutSeconds": 1},
        },
    }))
    .expect("a valid Proxy");
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn squid_pods_are_made_again_replaced_on_timeout_and_removed() {
    let (_plane, operator_client, admin) = cluster().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut options = kubernetes_cluster(dir.path());
    options.reconciler.timers.provisioning_timeout = Duration::from_secs(8);
    options.reconciler.timers.poll = Duration::from_secs(1);
    let operator = ClusterApp::start(operator_client, options);

    let proxies: Api<Proxy> = Api::namespaced(admin.clone(), "crawl");
    create_pod_proxy(&proxies, "pod-proxy").await;

    let pods: Api<Pod> = Api::namespaced(admin.clone(), POD_NAMESPACE);
    let selector = ListParams::default().labels("crawl.example.com/provider-instance=cluster");
    // Accepted by the server, labelled as docs/providers-existing.md says, Running on kwok's node.
    let first = wait_until(Duration::from_secs(60), "a Running Squid Pod", async || {
        let list = pods.list(&selector).await.ok()?;
        let pod = list.items.into_iter().next()?;
        (pod.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(pod)
    })
    .await;
    let labels = first.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("app.kubernetes.io/managed-by").map(String::as_str),
        Some("egress-proxies-operator")
    );
    let annotations = first.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get("crawl.example.com/owner-name")
            .map(String::as_str),
        Some("pod-proxy")
    );
    assert!(first.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("kwok-node-0"));
    let first_uid = first.metadata.uid.clone().expect("uid");
    let name = first.metadata.name.clone().expect("name");

    // Deleted behind the operator's back: the instance vanished, and a new Pod takes its place.
    pods.delete(&name, &DeleteParams::default())
        .await
        .expect("deleted");
    let second_uid = wait_until(Duration::from_secs(60), "the Pod made again", async || {
        let pod = pods.get_opt(&name).await.ok()??;
        let uid = pod.metadata.uid.clone()?;
        (uid != first_uid && pod.metadata.deletion_timestamp.is_none()).then_some(uid)
    })
    .await;

    // The health check cannot pass through a kwok Pod: after the provisioning timeout the
    // instance is deleted and created afresh (reason ProvisioningTimedOut), as documented.
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(admin.clone(), "crawl");
    wait_until(Duration::from_secs(90), "ProvisioningTimedOut", async || {
        let list = events.list(&Default::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| e.reason.as_deref() == Some("ProvisioningTimedOut"))
            .then_some(())
    })
    .await;
    wait_until(Duration::from_secs(60), "a replacement Pod", async || {
        let pod = pods.get_opt(&name).await.ok()??;
        (pod.metadata.uid.as_deref() != Some(second_uid.as_str())
            && pod.metadata.deletion_timestamp.is_none())
        .then_some(())
    })
    .await;
    let proxy = proxies.get("pod-proxy").await.expect("the Proxy");
    assert_ne!(
        proxy.status.and_then(|s| s.phase).as_deref(),
        Some("healthy"),
        "never healthy: nothing answers through a kwok Pod"
    );

    // Deleting the Proxy removes its Pod (and the finalizer, once the Pod is gone).
    proxies
        .delete("pod-proxy", &DeleteParams::default())
        .await
        .expect("deleted");
    wait_until(
        Duration::from_secs(90),
        "the Proxy and its Pod gone",
        async || {
            let proxy_gone = proxies.get_opt("pod-proxy").await.ok()?.is_none();
            let pods_gone = pods.list(&selector).await.ok()?.items.is_empty();
            (proxy_gone && pods_gone).then_some(())
        },
    )
    .await;
    operator.stop().await;
}

/// A Squid Pod whose Proxy went while no operator ran (its finalizer removed by hand) is an
/// orphan: orphan GC, past its grace, deletes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_squid_pod_is_collected() {
    let (_plane, operator_client, admin) = cluster().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let options = || {
        let mut options = kubernetes_cluster(dir.path());
        options.gc_grace = Duration::from_secs(1);
        options.gc_interval = Duration::from_secs(1);
        options
    };
    let operator = ClusterApp::start(operator_client.clone(), options());
    let proxies: Api<Proxy> = Api::namespaced(admin.clone(), "crawl");
    create_pod_proxy(&proxies, "orphan").await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), POD_NAMESPACE);
    let selector = ListParams::default().labels("crawl.example.com/provider-instance=cluster");
    let name = wait_until(Duration::from_secs(60), "the Squid Pod", async || {
        let pod = pods.list(&selector).await.ok()?.items.into_iter().next()?;
        pod.metadata.name
    })
    .await;
    operator.stop().await;

    // The Proxy goes while no operator runs: its finalizer removed by hand.
    proxies
        .patch(
            "orphan",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("finalizer removed");
    proxies
        .delete("orphan", &DeleteParams::default())
        .await
        .expect("deleted");
    assert!(
        pods.get_opt(&name).await.expect("readable").is_some(),
        "the Pod outlived it"
    );

    let operator = ClusterApp::start(operator_client, options());
    wait_until(
        Duration::from_secs(90),
        "orphan GC to delete the Pod",
        async || pods.list(&selector).await.ok()?.items.is_empty().then_some(()),
    )
    .await;
    operator.stop().await;
}
