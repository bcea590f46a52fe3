//! The checked-in CRDs under config/crd/bases are exactly what the types generate, and the
//! generated CRDs have the shape kubectl users rely on.

use std::path::Path;

use egress_proxies_operator::api::{ProviderHealth, Proxy, crd_files, render_all};
use kube::CustomResourceExt;

#[test]
fn checked_in_crds_match_the_types() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/crd/bases");
    let files = crd_files().expect("CRDs render");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("config/crd/bases exists")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .collect();
    names.sort();
    let mut expected: Vec<String> = files.iter().map(|f| f.file_name.clone()).collect();
    expected.sort();
    assert_eq!(
        names, expected,
        "config/crd/bases holds exactly the generated CRDs"
    );
    for file in files {
        let on_disk = std::fs::read_to_string(dir.join(&file.file_name)).expect("readable");
        assert!(
            on_disk == file.yaml,
            "config/crd/bases/{} drifted from src/api; run `cargo run -- crd --out-dir config/crd/bases` and commit",
            file.file_name
        );
    }
}

#[test]
fn crd_command_prints_every_crd() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_egress-proxies-operator"))
        .arg("crd")
        .output()
        .expect("runs");
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8(output.stdout).expect("utf-8"),
        render_all().expect("renders")
    );
}

#[test]
fn proxy_crd_has_status_short_name_and_printer_columns() {
    let crd = Proxy::crd();
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(
        crd.spec.names.short_names.as_deref(),
        Some(&["px".to_owned()][..])
    );
    let version = &crd.spec.versions[0];
    assert!(
        version
            .subresources
            .as_ref()
            .and_then(|s| s.status.as_ref())
            .is_some(),
        "status subresource"
    );
    let columns: Vec<&str> = version
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(columns, ["Phase", "Provider", "Endpoint", "Age"]);
}

#[test]
fn provider_health_is_cluster_scoped_with_status() {
    let crd = ProviderHealth::crd();
    assert_eq!(crd.spec.scope, "Cluster");
    assert!(
        crd.spec.versions[0]
            .subresources
            .as_ref()
            .and_then(|s| s.status.as_ref())
            .is_some()
    );
}
