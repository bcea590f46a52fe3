//! The Python client and Scrapy middleware (`clients/python/`) against standalone mode as a
//! crawler team runs it: the real operator binary, three real Squids from the `local`
//! provider, the discovery API over a socket. The package is installed (not imported from the
//! checkout), then its pytest suite runs with the API's URL and token and each Squid's access
//! log in the environment, twice: in a virtualenv that sees Debian's Scrapy (2.8) and pytest,
//! and in one built from PyPI with the newest Scrapy, pinned (`clients/python/tests/
//! newest-pins.txt`), by the README's install line, `pip install './clients/python[scrapy]'`.
//! That one is cached under `~/.cache/egress-proxies-operator/python/`, keyed by the pins.
//! Apart from that, mypy checks the package's types.
//!
//! Needs `python3-scrapy`, `python3-pytest`, `python3-venv` and `python3-mypy` (scripts/test.sh
//! installs them), and PyPI the first time the newest pins are used.
//! `EPO_PYTHON` names another interpreter (default `/usr/bin/python3`, Debian's, where those
//! packages live).

mod support;

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use sha2::{Digest, Sha256};
use support::{
    Origin, crate_path, free_port,
    process::GroupChild,
    standalone::{self, Host, healthy_rows, metrics_when, start_operator_with, stop, wait_status},
};

/// The user name in the proxies' credentials (Squid logs it with each request).
const PROXY_USER: &str = "crawler";
/// Their password, which no crawl log may show.
const PROXY_PASSWORD: &str = "py-secret-7";

/// Runs `command`, panicking with its output unless it succeeds.
fn run(what: &str, command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {:?}: {e}", command.get_program()));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Copies the package's sources (not its tests) to `to`, so that building it writes nothing
/// into the checkout.
fn copy_package(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read package dir").flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == "tests"
            || name.starts_with('.')
            || name == "build"
            || name.ends_with(".egg-info")
            || name == "__pycache__"
        {
            continue;
        }
        if entry.file_type().expect("file type").is_dir() {
            copy_package(&entry.path(), &to.join(&*name));
        } else {
            std::fs::copy(entry.path(), to.join(&*name)).expect("copy");
        }
    }
}

/// The interpreter whose site packages hold Debian's Scrapy, pytest and mypy.
fn system_python() -> String {
    std::env::var("EPO_PYTHON").unwrap_or_else(|_| "/usr/bin/python3".to_owned())
}

/// A virtualenv in `dir` over the system's site packages (Scrapy, pytest) with the package
/// installed from a copy of `clients/python`, offline; returns its interpreter.
fn install_package(dir: &Path) -> PathBuf {
    let python = system_python();
    run(
        "Scrapy and pytest importable (apt-get install python3-scrapy python3-pytest, or bash scripts/test.sh)",
        Command::new(&python).args(["-c", "import scrapy, pytest"]),
    );
    let venv = dir.join("venv");
    run(
        "creating a virtualenv (apt-get install python3-venv)",
        Command::new(&python)
            .args(["-m", "venv", "--system-site-packages"])
            .arg(&venv),
    );
    let source = dir.join("package");
    copy_package(&crate_path("clients/python"), &source);
    let venv_python = venv.join("bin/python");
    run(
        "pip install clients/python",
        Command::new(&venv_python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--no-build-isolation",
            ])
            .arg(&source)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    );
    venv_python
}

/// The newest Scrapy's virtualenv for `pins` (a constraints file), built once by the documented
/// install line, `pip install './clients/python[scrapy]'`, in a fresh virtualenv (run where a
/// copy of the package sits at `clients/python`), then pytest and a setuptools that builds
/// wheels itself (the per-run reinstall is offline); later runs reuse it. Returns
/// its interpreter, with the package reinstalled from a fresh copy of the checkout.
fn newest_scrapy_venv(scratch: &Path, pins: &Path) -> PathBuf {
    let text = std::fs::read(pins).expect("read the pins");
    let key: String = Sha256::digest(&text)[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let home = std::env::var("HOME").expect("HOME is set");
    let venv = PathBuf::from(home).join(format!(
        ".cache/egress-proxies-operator/python/scrapy-newest-{key}"
    ));
    let python = venv.join("bin/python");
    let checkout = scratch.join("checkout");
    copy_package(&crate_path("clients/python"), &checkout.join("clients/python"));
    if !venv.join(".complete").exists() {
        let _ = std::fs::remove_dir_all(&venv);
        run(
            "creating a virtualenv (apt-get install python3-venv)",
            Command::new(system_python()).args(["-m", "venv"]).arg(&venv),
        );
        // The README's line, word for word (`v` is the cached virtualenv, which cannot move);
        // PIP_CONSTRAINT pins what it pulls in.
        std::os::unix::fs::symlink(&venv, checkout.join("v")).expect("symlink v");
        run(
            "pip install './clients/python[scrapy]' from PyPI",
            Command::new("sh")
                .args(["-c", "v/bin/pip install './clients/python[scrapy]'"])
                .current_dir(&checkout)
                .env("PIP_CONSTRAINT", pins)
                .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
        );
        run(
            "pip install pytest setuptools from PyPI",
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "pytest", "setuptools"])
                .env("PIP_CONSTRAINT", pins)
                .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
        );
        std::fs::write(venv.join(".complete"), &text).expect("mark the virtualenv complete");
    }
    // The suite runs this checkout's package, whatever the cached one was built from.
    run(
        "pip install clients/python into the cached virtualenv",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--force-reinstall",
                "--no-build-isolation",
            ])
            .arg(checkout.join("clients/python"))
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    );
    python
}

