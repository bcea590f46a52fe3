//! The deployment manifests keep the promises docs make about them: least-privilege RBAC and a
//! locked-down operator container with probes.

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
    ] {
        for doc in docs(file) {
            let provider_role = file.ends_with("kubernetes_provider_role.yaml");
            for rule in doc["rules"].as_array().expect("rules") {
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
