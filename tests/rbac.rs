//! The shipped RBAC (`config/rbac`) is exactly what the operator needs, on a real
//! kube-apiserver with RBAC on: installed by `kubectl apply -k config/default`, the operator
//! binary runs as the ServiceAccount it binds, with a `local` and a `kubernetes` provider (kwok
//! runs the Pods). Then each rule of the ClusterRole and of the Roles is taken away in turn: the
//! operator must say so, naming the verb and resource it was refused (`Forbidden` in its log),
//! and keep running (no crash loop); with the rule back, everything converges.

mod support;

use std::{
    path::Path,
    time::{Duration, Instant},
};

use egress_proxies_operator::api::Proxy;
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, Role};
use kube::{
    Api, Client,
    api::{DeleteParams, PostParams},
};
use serde_json::json;
use support::{
    Origin,
    cluster_app::local_proxy,
    control_plane::{ControlPlane, OPERATOR_NAMESPACE, Options},
    free_port,
    process::GroupChild,
    run_process::RunProcess,
};

fn operator(dir: &Path, kubeconfig: &Path, round: &str) -> GroupChild {
    RunProcess::spawn(
        dir,
        kubeconfig,
        &format!("rbac-{round}"),
        &["--provider-probe-interval=1"],
    )
    .child
}

/// A rule as RBAC prints it, e.g. `create,patch events.k8s.io/events`.
fn describe(rule: &PolicyRule) -> String {
    format!(
        "{} {}/{}",
        rule.verbs.join(","),
        rule.api_groups.as_deref().unwrap_or_default().join(","),
        rule.resources.as_deref().unwrap_or_default().join(",")
    )
}

/// Where a rule lives: the ClusterRole, or a Role in a namespace.
#[derive(Clone)]
enum Holder {
    Cluster(String),
    Namespaced(String, String),
}

async fn rules(client: &Client, holder: &Holder) -> Vec<PolicyRule> {
    match holder {
        Holder::Cluster(name) => Api::<ClusterRole>::all(client.clone())
            .get(name)
            .await
            .expect("ClusterRole")
            .rules
            .unwrap_or_default(),
        Holder::Namespaced(ns, name) => Api::<Role>::namespaced(client.clone(), ns)
            .get(name)
            .await
            .expect("Role")
            .rules
            .unwrap_or_default(),
    }
}

async fn set_rules(client: &Client, holder: &Holder, rules: Vec<PolicyRule>) {
    match holder {
        Holder::Cluster(name) => {
            let api = Api::<ClusterRole>::all(client.clone());
            let mut role = api.get(name).await.expect("ClusterRole");
            role.rules = Some(rules);
            api.replace(name, &PostParams::default(), &role)
                .await
                .expect("ClusterRole replaced");
        }
        Holder::Namespaced(ns, name) => {
            let api = Api::<Role>::namespaced(client.clone(), ns);
            let mut role = api.get(name).await.expect("Role");
            role.rules = Some(rules);
            api.replace(name, &PostParams::default(), &role)
                .await
                .expect("Role replaced");
        }
    }
}

