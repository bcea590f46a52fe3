//! The `kubernetes` provider against a real kube-apiserver and etcd, with kube-scheduler and
//! kwok (one fake node: Pods are scheduled, become Running with an IP, and a deleted Pod goes
//! away once the "node" confirms): the provider contract suite, the objects it makes (labels,
//! owner annotations, the Squid config), the endpoint per Service type (the server allocates
//! cluster IPs and node ports), error categories, and isolation between provider instances,
//! and between installations, sharing a namespace. Failures are real ones: a ServiceAccount
//! without a Role (403), the API server stopped, a Pod create refused by an admission policy.

#[allow(dead_code)]
#[macro_use]
mod support {
    #[macro_use]
    pub mod contract;
    pub mod control_plane;
    pub mod ports;
    pub mod process;
}

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use egress_proxies_operator::{
    config::{KubernetesSettings, ServiceType},
    provider::{
        Credentials, CredentialsCheck, Endpoint, Installation, InstanceRequest, InstanceState, Owner,
        Provider, ProviderError, kubernetes::KubernetesProvider,
    },
};
use serde_json::{Value, json};

use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams},
};
use support::{
    contract::{self, ContractBackend},
    control_plane::{ControlPlane, Options, client_from},
};

const NAMESPACE: &str = "proxies";

fn settings(service_type: ServiceType) -> KubernetesSettings {
    KubernetesSettings {
        namespace: NAMESPACE.to_owned(),
        image: "registry.example.com/squid:5.7".to_owned(),
        service_type,
        node_address: None,
        timeout_seconds: 10,
    }
}

/// An API server and the settings providers on it are opened with.
pub struct KubernetesBackend {
    /// kube-apiserver, etcd, kube-scheduler and kwok (dropping it stops them).
    plane: Box<ControlPlane>,
    client: Client,
    settings: KubernetesSettings,
}

fn resource(plural: &str) -> ApiResource {
    let kind = match plural {
        "pods" => "Pod",
        "services" => "Service",
        "configmaps" => "ConfigMap",
        "secrets" => "Secret",
        other => panic!("no test reads {other}"),
    };
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", kind), plural)
}

impl KubernetesBackend {
    async fn start() -> Self {
        Self::with_settings(settings(ServiceType::ClusterIP)).await
    }

    async fn with_settings(settings: KubernetesSettings) -> Self {
        let plane = ControlPlane::start_with(Options {
            nodes: true,
            ..Options::default()
        })
        .await;
        plane.create_namespace(NAMESPACE).await;
        let client = plane.client().await;
        Self {
            plane: Box::new(plane),
            client,
            settings,
        }
    }

    fn provider(&self, instance: &str) -> KubernetesProvider {
        KubernetesProvider::new(instance, self.settings.clone(), self.client.clone())
    }

