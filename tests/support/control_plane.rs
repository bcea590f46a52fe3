//! A real Kubernetes control plane for cluster-mode tests, in the manner of controller-runtime's
//! envtest: etcd and kube-apiserver (built from source by `scripts/lib/control-plane.sh`) on
//! free loopback ports, with certificates made here (a CA, the API server's serving
//! certificate, an admin client certificate in `system:masters`, the ServiceAccount signing
//! key), RBAC authorization on, and optionally kube-controller-manager (namespace deletion,
//! garbage collection of owned objects, ServiceAccounts), kube-scheduler and kwok (one fake
//! node, so pods are scheduled and become Running with an IP).
//!
//! Every process is a child of the test in a process group of its own and dies with the guard
//! (or the test process). One control plane per test process (nextest runs each test in its
//! own process); each test still works in a namespace of its own ([`ControlPlane::namespace`]).
//!
//! Include with `mod support;`, or with `pub mod control_plane; pub mod process;` in a test's
//! own `mod support { .. }`.
//!
//! Binaries: `EPO_CONTROL_PLANE_ASSETS` names their folder (scripts/test.sh builds them once
//! and sets it); without it the script is run from here, which builds what is missing.

#![allow(dead_code)]

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use base64::Engine;
use k8s_openapi::{
    api::{
        authentication::v1::TokenRequest,
        core::v1::{ConfigMap, Namespace, ServiceAccount},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, Config,
    api::{PostParams, ResourceExt},
    config::{KubeConfigOptions, Kubeconfig},
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::json;

use super::process::GroupChild;

use super::ports::free_port;

/// The namespace and ServiceAccount `config/default` runs the operator as.
pub const OPERATOR_NAMESPACE: &str = "egress-proxies-system";
pub const OPERATOR_SERVICE_ACCOUNT: &str = "egress-proxies-operator";

/// Which parts beyond etcd and kube-apiserver to run.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// kube-controller-manager: namespace deletion, garbage collection, ServiceAccounts.
    pub controller_manager: bool,
    /// kube-scheduler and kwok with one fake node: pods get scheduled, Running and an IP.
    pub nodes: bool,
    /// etcd syncs every write to disk (as in production); off by default, as in envtest,
    /// because no test needs the data to outlive the machine.
    pub etcd_fsync: bool,
    /// Extra kube-apiserver flags (`--flag=value`).
    pub apiserver_args: Vec<String>,
}

/// etcd and kube-apiserver (and what [`Options`] adds), stopped on drop.
pub struct ControlPlane {
    dir: tempfile::TempDir,
    assets: PathBuf,
    etcd: GroupChild,
    etcd_url: String,
    apiserver: Option<GroupChild>,
    apiserver_args: Vec<String>,
    controller_manager: Option<GroupChild>,
    scheduler: Option<GroupChild>,
    kwok: Option<GroupChild>,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    ca_pem: String,
    admin_kubeconfig: PathBuf,
}

/// The folder holding the control-plane binaries: `EPO_CONTROL_PLANE_ASSETS`, else what
/// `scripts/lib/control-plane.sh` builds (or finds in its cache).
pub fn assets() -> PathBuf {
    if let Some(dir) = std::env::var_os("EPO_CONTROL_PLANE_ASSETS").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/lib/control-plane.sh");
    let output = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "{} failed (it builds kube-apiserver, etcd and kwok with Go): {}",
        script.display(),
        output.status
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// Certificates and keys, as PEM.
struct Pki {
    ca_cert: String,
    ca_key: String,
    serving_cert: String,
    serving_key: String,
    admin_cert: String,
    admin_key: String,
    service_account_key: String,
    service_account_public_key: String,
}

impl Pki {
    fn generate() -> Self {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "epo-test-control-plane-ca");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let ca_cert_pem = ca_cert.pem();
        let ca_key_pem = ca_key.serialize_pem();
        let issuer = Issuer::new(ca, ca_key);

        let serving_key = KeyPair::generate().expect("serving key");
        let mut serving = CertificateParams::new(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "10.0.0.1".to_owned(),
            "kubernetes".to_owned(),
            "kubernetes.default.svc".to_owned(),
        ])
        .expect("serving params");
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving
            .signed_by(&serving_key, &issuer)
            .expect("serving certificate");

        let admin_key = KeyPair::generate().expect("admin key");
        let mut admin = CertificateParams::new(Vec::<String>::new()).expect("admin params");
        admin.distinguished_name.push(DnType::CommonName, "epo-admin");
        admin
            .distinguished_name
            .push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_cert = admin.signed_by(&admin_key, &issuer).expect("admin certificate");

        let service_account = KeyPair::generate().expect("service account key");
        Self {
            ca_cert: ca_cert_pem,
            ca_key: ca_key_pem,
            serving_cert: serving_cert.pem(),
            serving_key: serving_key.serialize_pem(),
            admin_cert: admin_cert.pem(),
            admin_key: admin_key.serialize_pem(),
            service_account_key: service_account.serialize_pem(),
            service_account_public_key: service_account.public_key_pem(),
        }
    }
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// A kubeconfig for `url` trusting `ca_pem`, authenticating with `user` (a YAML mapping).
fn kubeconfig_text(url: &str, ca_pem: &str, namespace: &str, user: serde_json::Value) -> String {
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "epo-test", "cluster": {"server": url, "certificate-authority-data": b64(ca_pem)}}],
        "contexts": [{"name": "epo-test", "context": {"cluster": "epo-test", "user": "epo-test", "namespace": namespace}}],
        "current-context": "epo-test",
        "users": [{"name": "epo-test", "user": user}],
    });
    serde_norway::to_string(&config).expect("kubeconfig as YAML")
}