/// A Proxy of the `kubernetes` provider (a Squid Pod that kwok "runs").
fn pod_proxy(name: &str) -> Proxy {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": name, "namespace": "crawl"},
        "spec": {
            "provider": "cluster",
            "health": {"url": "http://127.0.0.1:9/", "intervalSeconds": 2, "timeoutSeconds": 1},
            // Credentials: the provider keeps their hash in a Secret of its namespace.
            "auth": {"secretRef": {"name": "proxy-credentials"}},
        },
    }))
    .expect("a valid Proxy")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_of_the_shipped_rbac_is_needed_and_a_missing_one_is_named() {
    let origin = Origin::start().await;
    // A cluster as users have one: the controller manager makes each namespace's `default`
    // ServiceAccount, without which admission refuses the provider's Pods.
    let plane = ControlPlane::start_with(Options {
        nodes: true,
        controller_manager: true,
        ..Options::default()
    })
    .await;
    plane.install_default().await;
    plane.create_namespace("crawl").await;
    let kubeconfig = plane.operator_kubeconfig().await;
    // Kills every Squid started under it on drop, also when the test fails half-way.
    let dir = support::standalone::Host::new();
    support::cluster_app::local_cluster(
        dir.path(),
        &dir.path().join("local"),
        "rbac-token-0123456789abcdef",
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    );
    // Both providers: the kubernetes provider's Role is exercised too.
    std::fs::write(
        dir.path().join("providers.yaml"),
        format!(
            "providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: {}\n  \
             - name: cluster\n    type: kubernetes\n    settings:\n      namespace: egress-proxies\n      \
             image: registry.example.com/squid:5.7\n      serviceType: ClusterIP\n",
            dir.path().join("local").display()
        ),
    )
    .expect("providers config");
    let admin = plane.client().await;
    let proxies: Api<Proxy> = Api::namespaced(admin.clone(), "crawl");
    let credentials = serde_json::from_value(json!({
        "metadata": {"name": "proxy-credentials", "namespace": "crawl"},
        "stringData": {"username": "crawler", "password": "rbac-test-password"},
    }))
    .expect("a Secret");
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(admin.clone(), "crawl")
        .create(&PostParams::default(), &credentials)
        .await
        .expect("credentials");

    // With the whole RBAC, a round converges and says nothing of Forbidden.
    let mut ports = Vec::new();
    let converge = async |round: &str, ports: &mut Vec<u16>| {
        let port = free_port();
        ports.push(port);
        proxies
            .create(
                &PostParams::default(),
                &local_proxy(
                    &format!("local-{round}"),
                    port,
                    &origin.http_url("/health"),
                    2,
                    json!({}),
                ),
            )
            .await
            .expect("created");
        proxies
            .create(&PostParams::default(), &pod_proxy(&format!("pod-{round}")))
            .await
            .expect("created");
    };
    converge("full", &mut ports).await;
    let mut full = operator(dir.path(), &kubeconfig, "full");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let local = proxies.get("local-full").await.expect("local-full");
        let pod = proxies.get("pod-full").await.expect("pod-full");
        let phase = |p: &Proxy| p.status.as_ref().and_then(|s| s.phase.clone());
        // The Pod's health check cannot pass here (kwok runs no container): provisioning is
        // as far as it goes, with its instance created.
        if phase(&local).as_deref() == Some("healthy")
            && pod.status.as_ref().is_some_and(|s| s.provider_id.is_some())
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the full RBAC did not converge: {:?} {:?}\n{}",
            local.status,
            pod.status,
            full.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = full.log();
    assert!(!log.to_lowercase().contains("forbidden"), "{log}");
    full.terminate_async(Duration::from_secs(30)).await;

    let holders = [
        Holder::Cluster("egress-proxies-operator".into()),
        Holder::Namespaced(
            OPERATOR_NAMESPACE.into(),
            "egress-proxies-operator-leader-election".into(),
        ),
        Holder::Namespaced(
            "egress-proxies".into(),
            "egress-proxies-operator-kubernetes-provider".into(),
        ),
    ];
    let mut silent = Vec::new();
    let mut round = 0;
    for holder in &holders {
        let shipped = rules(&admin, holder).await;
        for (index, rule) in shipped.iter().enumerate() {
            round += 1;
            let mut fewer = shipped.clone();
            fewer.remove(index);
            set_rules(&admin, holder, fewer).await;
            let name = format!("r{round}");
            converge(&name, &mut ports).await;
            let mut child = operator(dir.path(), &kubeconfig, &name);
            // RBAC's answer names the verb and the resource: "cannot <verb> resource "<res>"".
            let resources = rule.resources.clone().unwrap_or_default();
            let deadline = Instant::now() + Duration::from_secs(45);
            let pod_proxy_name = format!("pod-{name}");
            let seen = loop {
                let log = child.log();
                let named = log.lines().find(|line| {
                    line.contains("forbidden")
                        && resources.iter().any(|r| {
                            let base = r.split('/').next().unwrap_or(r);
                            line.contains(&format!("resource \\\"{base}"))
                                || line.contains(&format!("resource \"{base}"))
                        })
                });
                if let Some(line) = named {
                    break Some(line.to_owned());
                }
                // The kubernetes provider says it in the Proxy's Ready condition.
                let condition = proxies
                    .get(&pod_proxy_name)
                    .await
                    .ok()
                    .and_then(|p| p.status)
                    .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"))
                    .map(|c| c.message)
                    .filter(|m| {
                        m.contains("forbidden")
                            && resources
                                .iter()
                                .any(|r| m.contains(&format!("{} in namespace", r)))
                    });
                if let Some(message) = condition {
                    break Some(format!("{pod_proxy_name} Ready: {message}"));
                }
                if Instant::now() > deadline {
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            match &seen {
                Some(line) => println!("without `{}`: {}", describe(rule), &line[..line.len().min(300)]),
                None => silent.push(format!("without `{}`:\n{}", describe(rule), child.log())),
            }
            assert!(
                child.exited().is_none(),
                "without `{}` the operator exited (a crash loop in a cluster):\n{}",
                describe(rule),
                child.log()
            );
            child.terminate_async(Duration::from_secs(30)).await;
            set_rules(&admin, holder, shipped.clone()).await;
        }
    }
    assert!(
        silent.is_empty(),
        "rules whose absence the operator did not name:\n{}",
        silent.join("\n\n")
    );

    // Everything back: the operator deletes every Proxy (and its Squids and Pods).
    let mut last = operator(dir.path(), &kubeconfig, "cleanup");
    proxies
        .delete_collection(&DeleteParams::default(), &Default::default())
        .await
        .expect("deleted");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = proxies.list(&Default::default()).await.expect("list").items;
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Proxies left: {:?}\n{}",
            left.iter().map(|p| p.metadata.name.clone()).collect::<Vec<_>>(),
            last.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for port in ports {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "a Squid on {port} outlived its Proxy"
        );
    }
    last.terminate_async(Duration::from_secs(30)).await;
}
