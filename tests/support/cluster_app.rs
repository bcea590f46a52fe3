//! The whole cluster mode (`run_cluster`: leader election, controller, health engine, leases,
//! discovery API, GC, monitor) in-process for end-to-end tests: the files it reads, options with
//! `run`'s defaults, and a guard that stops it.
//!
//! Include with `mod support { pub mod cluster_app; }` (or from `tests/support/mod.rs`).

#![allow(dead_code)]

use std::{net::SocketAddr, path::Path, time::Duration};

use egress_proxies_operator::{
    app::{AppError, DiscoveryAuthOptions, GatewayOptions},
    cluster::{ClusterOptions, cluster_identity, run_cluster},
    provider::Installation,
};
use kube::Client;
use tokio::{sync::oneshot, task::JoinHandle};

/// A Proxy `crawl/<name>` of [`local_cluster`]'s `local` provider, listening on
/// 127.0.0.1:`port`, probed through `health_url` every `interval_seconds` (timeout 1 s);
/// `spec` adds or overrides spec fields (attributes, lease, auth, ...).
pub fn local_proxy(
    name: &str,
    port: u16,
    health_url: &str,
    interval_seconds: u32,
    spec: serde_json::Value,
) -> egress_proxies_operator::api::Proxy {
    let mut proxy = serde_json::json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": name, "namespace": "crawl"},
        "spec": {
            "provider": "local",
            "placement": {"address": "127.0.0.1"},
            "port": port,
            "health": {"url": health_url, "intervalSeconds": interval_seconds, "timeoutSeconds": 1},
        },
    });
    if let (Some(base), Some(extra)) = (proxy["spec"].as_object_mut(), spec.as_object()) {
        base.extend(extra.clone());
    }
    serde_json::from_value(proxy).expect("a valid Proxy")
}

/// The installation name [`local_cluster`]'s options give.
pub const INSTALLATION_NAME: &str = "egress-proxies-system";

/// The installation cluster mode with [`local_cluster`]'s options runs as against `client`'s
/// API server: what instances it should collect must be stamped with.
pub async fn installation(client: &Client) -> Installation {
    let cluster = cluster_identity(client)
        .await
        .expect("the API server has a kube-system namespace");
    Installation::new(cluster, INSTALLATION_NAME)
}

/// Writes into `dir` what cluster mode reads: `providers.yaml` with one `local` provider named
/// `local` keeping its Squids under `local_state`, `tokens` holding `token`, and the lease
/// signing `key`. Returns options with `run`'s defaults for them, the admin server on
/// `admin` and the discovery API on `discovery`.
pub fn local_cluster(
    dir: &Path,
    local_state: &Path,
    token: &str,
    admin: SocketAddr,
    discovery: SocketAddr,
) -> ClusterOptions {
    std::fs::write(
        dir.join("providers.yaml"),
        format!(
            "providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: {}\n",
            local_state.display()
        ),
    )
    .expect("providers config");
    std::fs::write(dir.join("tokens"), format!("{token}\n")).expect("tokens");
    std::fs::write(dir.join("key"), "0123456789abcdef0123456789abcdef").expect("signing key");
    ClusterOptions {
        providers_config: dir.join("providers.yaml"),
        namespace: None,
        gc_allow_namespaced: false,
        gc_dry_run: false,
        gc_grace: Duration::from_secs(300),
        gc_interval: Duration::from_secs(60),
        reconciler: egress_proxies_operator::controller::ReconcilerConfig::default(),
        provider_probe_interval: Duration::from_secs(30),
        system_namespace: "egress-proxies-system".into(),
        identity: "test-replica".into(),
        installation_name: INSTALLATION_NAME.into(),
        cluster_id: None,
        provider_health_objects: true,
        admin_listen: admin,
        discovery_listen: discovery,
        gateway: GatewayOptions::default(),
        auth: DiscoveryAuthOptions::tokens_file(dir.join("tokens")),
        signing_key: dir.join("key"),
        concurrency: 4,
    }
}

/// `run_cluster` on a task; [`ClusterApp::stop`] shuts it down and checks it exited cleanly.
/// Dropping it stops it without waiting.
pub struct ClusterApp {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), AppError>>,
}

impl ClusterApp {
    /// Starts cluster mode against `client`'s API server.
    pub fn start(client: Client, options: ClusterOptions) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run_cluster(client, options, async {
            let _ = stopped.await;
        }));
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Graceful shutdown, within 30 s, without an error.
    pub async fn stop(mut self) {
        self.stop
            .take()
            .expect("stopped once")
            .send(())
            .expect("the operator still running");
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("stops within 30 s")
            .expect("no panic")
            .expect("clean exit");
    }
}

impl Drop for ClusterApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