/// One suite at a time: each starts its own operator and Squids, and the frozen-proxy test's
/// timing needs the machine's attention.
static SUITE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_and_scrapy_middleware_against_standalone_mode() {
    let _one = SUITE.lock().await;
    let host = Host::new();
    let python = install_package(host.path());
    python_suite(host, &python).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_and_scrapy_middleware_with_the_newest_scrapy_from_pypi() {
    let _one = SUITE.lock().await;
    let host = Host::new();
    let python = newest_scrapy_venv(host.path(), &crate_path("clients/python/tests/newest-pins.txt"));
    let version = run(
        "Scrapy's version",
        Command::new(&python).args(["-c", "import scrapy; print(scrapy.__version__)"]),
    );
    let pins =
        std::fs::read_to_string(crate_path("clients/python/tests/newest-pins.txt")).expect("read the pins");
    let pinned = format!("Scrapy=={}", String::from_utf8_lossy(&version.stdout).trim());
    assert!(
        pins.lines().any(|l| l == pinned),
        "{pinned} is not what newest-pins.txt pins"
    );
    python_suite(host, &python).await;
}

/// Runs the pytest suite with `python` against standalone mode on `host`.
async fn python_suite(host: Host, python: &Path) {
    let origin = Origin::start().await;
    let health_url = origin.http_url("/health");
    // Proxies with credentials, as in production: the client and Scrapy must present them.
    host.add_manifest(
        "credentials",
        &standalone::credentials_secret("proxy-credentials", PROXY_USER, PROXY_PASSWORD),
    );
    for name in ["py-1", "py-2", "py-3"] {
        let manifest = standalone::manifest(
            name,
            free_port(),
            &health_url,
            &[("pool", "pytest")],
            &[("maxConcurrent", 1), ("cooldownSeconds", 1)],
        );
        host.add_manifest(name, &standalone::with_auth(&manifest, "proxy-credentials"));
    }
    // A fourth proxy, outside the tests' selector, under politeness for every domain: what
    // request mode's wait for `notBefore` is tested on.
    let polite = standalone::manifest(
        "py-polite",
        free_port(),
        &health_url,
        &[("pool", "pytest-polite")],
        &[("maxConcurrent", 10), ("cooldownSeconds", 0)],
    );
    host.add_manifest("py-polite", &standalone::with_auth(&polite, "proxy-credentials"));

    // Politeness for a domain only the client's test names (no page is fetched from it), and
    // for every domain through the fourth proxy.
    std::fs::write(
        host.path().join("rules.yaml"),
        "politeness:\n  - {domains: [polite.example], minIntervalMs: 1000}\n  - {proxies: {pool: pytest-polite}, minIntervalMs: 500}\n",
    )
    .expect("rules file");
    let operator = start_operator_with(&host, "operator.log", &["--gateway-rules", "rules.yaml"]);
    wait_status(&host, "four healthy proxies", |t| healthy_rows(t) == 4).await;
    let logs = host.access_logs();
    assert_eq!(logs.len(), 4, "one access log per Squid: {logs:?}");
    let access_logs: serde_json::Map<String, serde_json::Value> = logs
        .iter()
        .map(|(endpoint, path)| (endpoint.clone(), path.display().to_string().into()))
        .collect();

    // pytest's output goes to a file, so that a hang still shows how far it got.
    let pytest_log = host.path().join("pytest.log");
    let mut pytest = GroupChild::spawn(
        Command::new(python)
            .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"])
            .current_dir(crate_path("clients/python"))
            .env("EPO_URL", host.api_url())
            .env("EPO_TOKEN_FILE", host.token_file())
            .env("EPO_SELECTOR", "pool=pytest")
            .env("EPO_PROXY_USER", PROXY_USER)
            .env("EPO_PROXY_PASSWORD", PROXY_PASSWORD)
            .env(
                "EPO_ACCESS_LOGS",
                serde_json::Value::Object(access_logs).to_string(),
            )
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("http_proxy")
            .env_remove("HTTP_PROXY"),
        &pytest_log,
    );
    let Some(status) = pytest.exit_within(Duration::from_secs(300)).await else {
        panic!(
            "pytest still running after 5 minutes:\n{}\noperator log:\n{}",
            pytest.log(),
            operator.log()
        )
    };
    let output = pytest.log();
    println!("{output}");
    assert!(
        status.success(),
        "pytest failed ({status}):\n{output}\noperator log:\n{}",
        operator.log()
    );
    assert!(output.contains(" passed"), "{output}");
    assert!(!output.contains(" skipped"), "every Python test ran: {output}");
    // The operator's own counts agree: no lease left behind, and the outcomes the client and
    // the middleware reported (six bans: the 403 site, the ban mid-crawl whose page was sent
    // again, the 404 with configured ban codes, the three that ban every proxy for one domain;
    // three errors: the client's context manager left by an exception, a download timeout in
    // Scrapy, the lease on the Squid frozen mid-crawl).
    let expected = [
        "epo_discovery_leases_active 0",
        r#"epo_discovery_leases_released_total{code="banned"} 6"#,
        r#"epo_discovery_leases_released_total{code="error"} 3"#,
    ];
    metrics_when(&host, "the Python tests' leases", |t| {
        expected.iter().all(|line| t.lines().any(|l| l == *line))
    })
    .await;
    stop(operator);
}

/// The package is typed: mypy in strict mode (its settings in pyproject.toml) finds nothing.
#[test]
fn python_package_type_checks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let source = dir.path().join("package");
    copy_package(&crate_path("clients/python"), &source);
    let output = run(
        "mypy (apt-get install python3-mypy, or bash scripts/test.sh)",
        Command::new(system_python())
            .args(["-m", "mypy", "--cache-dir"])
            .arg(dir.path().join("mypy-cache"))
            .current_dir(&source),
    );
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(report.contains("Success: no issues found"), "{report}");
}
