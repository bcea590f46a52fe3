//! A real `kubectl` manages Proxies against a real kube-apiserver (built from source,
//! `tests/support/control_plane.rs`) while the operator runs (cluster mode in-process as the
//! shipped ServiceAccount, the `local` provider with real Squid): `apply -k config/default` as
//! the README installs it, `apply -f` of a sample, `get` with the CRD's printer columns,
//! `-o yaml`, `describe` with conditions and Events, a `patch` that replaces the instance, and
//! `delete` completing through the finalizer.
//!
//! kubectl is the one built with the control plane (same version as the server);
//! `EPO_KUBECTL=/path/to/kubectl` runs another binary.

mod support;

use std::{
    path::{Path, PathBuf},
    process::Output,
    time::Duration,
};

use serde_json::Value;
use support::{
    Origin,
    cluster_app::{ClusterApp, local_cluster},
    control_plane::ControlPlane,
    free_port, wait_until,
};
use tokio::process::Command;

/// Runs one kubectl binary with its own kubeconfig and cache (under a temp HOME).
struct Kubectl {
    bin: PathBuf,
    home: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    /// `EPO_KUBECTL`, else the control plane's own kubectl, with `kubeconfig` (default
    /// namespace `crawl`).
    fn new(dir: &Path, plane: &ControlPlane) -> Self {
        let bin = std::env::var_os("EPO_KUBECTL")
            .filter(|path| !path.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| plane.assets().join("kubectl"));
        let home = dir.join("home");
        std::fs::create_dir_all(&home).expect("kubectl home");
        let kubeconfig = dir.join("kubeconfig");
        let admin = std::fs::read_to_string(plane.admin_kubeconfig()).expect("admin kubeconfig");
        std::fs::write(
            &kubeconfig,
            admin.replace("namespace: default", "namespace: crawl"),
        )
        .expect("kubeconfig");
        Self {
            bin,
            home,
            kubeconfig,
        }
    }

    async fn output(&self, args: &[&str]) -> Output {
        let mut command = Command::new(&self.bin);
        command
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HOME", &self.home)
            .env_remove("KUBECTL_EXTERNAL_DIFF")
            .kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(120), command.output())
            .await
            .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish within 120 s"))
            .unwrap_or_else(|e| panic!("running {}: {e}", self.bin.display()))
    }

    /// Runs kubectl and returns its stdout; fails the test with its stderr if it fails.
    async fn ok(&self, args: &[&str]) -> String {
        let output = self.output(args).await;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "kubectl {args:?} failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }

    /// Runs kubectl expecting it to fail; returns its stderr.
    async fn fails(&self, args: &[&str]) -> String {
        let output = self.output(args).await;
        assert!(
            !output.status.success(),
            "kubectl {args:?} should have failed:\n{}",
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8_lossy(&output.stderr).into_owned()
    }
}

/// `kubectl get proxies` output: the header's column names and each row's cells.
fn table(text: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    // Empty cells make the columns ragged: cut each row at the header's column starts.
    let header_line = text.lines().next().unwrap_or_default();
    let starts: Vec<usize> = header_line
        .char_indices()
        .filter(|&(i, c)| c != ' ' && (i == 0 || header_line.as_bytes()[i - 1] == b' '))
        .map(|(i, _)| i)
        .collect();
    let rows = lines
        .map(|line| {
            starts
                .iter()
                .enumerate()
                .map(|(n, &start)| {
                    let end = starts.get(n + 1).copied().unwrap_or(line.len()).min(line.len());
                    line.get(start.min(line.len())..end)
                        .unwrap_or_default()
                        .trim()
                        .to_owned()
                })
                .collect()
        })
        .collect();
    (header, rows)
}

fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).unwrap_or_else(|e| panic!("kubectl printed invalid YAML ({e}):\n{text}"))
}

