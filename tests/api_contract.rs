//! The discovery API against its own OpenAPI contract, as a crawler team's tooling checks it:
//! schemathesis (pinned, from PyPI; `scripts/test.sh` installs it) loads the contract the real
//! operator binary serves in standalone mode, with three real Squids from the `local` provider
//! behind it, and runs every check it has through its coverage, fuzzing and stateful phases.
//! The stateful phase follows the contract's links (acquire → renew → release, renew → renew or
//! release) with real lease IDs and fencing tokens.
//!
//! Two settings, both in `tests/api_contract/`, say where this API differs from what schemathesis
//! assumes: a 503 is a documented answer (no proxy available, not ready, not the leader, journal
//! unavailable), and a lease is freed by `POST …/release` rather than a DELETE, so
//! `ensure_resource_availability` runs in a lease-aware form (`lease_hooks.py`).
//!
//! `EPO_SCHEMATHESIS` names the `schemathesis` executable (default: the virtualenv
//! `scripts/test.sh` makes under `~/.cache/egress-proxies-operator/python/`);
//! `EPO_SCHEMATHESIS_SEED` replays another seed (the default is fixed, so CI is repeatable).

mod support;

use std::{path::PathBuf, process::Command, time::Duration};

use support::{
    Origin, crate_path, free_port,
    process::GroupChild,
    standalone::{self, Host, healthy_rows, start_operator, stop, wait_status},
};

/// The pinned version (scripts/lib/install.sh installs the same).
const SCHEMATHESIS_VERSION: &str = "4.32.5";
/// The seed CI runs with.
const DEFAULT_SEED: &str = "241330036078212582347839059040340160327";

fn schemathesis() -> PathBuf {
    if let Some(path) = std::env::var_os("EPO_SCHEMATHESIS") {
        return path.into();
    }
    let home = std::env::var_os("HOME").expect("HOME is set");
    let venv = PathBuf::from(home).join(format!(
        ".cache/egress-proxies-operator/python/schemathesis-{SCHEMATHESIS_VERSION}"
    ));
    assert!(
        venv.join(".complete").exists(),
        "{} is missing or incomplete: run bash scripts/test.sh (it installs schemathesis {SCHEMATHESIS_VERSION}), or set EPO_SCHEMATHESIS",
        venv.display()
    );
    venv.join("bin/schemathesis")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_contract_holds_under_schemathesis() {
    let schemathesis = schemathesis();
    let origin = Origin::start().await;
    let host = Host::new();
    let health_url = origin.http_url("/health");
    for name in ["st-1", "st-2", "st-3"] {
        let manifest = standalone::manifest(
            name,
            free_port(),
            &health_url,
            &[("pool", "contract")],
            &[("maxConcurrent", 4)],
        );
        host.add_manifest(name, &manifest);
    }
    let operator = start_operator(&host, "operator.log");
    wait_status(&host, "three healthy proxies", |t| healthy_rows(t) == 3).await;

    let seed = std::env::var("EPO_SCHEMATHESIS_SEED").unwrap_or_else(|_| DEFAULT_SEED.to_owned());
    let contract = crate_path("tests/api_contract");
    let log = host.path().join("schemathesis.log");
    let mut run = GroupChild::spawn(
        Command::new(&schemathesis)
            .arg("--config-file")
            .arg(contract.join("schemathesis.toml"))
            .arg("run")
            .arg(format!("{}/v1/openapi.json", host.api_url()))
            .args(["--header", &format!("Authorization: Bearer {}", host.token())])
            .args([
                "--checks",
                "all",
                "--exclude-checks",
                "ensure_resource_availability",
            ])
            .args(["--max-examples", "300", "--workers", "1", "--seed", &seed])
            .args(["--no-color", "--report", "vcr", "--report-dir"])
            .arg(host.path().join("report"))
            .current_dir(host.path())
            .env("PYTHONPATH", &contract)
            .env("SCHEMATHESIS_HOOKS", "lease_hooks")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("http_proxy")
            .env_remove("HTTP_PROXY"),
        &log,
    );
    let Some(status) = run.exit_within(Duration::from_secs(600)).await else {
        panic!("schemathesis still running after 10 minutes:\n{}", run.log())
    };
    let output = run.log();
    println!("{output}");
    assert!(
        status.success(),
        "schemathesis failed ({status}), seed {seed}:\n{output}\noperator log:\n{}",
        operator.log()
    );
    // Every phase ran, the stateful one over the links (not "not applicable" for want of them),
    // and the lease-aware check was among the checks.
    for phase in ["✅ Coverage", "✅ Fuzzing", "✅ Stateful"] {
        assert!(output.contains(phase), "{phase} missing:\n{output}");
    }
    assert!(output.contains("No issues found"), "{output}");

    let report = std::fs::read_dir(host.path().join("report"))
        .expect("the report directory")
        .flatten()
        .map(|entry| std::fs::read_to_string(entry.path()).expect("the report"))
        .collect::<String>();
    assert!(
        report.contains("name: 'lease_available_until_released'"),
        "the lease-aware check ran"
    );
    // The stateful phase chained real leases: links led to renewals and releases that worked.
    let answered = |operation: &str| {
        report.split("\n- id: ").any(|interaction| {
            interaction.contains("name: 'stateful'")
                && interaction
                    .lines()
                    .any(|l| l.trim_start().starts_with("uri: ") && l.ends_with(&format!("/{operation}'")))
                && interaction.contains("code: '200'")
        })
    };
    assert!(
        answered("renew") && answered("release"),
        "no lease renewed and released through the links"
    );
    stop(operator);
}
