//! The namespace-restricted install (`config/namespaced`) on a real kube-apiserver with RBAC on:
//! a cluster admin installs the CRDs and reads the cluster's identity, the install is applied
//! with `kubectl apply -k`, and the operator binary runs with the Deployment's own flags as the
//! ServiceAccount it binds, whose only permissions are one Role in its namespace. The whole
//! lifecycle works with that Role alone (create → Healthy, a lease, delete), a Proxy in another
//! namespace is not touched, nothing is refused, and the identity placeholder left unedited
//! stops the operator with a message that says what to put there.

#[allow(dead_code)] // One of its two calls.
#[path = "support/http.rs"]
mod http;
mod support;

use std::{path::Path, time::Duration};

use bytes::Bytes;
use egress_proxies_operator::api::Proxy;
use http::request;
use http_body_util::Full;
use hyper::{Request, StatusCode};
use k8s_openapi::api::{apps::v1::Deployment, core::v1::Namespace};
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use serde_json::json;
use support::{
    Origin,
    cluster_app::{local_cluster, local_proxy},
    control_plane::ControlPlane,
    free_port,
    run_process::RunProcess,
    wait_until,
};

const NAMESPACE: &str = "crawl";
const TOKEN: &str = "namespaced-token-0123456789abcdef";
const DEADLINE: Duration = Duration::from_secs(60);

/// The operator container's flags as the install's Deployment has them on the server, less
/// those naming files (the test's own take their place), with `$(POD_NAMESPACE)` expanded as
/// the kubelet would.
async fn deployment_flags(plane: &ControlPlane) -> Vec<String> {
    let deployment = Api::<Deployment>::namespaced(plane.client().await, NAMESPACE)
        .get("egress-proxies-operator")
        .await
        .expect("the install's Deployment");
    let container = deployment
        .spec
        .and_then(|s| s.template.spec)
        .map(|s| s.containers)
        .and_then(|c| c.into_iter().next())
        .expect("the operator container");
    container
        .args
        .unwrap_or_default()
        .into_iter()
        .filter(|arg| {
            arg != "run" && !arg.starts_with("--providers-config=") && !arg.starts_with("--discovery-tokens=")
        })
        .map(|arg| arg.replace("$(POD_NAMESPACE)", NAMESPACE))
        .collect()
}