fn refuses_connections(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_manages_a_proxy_through_its_lifecycle() {
    let origin = Origin::start().await;
    let plane = ControlPlane::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let _squids = support::process::KillSquidsUnder(dir.path().to_owned());
    let kubectl = Kubectl::new(dir.path(), &plane);
    let version = yaml(&kubectl.ok(&["version", "-o", "yaml"]).await);
    println!(
        "kubectl {} against kube-apiserver {}",
        version["clientVersion"]["gitVersion"].as_str().unwrap_or("?"),
        version["serverVersion"]["gitVersion"].as_str().unwrap_or("?"),
    );
    let minor: u32 = version["clientVersion"]["minor"]
        .as_str()
        .and_then(|m| m.trim_end_matches('+').parse().ok())
        .expect("kubectl reports its minor version");

    // Install the product as the README says: CRDs, RBAC, the operator's namespaces,
    // ServiceAccount and Deployment, in one apply of the kustomization.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let default = repo.join("config/default");
    let out = kubectl.ok(&["apply", "-k", default.to_str().unwrap()]).await;
    for created in [
        "customresourcedefinition.apiextensions.k8s.io/proxies.crawl.example.com created",
        "customresourcedefinition.apiextensions.k8s.io/providerhealths.crawl.example.com created",
        "clusterrole.rbac.authorization.k8s.io/egress-proxies-operator created",
        "serviceaccount/egress-proxies-operator created",
        "deployment.apps/egress-proxies-operator created",
    ] {
        assert!(out.contains(created), "{created} missing from:\n{out}");
    }
    kubectl
        .ok(&[
            "wait",
            "--for=condition=Established",
            "crd/proxies.crawl.example.com",
            "crd/providerhealths.crawl.example.com",
            "--timeout=60s",
        ])
        .await;
    let namespace = dir.path().join("namespace.yaml");
    std::fs::write(
        &namespace,
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: crawl\n",
    )
    .unwrap();
    kubectl.ok(&["apply", "-f", namespace.to_str().unwrap()]).await;

    // The operator as the ServiceAccount the shipped ClusterRole and Roles bind.
    let (admin_port, discovery_port) = (free_port(), free_port());
    let operator = ClusterApp::start(
        plane.operator_client().await,
        local_cluster(
            dir.path(),
            &dir.path().join("local"),
            "kubectl-test-token-0123456789",
            format!("127.0.0.1:{admin_port}").parse().unwrap(),
            format!("127.0.0.1:{discovery_port}").parse().unwrap(),
        ),
    );
    let proxies: kube::Api<egress_proxies_operator::api::Proxy> =
        kube::Api::namespaced(plane.client().await, "crawl");

    // The sample, pointed at this test's world: a free port and a loopback health target,
    // checked every 2 s.
    let port = free_port();
    let mut sample = yaml(&std::fs::read_to_string(repo.join("config/samples/proxy_local.yaml")).unwrap());
    let name = sample["metadata"]["name"].as_str().unwrap().to_owned();
    sample["spec"]["port"] = port.into();
    sample["spec"]["health"]["url"] = format!("http://{}/health", origin.http).into();
    sample["spec"]["health"]["intervalSeconds"] = 2.into();
    sample["spec"]["health"]["timeoutSeconds"] = 1.into();
    let manifest_path = dir.path().join("proxy.yaml");
    std::fs::write(&manifest_path, serde_norway::to_string(&sample).unwrap()).unwrap();
    let manifest = manifest_path.to_str().unwrap();

    // A field the CRD's schema does not declare: kubectl >= 1.25 learns from OpenAPI v3 that
    // the server validates fields and sends fieldValidation=Strict, so it is refused. Older
    // ones validate against OpenAPI v2 definitions, which the fake does not publish.
    if minor >= 25 {
        let mut misspelt = sample.clone();
        misspelt["spec"]["colour"] = "blue".into();
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, serde_norway::to_string(&misspelt).unwrap()).unwrap();
        let refused = kubectl.fails(&["apply", "-f", bad.to_str().unwrap()]).await;
        assert!(
            refused.contains(r#"strict decoding error: unknown field "spec.colour""#),
            "{refused}"
        );
    } else {
        println!("kubectl 1.{minor} predates server-side field validation: unknown-field check skipped");
    }
    assert!(proxies.get_opt(&name).await.expect("readable").is_none());

    let out = kubectl.ok(&["apply", "-f", manifest]).await;
    assert_eq!(out.trim(), format!("proxy.crawl.example.com/{name} created"));

    // `kubectl get proxies`: the CRD's printer columns, filled in as the operator goes.
    let row = wait_until(
        Duration::from_secs(60),
        "kubectl get proxies to show it healthy",
        async || {
            let (header, rows) = table(&kubectl.ok(&["get", "proxies"]).await);
            assert_eq!(header, ["NAME", "PHASE", "PROVIDER", "ENDPOINT", "AGE"]);
            let row = rows.into_iter().find(|r| r[0] == name)?;
            (row[1] == "healthy").then_some(row)
        },
    )
    .await;
    println!("kubectl get proxies: {row:?}");
    assert_eq!(row[2], "local");
    assert_eq!(row[3], format!("127.0.0.1:{port}"));
    assert!(
        row[4].ends_with('s') && row[4][..row[4].len() - 1].parse::<u64>().is_ok(),
        "AGE is a duration in seconds: {row:?}"
    );
    // The short name and the category the CRD declares resolve too.
    let (_, rows) = table(&kubectl.ok(&["get", "px"]).await);
    assert_eq!(rows.len(), 1);
    // ProviderHealth, cluster-scoped: its printer columns include a JSONPath filter over the
    // conditions (`Available`) and a priority-1 column that only `-o wide` shows.
    let rows = wait_until(
        Duration::from_secs(30),
        "the local provider's health",
        async || {
            let (header, rows) = table(&kubectl.ok(&["get", "providerhealths"]).await);
            if rows.is_empty() {
                return None; // "No resources found" (on stderr) until the first probe
            }
            assert_eq!(header, ["NAME", "TYPE", "AVAILABLE", "INSTANCES", "AGE"]);
            (rows.len() == 1 && !rows[0][2].is_empty()).then_some(rows)
        },
    )
    .await;
    assert_eq!(rows[0][..3], ["local", "local", "True"], "{rows:?}");
    // An integer column (the count at the last probe, every 30 s).
    assert!(rows[0][3].parse::<u64>().is_ok(), "{rows:?}");
    let (header, _) = table(&kubectl.ok(&["get", "ph", "-o", "wide"]).await);
    assert_eq!(
        header,
        ["NAME", "TYPE", "AVAILABLE", "INSTANCES", "LATENCY", "AGE"]
    );
    // The category both CRDs declare lists both kinds.
    let all = kubectl.ok(&["get", "crawl"]).await;
    assert!(all.contains(&format!("proxy.crawl.example.com/{name}")), "{all}");
    assert!(all.contains("providerhealth.crawl.example.com/local"), "{all}");

    // `-o yaml`: the object as stored, with the operator's status and finalizer.
    let object = yaml(&kubectl.ok(&["get", "proxy", &name, "-o", "yaml"]).await);
    assert_eq!(object["spec"]["port"], port);
    assert_eq!(object["status"]["phase"], "healthy");
    assert_eq!(object["status"]["endpoint"], format!("127.0.0.1:{port}"));
    let spec_hash = object["status"]["specHash"]
        .as_str()
        .expect("specHash")
        .to_owned();
    assert!(
        object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty()),
        "{object:#}"
    );
    assert!(
        object["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"].is_string(),
        "client-side apply records what it applied"
    );
    let ready = object["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .cloned()
        .expect("a Ready condition");
    assert_eq!(ready["status"], "True", "{ready:#}");

    // `describe`: the conditions from the status and the operator's Events (written through
    // events.k8s.io/v1, listed by describe through the core v1 API with field selectors).
    let described = wait_until(
        Duration::from_secs(30),
        "describe to show the Events",
        async || {
            let text = kubectl.ok(&["describe", "proxy", &name]).await;
            let events = text.split("\nEvents:").nth(1)?.to_owned();
            (events.lines().count() > 2).then_some(text)
        },
    )
    .await;
    println!("kubectl describe proxy {name}:\n{described}");
    assert!(
        described.contains(&format!("Name:         {name}")),
        "{described}"
    );
    assert!(described.contains("Conditions:"), "{described}");
    let events = described.split("\nEvents:").nth(1).unwrap();
    assert!(
        events.contains("Type") && events.contains("Reason") && events.contains("From"),
        "{events}"
    );
    assert!(events.contains("Normal"), "{events}");

    // Applying an edited manifest again: client-side apply sends a JSON merge patch (OpenAPI
    // says custom resources take no strategic merge patch) computed from its last-applied
    // annotation, so a dropped attribute is removed. Attributes never replace the instance.
    sample["spec"]["attributes"] = serde_json::json!({"region": "eu", "pool": "blue"});
    std::fs::write(&manifest_path, serde_norway::to_string(&sample).unwrap()).unwrap();
    let out = kubectl.ok(&["apply", "-f", manifest]).await;
    assert_eq!(out.trim(), format!("proxy.crawl.example.com/{name} configured"));
    let stored = serde_json::to_value(proxies.get(&name).await.expect("stored")).unwrap();
    assert_eq!(
        stored["spec"]["attributes"],
        serde_json::json!({"region": "eu", "pool": "blue"})
    );
    assert!(
        stored["metadata"]["managedFields"]
            .as_array()
            .is_some_and(|fields| fields.iter().any(|f| f["manager"] == "kubectl-client-side-apply")),
        "kubectl apply wrote as its own field manager: {stored:#}"
    );
    // Server-side apply, as `kubectl apply --server-side` sends it.
    sample["spec"]["attributes"]["pool"] = "green".into();
    std::fs::write(&manifest_path, serde_norway::to_string(&sample).unwrap()).unwrap();
    let out = kubectl.ok(&["apply", "--server-side", "-f", manifest]).await;
    assert_eq!(
        out.trim(),
        format!("proxy.crawl.example.com/{name} serverside-applied")
    );
    let stored = serde_json::to_value(proxies.get(&name).await.expect("stored")).unwrap();
    assert_eq!(stored["spec"]["attributes"]["pool"], "green");
    assert_eq!(
        stored["status"]["specHash"], spec_hash,
        "attributes replace nothing"
    );
    // kubectl patch defaults to a strategic merge patch, which custom resources refuse.
    let refused = kubectl
        .fails(&["patch", "proxy", &name, "-p", r#"{"spec":{"port":1}}"#])
        .await;
    assert!(refused.contains("application/merge-patch+json"), "{refused}");

    // A spec edit that changes what runs (the port): the operator replaces the instance.
    let new_port = free_port();
    let out = kubectl
        .ok(&[
            "patch",
            "proxy",
            &name,
            "--type",
            "merge",
            "-p",
            &format!(r#"{{"spec":{{"port":{new_port}}}}}"#),
        ])
        .await;
    assert_eq!(out.trim(), format!("proxy.crawl.example.com/{name} patched"));
    let mut phases = Vec::new();
    let replaced = wait_until(
        Duration::from_secs(90),
        "the replacement, through kubectl",
        async || {
            let fields = kubectl
            .ok(&[
                "get",
                "proxy",
                &name,
                "-o",
                "jsonpath={.status.phase} {.status.endpoint} {.status.specHash} {.status.observedGeneration} {.metadata.generation}",
            ])
            .await;
            let fields: Vec<String> = fields.split(' ').map(str::to_owned).collect();
            if phases.last() != Some(&fields[0]) {
                phases.push(fields[0].clone());
            }
            (fields[0] == "healthy" && fields[1] == format!("127.0.0.1:{new_port}")).then_some(fields)
        },
    )
    .await;
    println!("phases seen through kubectl after the patch: {phases:?}; now {replaced:?}");
    assert_ne!(replaced[2], spec_hash, "an instance of the new spec");
    assert_eq!(
        replaced[3], replaced[4],
        "the operator observed the patched generation"
    );
    assert!(refuses_connections(port), "the old Squid is gone");
    assert!(!refuses_connections(new_port), "the new Squid listens");
    wait_until(
        Duration::from_secs(30),
        "describe to show the SpecChanged Event",
        async || {
            let described = kubectl.ok(&["describe", "proxy", &name]).await;
            let events = described.split("\nEvents:").nth(1)?.to_owned();
            events.contains("SpecChanged").then_some(())
        },
    )
    .await;

    // `kubectl delete` waits for the object to be gone: the operator drains, deletes the
    // Squid and removes its finalizer.
    let out = kubectl.ok(&["delete", "proxy", &name, "--timeout=90s"]).await;
    // kubectl 1.36 names the namespace; older ones do not.
    assert!(
        out.trim()
            .starts_with(&format!("proxy.crawl.example.com \"{name}\" deleted")),
        "{out}"
    );
    assert!(
        proxies.get_opt(&name).await.expect("readable").is_none(),
        "kubectl delete returned only once the object was gone"
    );
    assert!(refuses_connections(new_port), "the Squid is gone");
    let missing = kubectl.fails(&["get", "proxy", &name]).await;
    assert!(
        missing.contains(&format!("proxies.crawl.example.com \"{name}\" not found")),
        "{missing}"
    );
    let out = kubectl.ok(&["get", "proxies"]).await;
    assert!(out.is_empty(), "{out}");

    operator.stop().await;
}