/// A kube client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> Client {
    let config = Kubeconfig::read_from(kubeconfig).expect("readable kubeconfig");
    let config = Config::from_custom_kubeconfig(config, &KubeConfigOptions::default())
        .await
        .expect("a usable kubeconfig");
    Client::try_from(config).expect("kube client")
}

impl ControlPlane {
    /// etcd and kube-apiserver only.
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(options: Options) -> Self {
        let assets = assets();
        let dir = tempfile::Builder::new()
            .prefix("epo-control-plane-")
            .tempdir()
            .expect("control plane dir");
        let pki = Pki::generate();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {name}: {e}"));
            path
        };
        let ca = write("ca.crt", &pki.ca_cert);
        write("ca.key", &pki.ca_key);
        let serving_cert = write("apiserver.crt", &pki.serving_cert);
        let serving_key = write("apiserver.key", &pki.serving_key);
        let sa_key = write("service-account.key", &pki.service_account_key);
        let sa_public_key = write("service-account.pub", &pki.service_account_public_key);

        let (etcd, etcd_url) = start_etcd(&assets, dir.path(), options.etcd_fsync).await;

        let port = free_port();
        let url = format!("https://127.0.0.1:{port}");
        let admin_kubeconfig = write(
            "admin.kubeconfig",
            &kubeconfig_text(
                &url,
                &pki.ca_cert,
                "default",
                json!({"client-certificate-data": b64(&pki.admin_cert), "client-key-data": b64(&pki.admin_key)}),
            ),
        );
        let mut apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--advertise-address=127.0.0.1".to_owned(),
            format!("--cert-dir={}", dir.path().join("apiserver-certs").display()),
            format!("--tls-cert-file={}", serving_cert.display()),
            format!("--tls-private-key-file={}", serving_key.display()),
            format!("--client-ca-file={}", ca.display()),
            "--authorization-mode=RBAC".to_owned(),
            "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            format!("--service-account-key-file={}", sa_public_key.display()),
            format!("--service-account-signing-key-file={}", sa_key.display()),
            "--allow-privileged=true".to_owned(),
            // One API server: no Endpoints of its own to keep in step with others.
            "--endpoint-reconciler-type=none".to_owned(),
        ];
        apiserver_args.extend(options.apiserver_args.iter().cloned());

        let mut plane = Self {
            dir,
            assets,
            etcd,
            etcd_url,
            apiserver: None,
            apiserver_args,
            controller_manager: None,
            scheduler: None,
            kwok: None,
            url,
            ca_pem: pki.ca_cert,
            admin_kubeconfig,
        };
        plane.start_apiserver().await;

        if options.controller_manager {
            let log = plane.dir.path().join("kube-controller-manager.log");
            let mut command = Command::new(plane.assets.join("kube-controller-manager"));
            command.args([
                format!("--kubeconfig={}", plane.admin_kubeconfig.display()),
                "--leader-elect=false".to_owned(),
                "--secure-port=0".to_owned(),
                "--controllers=namespace-controller,garbage-collector-controller,serviceaccount-controller"
                    .to_owned(),
                format!("--root-ca-file={}", ca.display()),
                "--use-service-account-credentials=false".to_owned(),
            ]);
            plane.controller_manager = Some(GroupChild::spawn(&mut command, &log));
        }
        if options.nodes {
            plane.start_nodes().await;
        }
        plane
    }

    /// etcd and kube-apiserver with the CRDs installed and `namespaces` (plus the operator's
    /// own, `egress-proxies-system`) created; with a client as the admin.
    pub async fn with_crds(namespaces: &[&str]) -> (Self, Client) {
        let plane = Self::start().await;
        plane.install_crds().await;
        for namespace in namespaces.iter().chain(&[OPERATOR_NAMESPACE]) {
            plane.create_namespace(namespace).await;
        }
        let client = plane.client().await;
        (plane, client)
    }

    async fn start_apiserver(&mut self) {
        let log = self.dir.path().join("kube-apiserver.log");
        // Keep the logs of earlier runs (a restart's test reads why it restarted).
        if log.exists() {
            let old = std::fs::read_to_string(&log).unwrap_or_default();
            let previous = self.dir.path().join("kube-apiserver.previous.log");
            let mut all = std::fs::read_to_string(&previous).unwrap_or_default();
            all.push_str(&old);
            let _ = std::fs::write(previous, all);
        }
        let mut command = Command::new(self.assets.join("kube-apiserver"));
        command.args(&self.apiserver_args);
        let mut child = GroupChild::spawn(&mut command, &log);
        let client = self.client().await;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = client
                .request_text(
                    hyper::Request::get("/readyz")
                        .body(Vec::new())
                        .expect("a valid request"),
                )
                .await;
            if matches!(&ready, Ok(body) if body.trim() == "ok") {
                break;
            }
            if let Some(status) = child.exited() {
                panic!("kube-apiserver exited ({status}):\n{}", tail(&child.log(), 40));
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready within 120 s (last: {ready:?}):\n{}",
                tail(&child.log(), 40)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.apiserver = Some(child);
    }

    /// kube-scheduler, kwok and one fake node (`kwok-node-0`) that kwok keeps Ready.
    async fn start_nodes(&mut self) {
        let kubeconfig = self.admin_kubeconfig.display().to_string();
        let log = self.dir.path().join("kube-scheduler.log");
        let mut command = Command::new(self.assets.join("kube-scheduler"));
        command.args([
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--leader-elect=false".to_owned(),
            format!("--secure-port={}", free_port()),
            "--bind-address=127.0.0.1".to_owned(),
        ]);
        self.scheduler = Some(GroupChild::spawn(&mut command, &log));

        self.kwok = Some(self.spawn_kwok(0));

        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client().await);
        let node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": "kwok-node-0",
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"kubernetes.io/hostname": "kwok-node-0", "kubernetes.io/os": "linux", "type": "kwok"},
            },
            "status": {
                "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "1000"},
                "capacity": {"cpu": "32", "memory": "256Gi", "pods": "1000"},
            },
        }))
        .expect("a valid Node");
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("fake node created");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut restarts = 0;
        loop {
            if let Some(status) = self.kwok.as_mut().and_then(GroupChild::exited) {
                // kwok v0.8.0 as published can die at start ("fatal error: concurrent map
                // writes" in easycel's type caches); the build patches that, and this guards
                // against any other early exit. kwok keeps no state of its own.
                let log = self.kwok.as_ref().map(GroupChild::log).unwrap_or_default();
                assert!(restarts < 2, "kwok exited again ({status}):\n{}", tail(&log, 40));
                restarts += 1;
                eprintln!(
                    "kwok exited ({status}) before its node was Ready; starting it again:\n{}",
                    tail(&log, 5)
                );
                self.kwok = Some(self.spawn_kwok(restarts));
            }
            let node = nodes.get("kwok-node-0").await.expect("the fake node");
            let ready = node
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if ready {
                // The API server taints a new node not-ready; the node lifecycle controller
                // (not run here) would lift the taint once the node reports Ready.
                nodes
                    .patch(
                        "kwok-node-0",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(json!({"spec": {"taints": null}})),
                    )
                    .await
                    .expect("node taints lifted");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "kwok did not make its node Ready within 60 s:\n{}",
                tail(&self.kwok.as_ref().map(|k| k.log()).unwrap_or_default(), 40)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// kwok over this plane's API server, managing the nodes annotated `kwok.x-k8s.io/node=fake`;
    /// its `attempt`th start logs to a file of its own, so an earlier crash stays readable.
    fn spawn_kwok(&self, attempt: usize) -> GroupChild {
        let kubeconfig = self.admin_kubeconfig.display().to_string();
        let log = self.dir.path().join(match attempt {
            0 => "kwok.log".to_owned(),
            n => format!("kwok.{n}.log"),
        });
        let mut command = Command::new(self.assets.join("kwok"));
        command.args([
            format!("--kubeconfig={kubeconfig}"),
            format!("--config={}", self.assets.join("kwok-stages.yaml").display()),
            "--manage-all-nodes=false".to_owned(),
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".to_owned(),
            "--cidr=10.0.0.1/24".to_owned(),
            "--node-ip=10.0.0.1".to_owned(),
            format!("--server-address=127.0.0.1:{}", free_port()),
        ]);
        // kwok also reads ~/.kwok/kwok.yaml: not the user's.
        command.env("HOME", self.dir.path());
        // One thread at a time makes the race above (a pod's stages can hit it too, on the
        // first pod) need a preemption inside a map write rather than two cores at once.
        command.env("GOMAXPROCS", "1");
        GroupChild::spawn(&mut command, &log)
    }

    /// The admin's kubeconfig (`system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// A client as the admin (`system:masters`: RBAC does not apply).
    pub async fn client(&self) -> Client {
        client_from(&self.admin_kubeconfig).await
    }

    /// Where this control plane keeps its files (certificates, logs, kubeconfigs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Folder of the control-plane binaries (kubectl among them).
    pub fn assets(&self) -> &Path {
        &self.assets
    }

    /// Creates namespace `prefix-XXXXXXXX` and its `default` ServiceAccount (which the
    /// controller manager would make, and pods need), returning its name.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{:08x}", fastrand::u32(..));
        self.create_namespace(&name).await;
        name
    }

    /// Creates namespace `name` (and its `default` ServiceAccount).
    pub async fn create_namespace(&self, name: &str) {
        let client = self.client().await;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let ns = serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        let accounts: Api<ServiceAccount> = Api::namespaced(client, name);
        let account =
            serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("service account");
        match accounts.create(&PostParams::default(), &account).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => panic!("creating {name}/default ServiceAccount: {e}"),
        }
    }

    /// Runs the pinned kubectl as the admin, with a HOME of its own (its discovery cache);
    /// fails the test with kubectl's stderr if it fails, else returns its stdout.
    pub async fn kubectl(&self, args: &[&str]) -> String {
        let output = self.kubectl_output(args).await;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "kubectl {args:?} failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }

    /// Runs the pinned kubectl as the admin and returns what it did, failed or not.
    pub async fn kubectl_output(&self, args: &[&str]) -> std::process::Output {
        let home = self.dir.path().join("kubectl-home");
        std::fs::create_dir_all(&home).expect("kubectl home");
        let mut command = tokio::process::Command::new(self.assets.join("kubectl"));
        command
            .args(args)
            .env("KUBECONFIG", &self.admin_kubeconfig)
            .env("HOME", &home)
            .kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(120), command.output())
            .await
            .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish within 120 s"))
            .unwrap_or_else(|e| panic!("running kubectl: {e}"))
    }

    /// Installs the product as the README says, `kubectl apply -k config/default` (CRDs,
    /// RBAC, the operator's namespaces, ServiceAccount and Deployment), waits for the CRDs,
    /// and returns a client that is the operator's ServiceAccount: it may do exactly what
    /// the shipped RBAC grants.
    pub async fn install_default(&self) -> Client {
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default");
        self.kubectl(&["apply", "-k", config.to_str().expect("a UTF-8 path")])
            .await;
        let crds: Api<CustomResourceDefinition> = Api::all(self.client().await);
        for name in ["proxies.crawl.example.com", "providerhealths.crawl.example.com"] {
            self.wait_established(&crds, name).await;
        }
        self.operator_client().await
    }

    /// A kubeconfig that is the shipped ServiceAccount,
    /// `egress-proxies-system/egress-proxies-operator` (for the operator binary).
    pub async fn operator_kubeconfig(&self) -> PathBuf {
        self.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT)
            .await
    }

    /// A client that is the shipped ServiceAccount (for cluster mode in-process).
    pub async fn operator_client(&self) -> Client {
        client_from(&self.operator_kubeconfig().await).await
    }

    /// Installs the CRDs of `config/crd/bases/` and waits until the server serves them.
    pub async fn install_crds(&self) {
        let crds: Api<CustomResourceDefinition> = Api::all(self.client().await);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/crd/bases");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("config/crd/bases") {
            let path = entry.expect("a directory entry").path();
            if path.extension().is_none_or(|ext| ext != "yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a CRD file");
            let crd: CustomResourceDefinition =
                serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            names.push(crd.name_any());
            crds.create(&PostParams::default(), &crd)
                .await
                .unwrap_or_else(|e| panic!("installing {}: {e}", path.display()));
        }
        for name in names {
            self.wait_established(&crds, &name).await;
        }
    }

    async fn wait_established(&self, crds: &Api<CustomResourceDefinition>, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let crd = crds.get(name).await.expect("the CRD");
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "CRD {name} not Established within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A token for ServiceAccount `namespace/name` (TokenRequest, one hour), and a kubeconfig
    /// file that authenticates with it, written into this control plane's folder.
    pub async fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> PathBuf {
        let token = self.service_account_token(namespace, name, &[]).await;
        let path = self.dir.path().join(format!("{namespace}-{name}.kubeconfig"));
        std::fs::write(
            &path,
            kubeconfig_text(&self.url, &self.ca_pem, namespace, json!({"token": token})),
        )
        .expect("kubeconfig written");
        path
    }

    /// A token of ServiceAccount `namespace/name` (created if missing) from the TokenRequest
    /// API, valid for an hour, for `audiences` (none: the API server's own).
    pub async fn service_account_token(&self, namespace: &str, name: &str, audiences: &[&str]) -> String {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client().await, namespace);
        if accounts
            .get_opt(name)
            .await
            .expect("reading the ServiceAccount")
            .is_none()
        {
            let account =
                serde_json::from_value(json!({"metadata": {"name": name}})).expect("service account");
            accounts
                .create(&PostParams::default(), &account)
                .await
                .expect("ServiceAccount created");
        }
        let request: TokenRequest = serde_json::from_value(json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600, "audiences": audiences},
        }))
        .expect("token request");
        let answer: TokenRequest = accounts
            .create_subresource("token", name, &PostParams::default(), &request)
            .await
            .expect("a ServiceAccount token");
        answer.status.expect("a token in the answer").token
    }

    /// Freezes kube-apiserver (SIGSTOP): connections stay open and nothing answers, as with a
    /// server stuck in a long GC pause or behind a dead link, until [`Self::thaw_apiserver`].
    pub fn freeze_apiserver(&self) {
        let pid = self.signal_apiserver(libc::SIGSTOP);
        // kill(2) returns once the signal is queued, not once every thread has stopped: a
        // request sent at once could still be answered (seen once in CI). Wait until the
        // kernel reports each thread stopped.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !every_thread_stopped(pid) {
            assert!(
                Instant::now() < deadline,
                "kube-apiserver did not stop within 5 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Lets a frozen kube-apiserver run again (SIGCONT).
    pub fn thaw_apiserver(&self) {
        self.signal_apiserver(libc::SIGCONT);
    }

    /// Sends `signal` to kube-apiserver; returns its pid.
    fn signal_apiserver(&self, signal: libc::c_int) -> libc::pid_t {
        let pid = self
            .apiserver
            .as_ref()
            .and_then(GroupChild::pid)
            .expect("kube-apiserver running");
        let pid = libc::pid_t::try_from(pid).expect("a pid fits pid_t");
        // SAFETY: kill(2) on our own child's pid; no memory is shared.
        let done = unsafe { libc::kill(pid, signal) };
        assert_eq!(
            done,
            0,
            "signalling kube-apiserver: {}",
            std::io::Error::last_os_error()
        );
        pid
    }

    /// Stops kube-apiserver (SIGTERM, as an upgrade or a crash-restart would) and starts it
    /// again on the same port and etcd; returns once it is ready.
    pub async fn restart_apiserver(&mut self) {
        self.stop_apiserver().await;
        self.start_apiserver().await;
    }

    /// Stops kube-apiserver (clients see connection refused until [`Self::start_apiserver_again`]).
    pub async fn stop_apiserver(&mut self) {
        if let Some(mut apiserver) = self.apiserver.take() {
            apiserver.terminate_async(Duration::from_secs(30)).await;
        }
    }

    /// Starts kube-apiserver after [`Self::stop_apiserver`].
    pub async fn start_apiserver_again(&mut self) {
        self.start_apiserver().await;
    }

    /// Compacts etcd's history up to its current revision (as kube-apiserver does every five
    /// minutes): a watch that resumes from an older resourceVersion gets `410 Gone`. Returns
    /// the revision compacted to.
    pub async fn compact_etcd(&self) -> i64 {
        let revision = self.etcd_revision().await;
        let answer = etcd_post(
            &self.etcd_url,
            "/v3/kv/compaction",
            json!({"revision": revision.to_string(), "physical": true}),
        )
        .await;
        assert!(answer.is_object(), "etcd compaction answered {answer}");
        revision
    }

    /// etcd's current revision (what kube-apiserver calls the resourceVersion).
    pub async fn etcd_revision(&self) -> i64 {
        // A range over a key nobody writes answers with the header only.
        let answer = etcd_post(&self.etcd_url, "/v3/kv/range", json!({"key": b64("\0")})).await;
        answer["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("etcd range answered {answer}"))
    }

    /// The API server's own request counters (`apiserver_request_total`), summed per
    /// (verb, resource, subresource), for what a client did between two reads.
    pub async fn request_counts(&self) -> RequestCounts {
        let client = self.client().await;
        let text = client
            .request_text(
                hyper::Request::get("/metrics")
                    .body(Vec::new())
                    .expect("a valid request"),
            )
            .await
            .expect("the API server's metrics");
        RequestCounts::parse(&text)
    }

    /// Makes the API server refuse creates, updates (patches included) and deletes of
    /// ConfigMaps in `namespace`, as a real admission policy would, with a message naming `why`,
    /// until [`Self::allow_writes`]. Returns once a dry-run create is refused.
    pub async fn deny_configmap_writes(&self, namespace: &str, why: &str) {
        self.deny_writes(
            namespace,
            &["CREATE", "UPDATE", "DELETE"],
            why,
            &configmap_probe(),
        )
        .await;
    }

    /// Makes the API server refuse `operations` (`CREATE`, `UPDATE` (patches too), `DELETE`)
    /// on objects of `probe`'s kind in `namespace`, with a message naming `why`: a
    /// ValidatingAdmissionPolicy and its binding, the way a cluster's policy refuses writes.
    /// Returns once a dry-run create of `probe` is refused (the policy is in force).
    pub async fn deny_writes<K: Probe>(&self, namespace: &str, operations: &[&str], why: &str, probe: &K) {
        let name = Self::policy_name::<K>(namespace);
        let (group, version) = (K::group(&()).into_owned(), K::version(&()).into_owned());
        let policy = json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": [group], "apiVersions": [version],
                    "operations": operations, "resources": [K::plural(&())],
                }]},
                "validations": [{"expression": "false", "message": why}],
            },
        });
        let binding = json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": namespace,
                }}},
            },
        });
        let path = self.dir.path().join(format!("{name}.yaml"));
        let yaml = [policy, binding]
            .iter()
            .map(|object| serde_norway::to_string(object).expect("YAML"))
            .collect::<Vec<_>>()
            .join("---\n");
        std::fs::write(&path, yaml).expect("policy file");
        self.kubectl(&["apply", "-f", path.to_str().expect("a UTF-8 path")])
            .await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match self.dry_run_create(namespace, probe).await {
                Err(kube::Error::Api(status)) if status.message.contains(why) => return,
                other => assert!(
                    std::time::Instant::now() < deadline,
                    "the admission policy not in force after 30 s: {other:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Lifts [`Self::deny_configmap_writes`].
    pub async fn allow_configmap_writes(&self, namespace: &str) {
        self.allow_writes(namespace, &configmap_probe()).await;
    }

    /// Lifts [`Self::deny_writes`]; returns once a dry-run create of `probe` is accepted.
    pub async fn allow_writes<K: Probe>(&self, namespace: &str, probe: &K) {
        let name = Self::policy_name::<K>(namespace);
        self.kubectl(&[
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            &name,
        ])
        .await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while let Err(error) = self.dry_run_create(namespace, probe).await {
            assert!(
                std::time::Instant::now() < deadline,
                "the admission policy still in force after 30 s: {error}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A dry-run create of `probe` in `namespace`: what admission says, nothing stored.
    async fn dry_run_create<K: Probe>(&self, namespace: &str, probe: &K) -> Result<K, kube::Error> {
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        Api::<K>::namespaced(self.client().await, namespace)
            .create(&dry_run, probe)
            .await
    }

    fn policy_name<K: kube::Resource<DynamicType = ()>>(namespace: &str) -> String {
        format!("epo-deny-{}-{namespace}", K::plural(&()))
    }

    /// Resident set of etcd and of kube-apiserver, in bytes (from `/proc/PID/status`).
    pub fn resident_bytes(&self) -> (u64, u64) {
        let rss = |child: Option<&GroupChild>| {
            let pid = child.and_then(GroupChild::pid)?;
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()?
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
                .map(|kb| kb * 1024)
        };
        (
            rss(Some(&self.etcd)).unwrap_or(0),
            rss(self.apiserver.as_ref()).unwrap_or(0),
        )
    }

    /// [`Self::request_counts`] once its write counts stop moving (two reads 200 ms apart agree).
    /// The API server counts a request after its handler returns, which can be after the
    /// client has read the answer: a count read right after a write may miss it.
    pub async fn settled_request_counts(&self) -> RequestCounts {
        let mut last = self.request_counts().await;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = self.request_counts().await;
            if now.writes() == last.writes() {
                return now;
            }
            last = now;
        }
    }

    /// etcd's own metrics text (`/metrics` on its client port).
    pub async fn etcd_metrics(&self) -> String {
        etcd_get(&self.etcd_url, "/metrics").await
    }

    /// The last lines of every component's log, for a failing test's message.
    pub fn logs_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        for name in [
            "kube-apiserver",
            "etcd",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        ] {
            let path = self.dir.path().join(format!("{name}.log"));
            if let Ok(text) = std::fs::read_to_string(path) {
                out.push_str(&format!("--- {name} ---\n{}\n", tail(&text, lines)));
            }
        }
        out
    }
}

/// An object a dry-run create tries, to see whether an admission policy is in force.
pub trait Probe:
    kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
    + Clone
    + serde::Serialize
    + serde::de::DeserializeOwned
    + std::fmt::Debug
{
}

impl<K> Probe for K where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug
{
}

fn configmap_probe() -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": "epo-admission-probe"}})).expect("a ConfigMap")
}

/// The verbs of `apiserver_request_total` that change objects.
const WRITE_VERBS: &[&str] = &["POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"];

/// `apiserver_request_total` summed per (verb, resource, subresource, code).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestCounts(pub std::collections::BTreeMap<(String, String, String, String), f64>);

impl RequestCounts {
    fn parse(text: &str) -> Self {
        let mut counts = std::collections::BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let label = |name: &str| {
                labels
                    .split("\",")
                    .filter_map(|pair| pair.split_once("=\""))
                    .find(|(key, _)| *key == name)
                    .map(|(_, v)| v.trim_end_matches('"').to_owned())
                    .unwrap_or_default()
            };
            let value: f64 = value.trim().parse().unwrap_or(0.0);
            *counts
                .entry((
                    label("verb"),
                    label("resource"),
                    label("subresource"),
                    label("code"),
                ))
                .or_insert(0.0) += value;
        }
        Self(counts)
    }

    /// The counts of writes only.
    fn writes(&self) -> Vec<f64> {
        self.0
            .iter()
            .filter(|((verb, ..), _)| WRITE_VERBS.contains(&verb.as_str()))
            .map(|(_, count)| *count)
            .collect()
    }

    /// Requests counted in `self` and not in `before`, for `resource` and the verbs given.
    pub fn since(&self, before: &RequestCounts, resource: &str, verbs: &[&str]) -> f64 {
        self.0
            .iter()
            .filter(|((verb, res, _, _), _)| res == resource && verbs.contains(&verb.as_str()))
            .map(|(key, value)| value - before.0.get(key).copied().unwrap_or(0.0))
            .sum()
    }

    /// Requests to `resource` answered with `code` since `before`.
    pub fn with_code_since(&self, before: &RequestCounts, resource: &str, code: &str) -> f64 {
        self.0
            .iter()
            .filter(|((_, res, _, c), _)| res == resource && c == code)
            .map(|(key, value)| value - before.0.get(key).copied().unwrap_or(0.0))
            .sum()
    }

    /// Writes to `resource` answered with a 2xx since `before`.
    pub fn successful_writes_since(&self, before: &RequestCounts, resource: &str) -> f64 {
        self.0
            .iter()
            .filter(|((verb, res, _, code), _)| {
                res == resource && WRITE_VERBS.contains(&verb.as_str()) && code.starts_with('2')
            })
            .map(|(key, value)| value - before.0.get(key).copied().unwrap_or(0.0))
            .sum()
    }

    /// Writes (create, update, patch, delete) to `resource` since `before`.
    pub fn writes_since(&self, before: &RequestCounts, resource: &str) -> f64 {
        self.since(before, resource, WRITE_VERBS)
    }
}

