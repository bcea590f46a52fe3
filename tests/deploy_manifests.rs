//! The deployment manifests keep the promises docs make about them: least-privilege RBAC that
//! matches the flags they pass (and those flags exist), and a locked-down operator container
//! with probes.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

fn docs(path: &str) -> Vec<Value> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("YAML"))
        .collect()
}

#[test]
fn rbac_has_no_wildcards_and_writes_only_where_needed() {
    let mut rules = Vec::new();
    for file in [
        "config/rbac/role.yaml",
        "config/rbac/leader_election_role.yaml",
        "config/rbac/kubernetes_provider_role.yaml",
        "config/components/discovery-token-review/role.yaml",
        "config/namespaced/rbac.yaml",
    ] {
        for doc in docs(file) {
            let provider_role = file.ends_with("kubernetes_provider_role.yaml");
            for rule in doc["rules"].as_array().into_iter().flatten() {
                rules.push((provider_role, rule.clone()));
            }
        }
    }
    let writes = ["create", "update", "patch", "delete", "deletecollection"];
    for (provider_role, rule) in &rules {
        for field in ["apiGroups", "resources", "verbs"] {
            let values: Vec<&str> = rule[field]
                .as_array()
                .expect(field)
                .iter()
                .map(|v| v.as_str().expect("string"))
                .collect();
            assert!(!values.contains(&"*"), "wildcard in {field}: {rule}");
        }
        let resources: Vec<&str> = rule["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let verbs: Vec<&str> = rule["verbs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        if resources.contains(&"secrets") {
            // The operator never writes users' Secrets. The one exception is the `kubernetes`
            // provider's Role, in its own namespace: it creates and deletes the Secret holding
            // each proxy's hashed password file, and nothing else.
            let allowed: &[&str] = if *provider_role {
                &["get", "create", "delete"]
            } else {
                &["get", "list", "watch"]
            };
            assert!(
                verbs.iter().all(|v| allowed.contains(v)),
                "Secrets must be read-only outside the kubernetes provider's Role: {rule}"
            );
        }
        if verbs.iter().any(|v| writes.contains(v)) {
            let allowed = [
                "proxies",
                "proxies/status",
                "providerhealths",
                "providerhealths/status",
                "events",
                "tokenreviews",
                "leases",
                "configmaps",
                "pods",
                "services",
                "secrets",
            ];
            assert!(
                resources.iter().all(|r| allowed.contains(r)),
                "unexpected write access: {rule}"
            );
        }
    }
}

#[test]
fn operator_container_is_locked_down_with_probes() {
    let deployment = docs("config/manager/manager.yaml")
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let container = &pod["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
}

#[test]
fn kustomizations_reference_existing_files() {
    for kustomization in [
        "config/default/kustomization.yaml",
        "config/crd/kustomization.yaml",
        "config/rbac/kustomization.yaml",
        "config/manager/kustomization.yaml",
        "config/components/discovery-token-review/kustomization.yaml",
        "config/namespaced/kustomization.yaml",
    ] {
        let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(kustomization)
            .parent()
            .unwrap()
            .to_owned();
        for doc in docs(kustomization) {
            for resource in doc["resources"].as_array().expect("resources") {
                let path = dir.join(resource.as_str().unwrap());
                assert!(
                    path.exists(),
                    "{kustomization}: {} does not exist",
                    path.display()
                );
            }
        }
    }
}

/// `egress-proxies-operator run --help`.
fn run_help() -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_egress-proxies-operator"))
        .args(["run", "--help"])
        .output()
        .expect("running the binary");
    assert!(output.status.success());
    String::from_utf8(output.stdout).expect("UTF-8 help")
}

fn is_run_flag(help: &str, flag: &str) -> bool {
    help.lines().any(|line| {
        line.split_whitespace()
            .any(|word| word.trim_end_matches(',') == flag)
    })
}

/// The operator container's args in manager.yaml.
fn manager_args() -> Vec<String> {
    let deployment = docs("config/manager/manager.yaml")
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment");
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_owned())
        .collect()
}

const TOKEN_REVIEW_COMPONENT: &str = "config/components/discovery-token-review";

/// The args the token-review component appends (its JSON patches on the Deployment).
fn component_args() -> Vec<String> {
    let kustomization = docs(&format!("{TOKEN_REVIEW_COMPONENT}/kustomization.yaml"));
    let mut args = Vec::new();
    for patch in kustomization[0]["patches"].as_array().expect("patches") {
        assert_eq!(patch["target"]["kind"], "Deployment");
        let ops: Vec<Value> =
            serde_norway::from_str(patch["patch"].as_str().expect("inline patch")).expect("patch YAML");
        for op in ops {
            assert_eq!(op["path"], "/spec/template/spec/containers/0/args/-", "{op}");
            args.push(op["value"].as_str().expect("string arg").to_owned());
        }
    }
    args
}

