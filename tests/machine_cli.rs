//! The `machines` and `audit` subcommands, and scenario-file errors a user can make.

use std::path::{Path, PathBuf};
use std::process::Command;

use egress_proxies_operator::machine::docs::render_markdown;
use egress_proxies_operator::machine::scenario::{Scenario, ScenarioError, replay_file};

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

#[test]
fn audit_prints_the_trail_of_a_shipped_scenario() {
    let file = repo().join("machines/scenarios/create-to-healthy.yaml");
    let out = bin().arg("audit").arg(&file).output().expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(stdout, replay_file(&file).expect("replays"));
    assert!(
        stdout.contains("provisioning --health_passed--> healthy"),
        "{stdout}"
    );
}

#[test]
fn audit_names_the_step_with_an_unknown_event() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("typo.yaml");
    std::fs::write(
        &file,
        "name: typo\nsteps:\n  - {at: 0, event: spec_observed}\n  - {at: 5, event: helth_passed}\n",
    )
    .expect("write");
    let out = bin().arg("audit").arg(&file).output().expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("step 2") && stderr.contains("helth_passed"),
        "{stderr}"
    );
}

fn parse(yaml: &str) -> Result<Scenario, ScenarioError> {
    Scenario::from_yaml(yaml, Path::new("test.yaml"))
}

#[test]
fn scenario_errors_are_specific() {
    let err = parse("name: x\nstart: {phase: runnin}\nsteps: []\n").expect_err("unknown phase");
    assert!(
        matches!(err, ScenarioError::UnknownPhase { ref name, .. } if name == "runnin"),
        "{err}"
    );

    let err =
        parse("name: x\nsteps:\n  - {at: 10, event: spec_observed}\n  - {at: 5, event: spec_observed}\n")
            .expect_err("time order");
    assert!(
        matches!(
            err,
            ScenarioError::TimeGoesBackwards {
                step: 2,
                at: 5,
                previous: 10
            }
        ),
        "{err}"
    );

    let err =
        parse("name: x\nsteps:\n  - {at: 0, event: spec_observed, colour: red}\n").expect_err("unknown key");
    assert!(matches!(err, ScenarioError::Parse { .. }), "{err}");

    let err = replay_file(Path::new("/nonexistent/scenario.yaml")).expect_err("missing file");
    assert!(matches!(err, ScenarioError::Io { .. }), "{err}");
}

#[test]
fn scenario_input_and_start_are_honoured() {
    let scenario = parse(
        "name: x\nstart: {phase: provisioning, attempts: 2}\ninput: {max_create_attempts: 2}\n\
         steps:\n  - {at: 0, event: create_failed}\n",
    )
    .expect("parses");
    let replay = scenario.replay();
    assert_eq!(replay.end.as_str(), "pending", "2 of 2 attempts used: give up");
}