    fn api(&self, plural: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), NAMESPACE, &resource(plural))
    }

    /// The object as stored, as JSON.
    async fn object(&self, plural: &str, name: &str) -> Option<Value> {
        let object = self.api(plural).get_opt(name).await.expect("readable")?;
        Some(serde_json::to_value(object).expect("JSON"))
    }

    /// Every object of `plural` in the namespace, as JSON.
    async fn list(&self, plural: &str) -> Vec<Value> {
        self.api(plural)
            .list(&ListParams::default())
            .await
            .expect("listable")
            .items
            .into_iter()
            .map(|o| serde_json::to_value(o).expect("JSON"))
            .collect()
    }

    /// Changes `plural/name` as an admin would: reads it, applies `change`, writes back its
    /// metadata and spec, then its status; on a conflict (kwok, the "kubelet", wrote the
    /// object in between) reads it again and starts over.
    async fn edit(&self, plural: &str, name: &str, change: impl Fn(&mut Value)) {
        let api = self.api(plural);
        for _ in 0..10 {
            let mut object = self.object(plural, name).await.expect("the object to edit");
            change(&mut object);
            let dynamic: DynamicObject = serde_json::from_value(object.clone()).expect("an object");
            let replaced = match api.replace(name, &PostParams::default(), &dynamic).await {
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                replaced => replaced.expect("replaced"),
            };
            if object.get("status").is_none() {
                return;
            }
            object["metadata"]["resourceVersion"] = replaced.metadata.resource_version.clone().into();
            let with_status: DynamicObject = serde_json::from_value(object).expect("an object");
            match api
                .replace_status(name, &PostParams::default(), &with_status)
                .await
            {
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                done => {
                    done.expect("status replaced");
                    return;
                }
            }
        }
        panic!("{plural}/{name}: conflicts on 10 edits in a row");
    }

    /// Waits until `plural/name` is gone (a Pod's graceful delete ends when kwok, its
    /// "kubelet", confirms), for up to 30 s.
    async fn wait_gone(&self, plural: &str, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Some(object) = self.object(plural, name).await {
            assert!(
                Instant::now() < deadline,
                "{plural}/{name} left behind: {object:#}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the namespace holds no Pod, for up to 30 s.
    async fn wait_no_pods(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let pods = self.list("pods").await;
            if pods.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "pods left behind: {pods:#?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the Pod `name` is Running (kwok), for up to 60 s.
    async fn wait_running(&self, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let pod = self.object("pods", name).await.expect("pod");
            if pod["status"]["phase"] == "Running" {
                return;
            }
            assert!(Instant::now() < deadline, "pod {name} not Running: {pod:#}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[async_trait]
impl ContractBackend for KubernetesBackend {
    fn delete_settles(&self) -> Duration {
        Duration::from_secs(30)
    }

    async fn open(&self) -> Arc<dyn Provider> {
        Arc::new(self.provider("cluster"))
    }

    fn request(&self, owner: &Owner) -> InstanceRequest {
        InstanceRequest {
            spec_hash: format!("spec-{}", owner.uid),
            ..contract::plain_request(owner.clone(), 3128)
        }
    }

    /// Pods of that name: the instance is its Pod.
    async fn backend_objects(&self, name: &str) -> usize {
        self.list("pods")
            .await
            .iter()
            .filter(|pod| pod["metadata"]["name"] == name)
            .count()
    }
}

mod contract_suite {
    use super::KubernetesBackend;

    contract_tests!(KubernetesBackend::start().await);
}

fn request(check: &str, port: u16) -> InstanceRequest {
    let owner = contract::new_owner(check);
    InstanceRequest {
        spec_hash: format!("spec-{}", owner.uid),
        ..contract::plain_request(owner, port)
    }
}

#[tokio::test]
async fn every_object_carries_the_labels_and_owner_annotations() {
    let backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let request = request("labels", 3130);
    let before = jiff::Timestamp::now();
    let instance = provider.create(&request).await.expect("create");
    assert_eq!(
        instance.id.to_string(),
        format!("kubernetes/cluster/{}", request.name)
    );
    assert_eq!(
        instance.state,
        InstanceState::Starting,
        "the fake's Pods stay Pending"
    );

    for resource in ["pods", "configmaps", "services"] {
        let object = backend
            .object(resource, &request.name)
            .await
            .unwrap_or_else(|| panic!("no {resource} named {}", request.name));
        let labels = &object["metadata"]["labels"];
        assert_eq!(
            labels["app.kubernetes.io/managed-by"], "egress-proxies-operator",
            "{resource}"
        );
        assert_eq!(
            labels["crawl.example.com/provider-instance"], "cluster",
            "{resource}"
        );
        let annotations = &object["metadata"]["annotations"];
        assert_eq!(
            annotations["crawl.example.com/owner-uid"],
            request.owner.uid.as_str()
        );
        assert_eq!(annotations["crawl.example.com/owner-namespace"], "contract");
        assert_eq!(annotations["crawl.example.com/owner-name"], "labels");
        assert_eq!(
            annotations["crawl.example.com/spec-hash"],
            request.spec_hash.as_str()
        );
        let created: jiff::Timestamp = annotations["crawl.example.com/created-at"]
            .as_str()
            .expect("created-at is a string")
            .parse()
            .expect("created-at is RFC 3339");
        assert!(
            created >= before - jiff::SignedDuration::from_secs(1),
            "{resource}: {created}"
        );
    }
    assert!(
        backend.object("secrets", &request.name).await.is_none(),
        "no credentials, no Secret"
    );

    // The Pod runs the configured image with the config mounted where Squid reads it, and
    // the Service selects it on the proxy's port.
    let pod = backend.object("pods", &request.name).await.expect("pod");
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["image"], "registry.example.com/squid:5.7");
    assert_eq!(container["volumeMounts"][0]["mountPath"], "/etc/squid/squid.conf");
    assert_eq!(
        pod["spec"]["volumes"][0]["configMap"]["name"],
        request.name.as_str()
    );
    let service = backend.object("services", &request.name).await.expect("service");
    assert_eq!(service["spec"]["type"], "ClusterIP");
    assert_eq!(service["spec"]["ports"][0]["port"], 3130);
    for (key, value) in service["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(
            &pod["metadata"]["labels"][key], value,
            "the Service selects the Pod"
        );
    }
    provider.delete(&request.name).await.expect("delete");
    for resource in ["pods", "configmaps", "services"] {
        backend.wait_gone(resource, &request.name).await;
    }
}

#[tokio::test]
async fn the_config_map_holds_a_squid_conf_for_the_proxy_port() {
    let backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let request = request("config", 8123);
    provider.create(&request).await.expect("create");
    let config_map = backend
        .object("configmaps", &request.name)
        .await
        .expect("configmap");
    let conf = config_map["data"]["squid.conf"].as_str().expect("squid.conf");
    assert!(conf.lines().any(|l| l == "http_port 8123"), "{conf}");
    assert!(conf.lines().any(|l| l == "http_access allow all"), "{conf}");
    assert!(!conf.contains("auth_param"), "{conf}");
    // What a restarted operator asks before it trusts the Proxy's credentials: none wanted.
    let wanted = Credentials {
        username: "crawler".to_owned(),
        password: "added-later".to_owned(),
    };
    let check = |credentials| provider.check_credentials(&request.name, credentials);
    assert_eq!(check(None).await.expect("checked"), CredentialsCheck::Accepts);
    assert_eq!(
        check(Some(&wanted)).await.expect("checked"),
        CredentialsCheck::Differs
    );
    provider.delete(&request.name).await.expect("delete");
}

#[tokio::test]
async fn credentials_go_to_a_secret_as_a_hash_never_to_the_config_map() {
    let backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let password = "s3cret-password-value";
    let request = InstanceRequest {
        credentials: Some(Credentials {
            username: "crawler".to_owned(),
            password: password.to_owned(),
        }),
        ..request("auth", 3128)
    };
    provider.create(&request).await.expect("create");
    let config_map = backend
        .object("configmaps", &request.name)
        .await
        .expect("configmap");
    let conf = config_map["data"]["squid.conf"].as_str().expect("squid.conf");
    assert!(conf.contains("auth_param basic program"), "{conf}");
    assert!(!config_map.to_string().contains(password));

    let secret = backend
        .object("secrets", &request.name)
        .await
        .expect("a Secret for the passwords");
    let encoded = secret["data"]["passwd"].as_str().expect("passwd key");
    let passwd = String::from_utf8(base64_decode(encoded)).expect("utf-8");
    assert!(
        passwd.starts_with("crawler:$6$"),
        "a SHA-512-crypt hash: {passwd}"
    );
    assert!(!passwd.contains(password), "the password itself is not stored");
    let pod = backend.object("pods", &request.name).await.expect("pod");
    let mounts = pod["spec"]["containers"][0]["volumeMounts"].to_string();
    assert!(mounts.contains("/etc/squid/passwd"), "{mounts}");

    // What a restarted operator asks before it trusts the Proxy's credentials.
    let check = |credentials| provider.check_credentials(&request.name, credentials);
    assert_eq!(
        check(request.credentials.as_ref()).await.expect("checked"),
        CredentialsCheck::Accepts
    );
    let rotated = Credentials {
        username: "crawler".to_owned(),
        password: "rotated-while-down".to_owned(),
    };
    assert_eq!(
        check(Some(&rotated)).await.expect("checked"),
        CredentialsCheck::Differs
    );
    assert_eq!(check(None).await.expect("checked"), CredentialsCheck::Differs);

    provider.delete(&request.name).await.expect("delete");
    assert!(
        backend.object("secrets", &request.name).await.is_none(),
        "the Secret is deleted too"
    );
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            other => panic!("not base64: {other}"),
        }
    };
    let mut out = Vec::new();
    for chunk in text.trim_end_matches('=').as_bytes().chunks(4) {
        let mut bits = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            bits |= value(*c) << (18 - 6 * i);
        }
        out.extend_from_slice(&bits.to_be_bytes()[1..chunk.len()]);
    }
    out
}

#[tokio::test]
async fn state_follows_the_pod_phase() {
    let backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let request = request("phase", 3128);
    provider.create(&request).await.expect("create");
    // kwok runs it, as a kubelet would.
    backend.wait_running(&request.name).await;
    assert_eq!(
        provider.get(&request.name).await.expect("get").state,
        InstanceState::Running
    );
    // Then its "kubelet" reports other phases.
    for (phase, state) in [
        ("Running", InstanceState::Running),
        ("Failed", InstanceState::Stopped),
        ("Succeeded", InstanceState::Stopped),
        ("Pending", InstanceState::Starting),
    ] {
        (backend.edit("pods", &request.name, |pod| pod["status"]["phase"] = json!(phase))).await;
        let instance = provider.get(&request.name).await.expect("get");
        assert_eq!(instance.state, state, "phase {phase}");
    }
    provider.delete(&request.name).await.expect("delete");
}

#[tokio::test]
async fn cluster_ip_endpoint_is_the_allocated_cluster_ip_and_port() {
    let backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let request = request("cluster-ip", 3129);
    let instance = provider.create(&request).await.expect("create");
    let service = backend.object("services", &request.name).await.expect("service");
    let cluster_ip = service["spec"]["clusterIP"]
        .as_str()
        .expect("allocated")
        .to_owned();
    let expected = Endpoint {
        host: cluster_ip,
        port: 3129,
    };
    assert_eq!(instance.endpoint.as_ref(), Some(&expected));
    let listed = provider.list().await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].endpoint.as_ref(), Some(&expected));
    provider.delete(&request.name).await.expect("delete");
}

