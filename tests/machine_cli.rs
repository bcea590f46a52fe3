//! The `machines` and `audit` subcommands, and scenario-file errors a user can make; and how
//! the binary reports a file it cannot use (each cause said once).

use std::path::{Path, PathBuf};
use std::process::Command;

use egress_proxies_operator::controller::simulate::{Scenario, ScenarioError, replay_file};
use egress_proxies_operator::machine::docs::render_markdown;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_egress-proxies-operator"))
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn machines_prints_the_rendered_doc() {
    let out = bin().arg("machines").output().expect("runs");
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).expect("utf-8"), render_markdown());
}

#[test]
fn machines_check_passes_on_the_repository() {
    let out = bin()
        .args(["machines", "--check"])
        .current_dir(repo())
        .output()
        .expect("runs");
    assert!(
        out.status.success(),
        "docs/machines.md drifted: run `cargo run -- machines > docs/machines.md`\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn machines_check_fails_on_a_stale_doc() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("docs")).expect("mkdir");
    std::fs::write(dir.path().join("docs/machines.md"), "# stale\n").expect("write");
    let out = bin()
        .args(["machines", "--check"])
        .current_dir(dir.path())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cargo run -- machines > docs/machines.md"),
        "{stderr}"
    );
}

#[tokio::test]
async fn audit_prints_the_trail_of_a_shipped_scenario() {
    let file = repo().join("machines/scenarios/create-to-healthy.yaml");
    let out = bin().arg("audit").arg(&file).output().expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(stdout, replay_file(&file).await.expect("replays"));
    assert!(
        stdout.contains("provisioning --health_passed--> healthy"),
        "{stdout}"
    );
}

#[test]
fn audit_names_the_step_with_a_bad_value() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("typo.yaml");
    std::fs::write(
        &file,
        "name: typo\nsteps:\n  - {at: 0}\n  - {at: 5, world: {health: pasing}}\n",
    )
    .expect("write");
    let out = bin().arg("audit").arg(&file).output().expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("step 2") && stderr.contains("pasing"), "{stderr}");
}

fn parse(yaml: &str) -> Result<Scenario, ScenarioError> {
    Scenario::from_yaml(yaml, Path::new("test.yaml"))
}

#[tokio::test]
async fn scenario_errors_are_specific() {
    let err = parse("name: x\nstart: {phase: runnin}\nsteps: []\n").expect_err("unknown phase");
    assert!(
        matches!(err, ScenarioError::Invalid { ref message, .. } if message.contains("runnin")),
        "{err}"
    );

    let err = parse("name: x\nsteps:\n  - {at: 10}\n  - {at: 5}\n").expect_err("time order");
    assert!(
        err.to_string()
            .contains("step 2: at 5s is before the previous step's 10s"),
        "{err}"
    );

    let err = parse("name: x\nsteps:\n  - {at: 0, colour: red}\n").expect_err("unknown key");
    assert!(matches!(err, ScenarioError::Parse { .. }), "{err}");

    let err = replay_file(Path::new("/nonexistent/scenario.yaml"))
        .await
        .expect_err("missing file");
    assert!(matches!(err, ScenarioError::Io { .. }), "{err}");
}

#[tokio::test]
async fn scenario_start_and_config_are_honoured() {
    let scenario = parse(
        "name: x\nconfig: {provisioning_timeout: 30}\nstart: {phase: provisioning}\n\
         steps:\n  - {at: 29}\n  - {at: 30}\n",
    )
    .expect("parses");
    let replay = scenario.replay().await.expect("replays");
    let reasons: Vec<&str> = replay.audit().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"ProvisioningTimedOut"), "{}", replay.render());
    assert_eq!(replay.steps[0].outcome.audit.len(), 0, "not yet at 29 s");
}

/// A file the binary cannot use is reported with its cause once: an error either says its
/// cause or hands it on as its source, never both (the binary prints the whole chain).
#[test]
fn a_file_that_cannot_be_used_is_reported_with_its_cause_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.yaml");
    let broken = dir.path().join("providers.yaml");
    std::fs::write(&broken, "providers:\n  - [local, local]\n").expect("write");
    let state = dir.path().join("state");
    let standalone = |providers: &Path| {
        bin()
            .arg("standalone")
            .arg("--manifests")
            .arg(dir.path())
            .arg("--providers-config")
            .arg(providers)
            .arg("--state")
            .arg(&state)
            .output()
            .expect("runs")
    };
    // kube's errors write their source into their own message and return it too.
    let cluster = bin()
        .args(["run", "--discovery-no-auth", "--providers-config"])
        .arg(repo().join("config/samples/standalone/providers.yaml"))
        .env("KUBECONFIG", &missing)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("runs");
    for (what, out, cause) in [
        (
            "cluster mode with a missing kubeconfig",
            cluster,
            "No such file or directory",
        ),
        (
            "audit of a missing scenario",
            bin().arg("audit").arg(&missing).output().expect("runs"),
            "No such file or directory",
        ),
        (
            "a missing providers config",
            standalone(&missing),
            "No such file or directory",
        ),
        (
            "a providers config of the wrong shape",
            standalone(&broken),
            "invalid type: sequence",
        ),
    ] {
        assert!(!out.status.success(), "{what}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.matches(cause).count(), 1, "{what}:\n{stderr}");
    }
}

/// A manifests folder that is not there is refused before anything is made: no state folder,
/// no token, no provider state, and no warning about work cut short.
#[test]
fn standalone_refuses_a_missing_manifests_folder_before_making_anything() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let out = bin()
        .arg("standalone")
        .arg("--manifests")
        .arg(dir.path().join("none"))
        .arg("--providers-config")
        .arg(repo().join("config/samples/standalone/providers.yaml"))
        .arg("--state")
        .arg(&state)
        .current_dir(dir.path())
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("manifests folder"), "{stderr}");
    assert!(!stderr.contains("WARN"), "{stderr}");
    let made: Vec<_> = std::fs::read_dir(dir.path())
        .expect("readable")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    assert!(made.is_empty(), "made {made:?}:\n{stderr}");
}