async fn can_i(plane: &ControlPlane, args: &[&str]) -> String {
    let subject = format!("--as=system:serviceaccount:{NAMESPACE}:egress-proxies-operator");
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    all.push(&subject);
    let output = plane.kubectl_output(&all).await;
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn exited_within(
    child: &mut support::process::GroupChild,
    within: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = child.exited() {
            return Some(status);
        }
        if std::time::Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespaced_install_runs_the_whole_lifecycle_with_its_role_alone() {
    let origin = Origin::start().await;
    let plane = ControlPlane::start().await;
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    // The cluster admin's part: the CRDs, the namespaces, the cluster's identity.
    plane
        .kubectl(&["apply", "-k", config.join("crd").to_str().expect("UTF-8")])
        .await;
    plane.create_namespace(NAMESPACE).await;
    plane.create_namespace("elsewhere").await;
    let cluster_uid = Api::<Namespace>::all(plane.client().await)
        .get("kube-system")
        .await
        .expect("kube-system")
        .metadata
        .uid
        .expect("a UID");
    // The install itself.
    plane
        .kubectl(&["apply", "-k", config.join("namespaced").to_str().expect("UTF-8")])
        .await;
    let flags = deployment_flags(&plane).await;
    for wanted in ["--namespace=crawl", "--no-provider-health-objects"] {
        assert!(flags.iter().any(|f| f == wanted), "{wanted} in {flags:?}");
    }
    // Its ServiceAccount has no right outside its namespace.
    assert_eq!(can_i(&plane, &["get", "namespaces/kube-system"]).await, "no");
    assert_eq!(
        can_i(&plane, &["list", "proxies.crawl.example.com", "-n", "elsewhere"]).await,
        "no"
    );
    assert_eq!(
        can_i(&plane, &["list", "providerhealths.crawl.example.com"]).await,
        "no"
    );
    assert_eq!(
        can_i(&plane, &["patch", "proxies.crawl.example.com", "-n", NAMESPACE]).await,
        "yes"
    );

    let kubeconfig = plane
        .service_account_kubeconfig(NAMESPACE, "egress-proxies-operator")
        .await;
    let dir = support::standalone::Host::new();
    local_cluster(
        dir.path(),
        &dir.path().join("local"),
        TOKEN,
        "127.0.0.1:0".parse().expect("an address"),
        "127.0.0.1:0".parse().expect("an address"),
    );

    // The placeholder left as shipped: the operator stops at once and says what to put there.
    let shipped: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut unedited = RunProcess::spawn_in(NAMESPACE, dir.path(), &kubeconfig, "unedited", &shipped);
    let status = exited_within(&mut unedited.child, Duration::from_secs(30)).expect("the operator stops");
    assert!(!status.success());
    let log = unedited.child.log();
    assert!(
        log.contains("--cluster-id") && log.contains("kubectl get namespace kube-system"),
        "{log}"
    );

    // The UID filled in, as the install's comment asks.
    let edited: Vec<String> = flags
        .iter()
        .map(|flag| match flag.strip_prefix("--cluster-id=") {
            Some(_) => format!("--cluster-id={cluster_uid}"),
            None => flag.clone(),
        })
        .collect();
    let edited: Vec<&str> = edited.iter().map(String::as_str).collect();
    let mut operator = RunProcess::spawn_in(NAMESPACE, dir.path(), &kubeconfig, "namespaced", &edited);

    let proxies: Api<Proxy> = Api::namespaced(plane.client().await, NAMESPACE);
    let port = free_port();
    proxies
        .create(
            &PostParams::default(),
            &local_proxy(
                "squid-1",
                port,
                &origin.http_url("/health"),
                2,
                json!({"attributes": {"team": "a"}}),
            ),
        )
        .await
        .expect("created");
    let mut elsewhere_proxy = local_proxy("not-mine", free_port(), &origin.http_url("/health"), 2, json!({}));
    elsewhere_proxy.metadata.namespace = Some("elsewhere".into());
    let elsewhere: Api<Proxy> = Api::namespaced(plane.client().await, "elsewhere");
    elsewhere
        .create(&PostParams::default(), &elsewhere_proxy)
        .await
        .expect("created");

    let healthy = wait_until(DEADLINE, "the Proxy healthy", async || {
        let proxy = proxies.get("squid-1").await.ok()?;
        (proxy.status.as_ref()?.phase.as_deref() == Some("healthy")).then_some(proxy)
    })
    .await;
    assert_eq!(
        healthy.metadata.finalizers.unwrap_or_default(),
        ["crawl.example.com/proxy-cleanup"]
    );

    // A lease over the discovery API.
    let (code, body) = request(
        operator.discovery,
        Request::post("/v1/leases")
            .header("host", "localhost")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                json!({"selector": {"team": "a"}, "holder": "crawler-1", "ttlSeconds": 60}).to_string(),
            )))
            .expect("a request"),
    )
    .await;
    assert_eq!(code, StatusCode::CREATED, "{body}");
    let lease: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert!(
        body.contains(&port.to_string()),
        "the lease names the Squid's port: {body}"
    );

    // Delete while the lease is held: the Proxy drains until it is released, then, through the
    // finalizer, the Squid goes.
    proxies
        .delete("squid-1", &DeleteParams::default())
        .await
        .expect("deleted");
    wait_until(DEADLINE, "the Proxy deleting", async || {
        let proxy = proxies.get("squid-1").await.ok()?;
        (proxy.status.as_ref()?.phase.as_deref() == Some("deleting")).then_some(())
    })
    .await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "the Squid serves the held lease until it is released"
    );
    let (code, body) = request(
        operator.discovery,
        Request::post(format!(
            "/v1/leases/{}/release",
            lease["leaseId"].as_str().expect("a lease id")
        ))
        .header("host", "localhost")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            json!({"fencingToken": lease["fencingToken"], "outcome": "ok"}).to_string(),
        )))
        .expect("a request"),
    )
    .await;
    assert!(code.is_success(), "{body}");
    wait_until(DEADLINE, "the Proxy gone", async || {
        proxies.get_opt("squid-1").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the Squid outlived its Proxy"
    );

    // The other namespace's Proxy was never touched, and nothing was refused.
    let untouched = elsewhere.get("not-mine").await.expect("exists");
    assert!(untouched.status.is_none(), "{:?}", untouched.status);
    assert!(untouched.metadata.finalizers.is_none());
    let log = operator.child.log();
    assert!(!log.to_lowercase().contains("forbidden"), "{log}");
    assert!(log.contains("orphan GC is disabled"), "{log}");
    assert!(operator.child.exited().is_none(), "{log}");
    operator.child.terminate_async(Duration::from_secs(30)).await;

    // A lifecycle that went as it should warns of nothing but the disabled GC: the reconcile a
    // deleted Proxy's last update queued, finding it gone, was a "controller error" warning.
    let log = operator.child.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(" WARN ") && !line.contains("orphan GC is disabled"))
        .collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
    // And the log tells the lifecycle, each recorded transition with its detail, as standalone
    // mode's does (Events expire; logs are where operators keep them).
    let transitions: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(" INFO ") && line.contains(" transition ") && line.contains("/squid-1"))
        .collect();
    for expected in [
        "pending --spec_observed--> provisioning",
        "provisioning --health_passed--> healthy",
        "healthy --deletion_requested [leases_active]--> deleting",
        "--> deleted",
    ] {
        assert!(
            transitions.iter().any(|line| line.contains(expected)),
            "{expected}: {transitions:#?}"
        );
    }
    assert!(
        transitions.iter().any(|line| line.contains("detail=")),
        "{transitions:#?}"
    );
}