/// Whether these RBAC files let the operator create TokenReviews.
fn grants_token_reviews(files: &[String]) -> bool {
    files.iter().flat_map(|f| docs(f)).any(|doc| {
        doc["rules"].as_array().into_iter().flatten().any(|rule| {
            rule["resources"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r == "tokenreviews")
                && rule["verbs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|v| v == "create")
        })
    })
}

fn rbac_files(dir: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<String> = std::fs::read_dir(root.join(dir))
        .expect("RBAC folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("kustomization.yaml"))
        .map(|p| {
            p.strip_prefix(root)
                .expect("under the crate")
                .display()
                .to_string()
        })
        .collect();
    files.sort();
    files
}

#[test]
fn manifests_pass_real_flags_and_rbac_matches_exactly_what_they_need() {
    let help = run_help();
    let base = manager_args();
    let with_review: Vec<String> = base.iter().cloned().chain(component_args()).collect();
    for arg in with_review.iter().filter(|a| a.starts_with("--")) {
        let flag = arg.split('=').next().unwrap_or_default();
        assert!(
            is_run_flag(&help, flag),
            "manifests pass {flag}, which `run` does not have"
        );
    }
    // The deployment chooses its discovery authentication explicitly (`run` refuses to start
    // otherwise) and does not opt out.
    let flag = |args: &[String], name: &str| {
        args.iter()
            .any(|a| a == name || a.starts_with(&format!("{name}=")))
    };
    assert!(
        [
            "--discovery-tokens",
            "--discovery-tokens-secret",
            "--discovery-token-review"
        ]
        .iter()
        .any(|f| flag(&base, f)),
        "no discovery authentication in {base:?}"
    );
    assert!(!flag(&with_review, "--discovery-no-auth"));
    // The tokens file lies in the mounted tokens Secret.
    let tokens = base
        .iter()
        .find_map(|a| a.strip_prefix("--discovery-tokens="))
        .expect("--discovery-tokens=FILE");
    let deployment = docs("config/manager/manager.yaml")
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| tokens.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the tokens file is under a volume mount");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(
        volume["secret"]["secretName"],
        "egress-proxies-operator-discovery-tokens"
    );

    // TokenReviews are granted exactly where --discovery-token-review is passed.
    let base_rbac = rbac_files("config/rbac");
    assert!(!flag(&base, "--discovery-token-review"));
    assert!(
        !grants_token_reviews(&base_rbac),
        "TokenReview granted without the flag"
    );
    assert!(flag(&with_review, "--discovery-token-review"));
    assert!(flag(&with_review, "--discovery-token-audience"));
    let component_rbac = rbac_files(TOKEN_REVIEW_COMPONENT);
    assert!(grants_token_reviews(&component_rbac));
    let component_rules: Vec<Value> = component_rbac
        .iter()
        .flat_map(|f| docs(f))
        .filter_map(|d| d["rules"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(
        component_rules,
        vec![serde_json::json!({
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        })],
        "the component grants TokenReview creation and nothing else"
    );
}

/// Every `--discovery-*` flag named anywhere under config/ (comments included) exists.
#[test]
fn config_mentions_only_existing_discovery_flags() {
    let help = run_help();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("config")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            for (at, _) in text.match_indices("--discovery-") {
                let flag: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                assert!(
                    is_run_flag(&help, &flag),
                    "{} mentions {flag}, which `run` does not have",
                    path.display()
                );
            }
        }
    }
}

/// `run` without a discovery authentication choice stops before connecting anywhere, naming the
/// flags; the opt-out does not combine with a method.
#[test]
fn run_needs_an_explicit_discovery_authentication_choice() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_egress-proxies-operator"))
            .arg("run")
            .args(["--providers-config", "/nonexistent/providers.yaml"])
            .args(args)
            // No cluster to reach: a start that got past the check would fail differently.
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .expect("running the binary")
    };
    let output = run(&[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("discovery API authentication") && stderr.contains("--discovery-no-auth"),
        "{stderr}"
    );
    let output = run(&["--discovery-no-auth", "--discovery-tokens", "/tmp/tokens"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("cannot be used with"), "{stderr}");
    let output = run(&["--discovery-token-review"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--discovery-token-audience"), "{stderr}");
}