async fn start_etcd(assets: &Path, dir: &Path, fsync: bool) -> (GroupChild, String) {
    let client_port = free_port();
    let peer_port = free_port();
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut command = Command::new(assets.join("etcd"));
    command.args([
        "--name=epo-test".to_owned(),
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls={client_url}"),
        format!("--advertise-client-urls={client_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=epo-test={peer_url}"),
        "--log-level=warn".to_owned(),
    ]);
    if !fsync {
        command.arg("--unsafe-no-fsync");
    }
    let mut child = GroupChild::spawn(&mut command, &dir.join("etcd.log"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if etcd_get(&client_url, "/health").await.contains("\"true\"") {
            return (child, client_url);
        }
        if let Some(status) = child.exited() {
            panic!("etcd exited ({status}):\n{}", tail(&child.log(), 40));
        }
        assert!(
            Instant::now() < deadline,
            "etcd not healthy within 30 s:\n{}",
            tail(&child.log(), 40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn etcd_get(base: &str, path: &str) -> String {
    etcd_request(base, path, None).await
}

async fn etcd_post(base: &str, path: &str, body: serde_json::Value) -> serde_json::Value {
    let text = etcd_request(base, path, Some(body.to_string())).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("etcd {path} answered {text:?}: {e}"))
}

/// One plain-HTTP request to etcd's client port (its gRPC gateway and /health); empty on a
/// connection error (etcd still starting).
async fn etcd_request(base: &str, path: &str, body: Option<String>) -> String {
    use http_body_util::{BodyExt, Full};
    let authority = base.trim_start_matches("http://").to_owned();
    let Ok(stream) = tokio::net::TcpStream::connect(&authority).await else {
        return String::new();
    };
    let Ok((mut sender, connection)) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await
    else {
        return String::new();
    };
    tokio::spawn(connection);
    let method = if body.is_some() { "POST" } else { "GET" };
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", &authority)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.unwrap_or_default())))
        .expect("a valid request");
    let Ok(response) = sender.send_request(request).await else {
        return String::new();
    };
    let bytes = response
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/PID/task/*/stat`).
fn every_thread_stopped(pid: libc::pid_t) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}