#[tokio::test]
async fn load_balancer_endpoint_appears_with_the_ingress() {
    let backend = KubernetesBackend::with_settings(settings(ServiceType::LoadBalancer)).await;
    let provider = backend.provider("cluster");
    let request = request("load-balancer", 3128);
    let instance = provider.create(&request).await.expect("create");
    assert_eq!(instance.endpoint, None, "no ingress yet");
    let service = backend.object("services", &request.name).await.expect("service");
    assert_eq!(service["spec"]["type"], "LoadBalancer");
    let ingress = json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}});
    (backend.edit("services", &request.name, |service| {
        service["status"] = ingress.clone()
    }))
    .await;
    let instance = provider.get(&request.name).await.expect("get");
    assert_eq!(
        instance.endpoint,
        Some(Endpoint {
            host: "203.0.113.7".to_owned(),
            port: 3128
        })
    );
    provider.delete(&request.name).await.expect("delete");
}

#[tokio::test]
async fn node_port_endpoint_is_the_node_address_and_node_port() {
    let without_address = KubernetesBackend::with_settings(settings(ServiceType::NodePort)).await;
    match without_address
        .provider("cluster")
        .create(&request("no-node-address", 3128))
        .await
    {
        Err(ProviderError::Misconfigured(message)) => assert!(message.contains("nodeAddress"), "{message}"),
        other => panic!("expected Misconfigured, got {other:?}"),
    }

    let backend = KubernetesBackend::with_settings(KubernetesSettings {
        node_address: Some("nodes.example.com".to_owned()),
        ..settings(ServiceType::NodePort)
    })
    .await;
    let provider = backend.provider("cluster");
    let request = request("node-port", 3128);
    let instance = provider.create(&request).await.expect("create");
    // The API server allocates the node port with the Service.
    let service = backend.object("services", &request.name).await.expect("service");
    assert_eq!(service["spec"]["type"], "NodePort");
    let node_port = service["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .expect("a node port allocated") as u16;
    assert!((30000..=32767).contains(&node_port), "{node_port}");
    let expected = Some(Endpoint {
        host: "nodes.example.com".to_owned(),
        port: node_port,
    });
    assert_eq!(instance.endpoint, expected, "known from the create on");
    let instance = provider.get(&request.name).await.expect("get");
    assert_eq!(instance.endpoint, expected);
    provider.delete(&request.name).await.expect("delete");
}

#[tokio::test]
async fn an_unreachable_api_server_is_unavailable_quickly() {
    // A port that was bound a moment ago and is closed now: connections are refused.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().expect("uri"));
    let client = kube::Client::try_from(config).expect("client");
    let provider = KubernetesProvider::new("cluster", settings(ServiceType::ClusterIP), client);
    let started = Instant::now();
    for outcome in [
        provider.get("epo-x").await.map(drop),
        provider.list().await.map(drop),
        provider.probe().await.map(drop),
        provider.delete("epo-x").await,
        provider.create(&request("unreachable", 3128)).await.map(drop),
    ] {
        match outcome {
            Err(ProviderError::Unavailable(_)) => {}
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn api_errors_map_to_categories_and_a_lost_get_is_not_not_found() {
    let mut backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let request = request("errors", 3128);
    provider.create(&request).await.expect("create");

    // RBAC: a 403 is configuration, and says what permission is missing (a ServiceAccount
    // with no Role at all).
    let kubeconfig = backend
        .plane
        .service_account_kubeconfig(NAMESPACE, "no-rights")
        .await;
    let unprivileged = KubernetesProvider::new(
        "cluster",
        backend.settings.clone(),
        client_from(&kubeconfig).await,
    );
    match unprivileged.get(&request.name).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(message.contains("pods") && message.contains("get"), "{message}");
            assert!(message.contains(NAMESPACE), "{message}");
        }
        other => panic!("expected Misconfigured on a 403, got {other:?}"),
    }

    // The API server away: doubt, never NotFound.
    backend.plane.stop_apiserver().await;
    match provider.get(&request.name).await {
        Err(ProviderError::Unavailable(_)) => {}
        other => panic!("expected Unavailable with the API server away, got {other:?}"),
    }
    backend.plane.start_apiserver_again().await;
    provider.delete(&request.name).await.expect("delete");
}

#[tokio::test]
async fn another_provider_instances_objects_are_invisible_and_untouched() {
    let backend = KubernetesBackend::start().await;
    let ours = backend.provider("cluster");
    let theirs = backend.provider("other-cluster");
    let their_request = request("theirs", 3128);
    theirs.create(&their_request).await.expect("their create");
    let our_request = request("ours", 3128);
    ours.create(&our_request).await.expect("our create");

    let listed = ours.list().await.expect("list");
    let names: Vec<_> = listed.iter().map(|i| i.id.native_id.as_str()).collect();
    assert_eq!(names, [our_request.name.as_str()]);
    assert_eq!(ours.probe().await.expect("probe").instance_count, 1);
    match ours.get(&their_request.name).await {
        Err(ProviderError::NotFound(_)) => {}
        other => panic!("another instance's pod must be NotFound to us, got {other:?}"),
    }
    ours.delete(&their_request.name)
        .await
        .expect("delete of a name not ours succeeds");
    for resource in ["pods", "configmaps", "services"] {
        assert!(
            backend.object(resource, &their_request.name).await.is_some(),
            "their {resource} was deleted"
        );
    }
    assert!(theirs.get(&their_request.name).await.is_ok());

    ours.delete(&our_request.name).await.expect("delete ours");
    theirs.delete(&their_request.name).await.expect("delete theirs");
    backend.wait_no_pods().await;
}

#[tokio::test]
async fn another_installations_pods_are_listed_as_theirs_but_never_returned_taken_or_deleted() {
    let backend = KubernetesBackend::start().await;
    let prod_id = Installation::new("cluster-uid", "prod");
    let staging_id = Installation::new("cluster-uid", "staging");
    // Two operators in one cluster with the same providers config (the same instance name).
    let prod = backend.provider("cluster").with_installation(prod_id.clone());
    let staging = backend.provider("cluster").with_installation(staging_id.clone());
    let prod_request = request("prod", 3128);
    let made = prod.create(&prod_request).await.expect("create");
    assert_eq!(made.installation.as_ref(), Some(&prod_id));
    for resource in ["pods", "configmaps", "services"] {
        let annotations = &backend
            .object(resource, &prod_request.name)
            .await
            .expect("object")["metadata"]["annotations"];
        assert_eq!(
            annotations["crawl.example.com/installation-cluster"], "cluster-uid",
            "{resource}"
        );
        assert_eq!(
            annotations["crawl.example.com/installation-name"], "prod",
            "{resource}"
        );
    }

    let listed = staging.list().await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].installation.as_ref(),
        Some(&prod_id),
        "listed with its installation"
    );
    assert!(matches!(
        staging.get(&prod_request.name).await,
        Err(ProviderError::NotFound(_))
    ));
    match staging.create(&prod_request).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(
                message.contains("belongs to installation prod@cluster-uid"),
                "{message}"
            )
        }
        other => panic!("staging must not take prod's Pod: {other:?}"),
    }
    assert!(staging.adopt(&prod_request.name).await.is_err());
    staging
        .delete(&prod_request.name)
        .await
        .expect("nothing of staging's");
    for resource in ["pods", "configmaps", "services"] {
        assert!(
            backend.object(resource, &prod_request.name).await.is_some(),
            "{resource} kept"
        );
    }

    // A Pod from before installations were recorded: treated as ours by both, adopted once.
    let legacy_request = request("legacy", 3128);
    prod.create(&legacy_request).await.expect("create");
    for resource in ["pods", "configmaps", "services"] {
        let forget_the_installation = |object: &mut Value| {
            let annotations = object["metadata"]["annotations"]
                .as_object_mut()
                .expect("annotations");
            annotations.remove("crawl.example.com/installation-cluster");
            annotations.remove("crawl.example.com/installation-name");
        };
        (backend.edit(resource, &legacy_request.name, forget_the_installation)).await;
    }
    assert_eq!(
        staging
            .get(&legacy_request.name)
            .await
            .expect("legacy")
            .installation,
        None
    );
    let adopted = staging.adopt(&legacy_request.name).await.expect("adopt");
    assert_eq!(adopted.installation.as_ref(), Some(&staging_id));
    assert_eq!(
        backend
            .object("configmaps", &legacy_request.name)
            .await
            .expect("config map")["metadata"]["annotations"]["crawl.example.com/installation-name"],
        "staging"
    );
    assert!(
        prod.adopt(&legacy_request.name).await.is_err(),
        "adopted once, by staging"
    );
    assert!(matches!(
        prod.get(&legacy_request.name).await,
        Err(ProviderError::NotFound(_))
    ));

    staging.delete(&legacy_request.name).await.expect("delete");
    prod.delete(&prod_request.name).await.expect("delete");
    backend.wait_no_pods().await;
}

