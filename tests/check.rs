//! `check` against the shipped samples and the invalid fixtures: every sample passes, every
//! fixture fails with exactly the message its first line expects.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use egress_proxies_operator::{
    check::{Checker, ProxySchema, Report},
    config::ProvidersConfig,
};
use serde::Deserialize;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn yaml_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo(dir))
        .expect("fixture folder exists")
        .map(|entry| entry.expect("readable entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    files
}

fn expected_problem(text: &str) -> &str {
    text.lines()
        .next()
        .and_then(|line| line.strip_prefix("# expect: "))
        .expect("a fixture starts with `# expect: <path>: <message>`")
}

#[test]
fn every_sample_passes_check_against_the_sample_providers_config() {
    let providers = ProvidersConfig::load(&repo("config/samples/providers.yaml"))
        .expect("sample providers config is valid");
    let checker = Checker::new(Some(providers));
    let samples = yaml_files("config/samples");
    assert!(samples.len() >= 6, "samples: {samples:?}");
    let mut report = Report::default();
    for sample in &samples {
        checker.check_file(sample, &mut report);
    }
    let problems: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
    assert!(
        problems.is_empty(),
        "samples have problems:\n{}",
        problems.join("\n")
    );
    assert_eq!(report.documents, samples.len(), "one document per sample file");
}

#[test]
fn every_invalid_fixture_is_rejected_with_its_message() {
    let fixtures = yaml_files("tests/fixtures/invalid");
    assert!(
        fixtures.len() >= 12,
        "need at least 12 invalid fixtures, found {}",
        fixtures.len()
    );
    let checker = Checker::new(None);
    let schema = ProxySchema::new();
    let mut failures = Vec::new();
    for fixture in &fixtures {
        let text = std::fs::read_to_string(fixture).expect("readable fixture");
        let expected = expected_problem(&text);
        let documents: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&text)
            .map(|doc| serde_json::Value::deserialize(doc).expect("fixture is YAML"))
            .collect();
        let mut found: Vec<String> = match documents.as_slice() {
            // One object: validated as a create.
            [_] => {
                let mut report = Report::default();
                checker.check_text("fixture", &text, &mut report);
                report
                    .problems
                    .iter()
                    .map(|p| format!("{}: {}", p.path, p.message))
                    .collect()
            }
            // Old and new object: validated as an update (transition rules).
            [old, new] => {
                assert!(
                    schema.validate(old).is_empty(),
                    "{}: the old object must be valid",
                    fixture.display()
                );
                schema
                    .validate_update(new, Some(old))
                    .into_iter()
                    .map(|(path, message)| format!("{path}: {message}"))
                    .collect()
            }
            other => panic!(
                "{}: expected 1 or 2 documents, found {}",
                fixture.display(),
                other.len()
            ),
        };
        // A structural error also says that the CEL rules were not run (as the server does;
        // tests/check_real_server.rs compares that): the fixture names its one problem.
        found.retain(|problem| !problem.contains("some validation rules were not checked"));
        if found != [expected] {
            failures.push(format!(
                "{}:\n  expected: {expected}\n  found:    {found:?}",
                fixture.display()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_command_prints_one_line_per_problem_and_fails() {
    let bin = env!("CARGO_BIN_EXE_egress-proxies-operator");
    let bad = repo("tests/fixtures/invalid/port-out-of-range.yaml");
    let good = repo("config/samples/proxy_local.yaml");
    let output = Command::new(bin)
        .arg("check")
        .arg(&good)
        .arg(&bad)
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(1), "a problem makes check fail");
    let stdout = String::from_utf8(output.stdout).expect("utf-8");
    assert_eq!(
        stdout,
        format!(
            "{}: document 1 (Proxy crawl/port-out-of-range): spec.port: must be a TCP port between 1 and 65535\n",
            bad.display()
        )
    );
    let output = Command::new(bin).arg("check").arg(&good).output().expect("runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.stdout.is_empty());
}

#[test]
fn the_command_cross_checks_provider_names_with_a_providers_config() {
    let bin = env!("CARGO_BIN_EXE_egress-proxies-operator");
    let dir = tempfile::tempdir().expect("temp dir");
    let providers = dir.path().join("providers.yaml");
    std::fs::write(
        &providers,
        "providers:\n  - name: only-this\n    type: local\n    settings: {stateDir: /tmp/x}\n",
    )
    .expect("write");
    let output = Command::new(bin)
        .arg("check")
        .arg("--providers-config")
        .arg(&providers)
        .arg(repo("config/samples/proxy_local.yaml"))
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8(output.stdout).expect("utf-8");
    assert!(
        stdout.ends_with("spec.provider: no provider instance named \"local\" in the providers config (configured: only-this)\n"),
        "{stdout}"
    );
}

#[test]
fn providers_config_problems_are_reported_by_check() {
    let checker = Checker::new(None);
    let mut report = Report::default();
    checker.check_text(
        "providers.yaml",
        "providers:\n  - name: a\n    type: kvm2\n    settings: {pool: p}\n",
        &mut report,
    );
    let lines: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        [
            r#"providers.yaml: document 1 (providers config): providers[0] ("a"): settings: missing field `uri`"#
        ]
    );
}

#[test]
fn standalone_samples_pass_check_against_their_providers_config() {
    let providers = ProvidersConfig::load(&repo("config/samples/standalone/providers.yaml")).expect("valid");
    let checker = Checker::new(Some(providers));
    let mut report = Report::default();
    let files = yaml_files("config/samples/standalone");
    for file in &files {
        checker.check_file(file, &mut report);
    }
    let problems: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(files.len(), 4, "three proxies and their providers config");
}