#[tokio::test]
async fn a_create_interrupted_before_the_pod_is_completed_by_the_next_create() {
    let backend = KubernetesBackend::start().await;
    let provider = backend.provider("cluster");
    let request = request("interrupted", 3128);
    // The Pod create fails (the crash point; here an admission policy refuses it): config and
    // Service exist, no Pod.
    let probe: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "epo-admission-probe"},
        "spec": {"containers": [{"name": "probe", "image": "probe"}]},
    }))
    .expect("a Pod");
    backend
        .plane
        .deny_writes(NAMESPACE, &["CREATE"], "pod creates refused by the test", &probe)
        .await;
    let refused = provider.create(&request).await;
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("pod creates refused by the test")),
        "{refused:?}"
    );
    backend.plane.allow_writes(NAMESPACE, &probe).await;
    assert!(backend.object("configmaps", &request.name).await.is_some());
    assert!(backend.object("pods", &request.name).await.is_none());
    assert!(matches!(
        provider.get(&request.name).await,
        Err(ProviderError::NotFound(_))
    ));
    let instance = provider
        .create(&request)
        .await
        .expect("the repeated create completes");
    assert_eq!(instance.owner.as_ref(), Some(&request.owner));
    assert!(backend.object("pods", &request.name).await.is_some());
    provider.delete(&request.name).await.expect("delete");
    for resource in ["pods", "configmaps", "services"] {
        assert!(
            backend.object(resource, &request.name).await.is_none(),
            "{resource} left behind"
        );
    }
}
