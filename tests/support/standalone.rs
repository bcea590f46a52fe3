//! Standalone mode as a user runs it, for tests of the real binary: a temp folder with a
//! providers config for the `local` provider and a `manifests/` folder, the operator started in
//! it, its `status` table, the discovery token, and every Squid started from the folder killed
//! when the [`Host`] drops.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;

use super::{
    free_port,
    process::{GroupChild, kill_squids_under},
};

/// The operator binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_egress-proxies-operator");

/// The temp folder the user would run in; kills every Squid started from it on Drop.
pub struct Host {
    pub dir: tempfile::TempDir,
    pub api_port: u16,
}

impl Host {
    /// A folder with `providers.yaml` (one `local` provider, state in `local/`) and an empty
    /// `manifests/`, and a free port for the discovery API.
    pub fn new() -> Host {
        let host = Host {
            dir: tempfile::tempdir().expect("temp dir"),
            api_port: free_port(),
        };
        std::fs::create_dir_all(host.dir.path().join("manifests")).expect("mkdir manifests");
        std::fs::write(
            host.dir.path().join("providers.yaml"),
            "providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: local\n",
        )
        .expect("providers");
        host
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The discovery API's base URL.
    pub fn api_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.api_port)
    }

    /// The discovery token file the operator creates on first start.
    pub fn token_file(&self) -> PathBuf {
        self.dir.path().join("state/discovery-tokens")
    }

    /// The discovery token (the token file's first token).
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.token_file())
            .expect("token file")
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .unwrap_or_default()
            .to_owned()
    }

    /// Writes `manifests/{name}.yaml`.
    pub fn add_manifest(&self, name: &str, yaml: &str) {
        std::fs::write(self.dir.path().join(format!("manifests/{name}.yaml")), yaml).expect("manifest");
    }

    /// Squid's access log of each local proxy, by the address it listens on (from the
    /// generated `squid.conf` of each instance folder under `local/`).
    pub fn access_logs(&self) -> Vec<(String, PathBuf)> {
        let mut logs: Vec<(String, PathBuf)> = std::fs::read_dir(self.dir.path().join("local"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let conf = std::fs::read_to_string(entry.path().join("squid.conf")).ok()?;
                let listen = conf.lines().find_map(|l| l.strip_prefix("http_port "))?;
                Some((listen.trim().to_owned(), entry.path().join("run/access.log")))
            })
            .collect();
        logs.sort();
        logs
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        kill_squids_under(self.dir.path());
    }
}

#[allow(unused_imports)] // For the tests that read Squids through this module; not every one does.
pub use super::process::squids;

/// The operator in standalone mode on `host`, logging to `log_name` in its folder. Squids it
/// starts run in their own sessions and are stopped by [`Host`]'s Drop.
pub fn start_operator(host: &Host, log_name: &str) -> GroupChild {
    start_operator_with(host, log_name, &[])
}

/// [`start_operator`] with `extra` arguments to `standalone`.
pub fn start_operator_with(host: &Host, log_name: &str, extra: &[&str]) -> GroupChild {
    GroupChild::spawn(
        &mut operator_command(host, extra),
        &host.dir.path().join(log_name),
    )
}

/// The command [`start_operator_with`] runs, for a test that sets more on it first.
pub fn operator_command(host: &Host, extra: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    command
        .current_dir(host.dir.path())
        .args(["standalone", "--manifests", "manifests"])
        .args(["--providers-config", "providers.yaml", "--state", "state"])
        .args(["--listen", &format!("127.0.0.1:{}", host.api_port)])
        .args(extra)
        .env("RUST_LOG", "info");
    command
}

/// The answer to one discovery API request, as a client that may be cut off sees it.
#[derive(Debug)]
pub enum Answer {
    /// Nothing listened: the request was never received.
    Refused,
    /// Sent, but no answer came (the operator died or hung): it may or may not have happened.
    Lost,
    /// Answered.
    Got(hyper::StatusCode, serde_json::Value),
}

/// One request to `host`'s discovery API with `token`, on a fresh connection, that never
/// panics on the server's death (within `timeout`).
pub async fn try_api(
    port: u16,
    token: &str,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Answer {
    let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return Answer::Refused;
    };
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .ok()?;
        tokio::spawn(conn);
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "127.0.0.1")
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("request");
        let response = sender.send_request(request).await.ok()?;
        let status = response.status();
        let bytes = response.into_body().collect().await.ok()?.to_bytes();
        Some((
            status,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        ))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Some((status, body))) => Answer::Got(status, body),
        _ => Answer::Lost,
    }
}

/// SIGTERM, as systemd or Ctrl-C would; asserts a clean exit.
pub fn stop(mut operator: GroupChild) {
    let status = operator
        .terminate(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("operator did not stop on SIGTERM:\n{}", operator.log()));
    assert!(
        status.success(),
        "operator exited with {status}:\n{}",
        operator.log()
    );
}

/// A Proxy manifest for the `local` provider on 127.0.0.1:`port`, with `attributes` and
/// `lease` settings (YAML `key: value` pairs), health-checked every 2 s through `health_url`.
pub fn manifest(
    name: &str,
    port: u16,
    health_url: &str,
    attributes: &[(&str, &str)],
    lease: &[(&str, u32)],
) -> String {
    let attributes: String = attributes
        .iter()
        .map(|(k, v)| format!("    {k}: {v}\n"))
        .collect();
    let lease: String = lease.iter().map(|(k, v)| format!("    {k}: {v}\n")).collect();
    format!(
        "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata:\n  name: {name}\nspec:\n  provider: local\n  placement:\n    address: 127.0.0.1\n  port: {port}\n  attributes:\n{attributes}  lease:\n{lease}  health:\n    url: {health_url}\n    intervalSeconds: 2\n    timeoutSeconds: 1\n    failureThreshold: 2\n"
    )
}

/// `manifest` with `auth.secretRef` naming the Secret `secret` (proxy credentials).
pub fn with_auth(manifest: &str, secret: &str) -> String {
    format!("{manifest}  auth:\n    secretRef:\n      name: {secret}\n")
}

/// A Secret manifest with proxy credentials.
pub fn credentials_secret(name: &str, username: &str, password: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\nstringData:\n  username: {username}\n  password: {password}\n"
    )
}

/// The audit trail of the Proxy `name` as the state folder keeps it (one JSON object per
/// transition, oldest first; empty before its first).
pub fn audit_lines(host: &Host, name: &str) -> Vec<serde_json::Value> {
    let suffix = format!("_{name}.jsonl");
    std::fs::read_dir(host.dir.path().join("state/audit"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().ends_with(&suffix))
        .flat_map(|entry| {
            std::fs::read_to_string(entry.path())
                .unwrap_or_default()
                .lines()
                .filter_map(|line| serde_json::from_str(line).ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `status`; panics if it fails.
pub fn status(host: &Host) -> String {
    try_status(host).expect("status succeeds")
}

/// `status`, or `None` while the operator has not created its state folder yet.
pub fn try_status(host: &Host) -> Option<String> {
    table_of(status_command(host).output().expect("status runs"))
}

/// `status --state state` in the host's folder.
pub fn status_command(host: &Host) -> Command {
    let mut command = Command::new(BIN);
    command
        .current_dir(host.dir.path())
        .args(["status", "--state", "state"]);
    command
}

/// The table a `status` run printed, if it succeeded.
fn table_of(output: std::process::Output) -> Option<String> {
    output
        .status
        .success()
        .then(|| String::from_utf8(output.stdout).expect("utf-8"))
}

/// Polls `status` until `done` holds for its table (90 s at most). Async, so the test's other
/// tasks (origins, clients) keep the runtime's workers while it waits.
pub async fn wait_status(host: &Host, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let output = tokio::process::Command::from(status_command(host)).output().await;
        let table = table_of(output.expect("status runs")).unwrap_or_default();
        if done(&table) {
            return table;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; status:\n{table}\n{}",
            trails_of_the_unhealthy(host, &table)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The audit trail (`status --audit`) of each proxy of `table` that is not healthy: why a wait
/// for health timed out.
fn trails_of_the_unhealthy(host: &Host, table: &str) -> String {
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let mut columns = row.split_whitespace();
            let (namespace, name, phase) = (columns.next()?, columns.next()?, columns.next()?);
            (phase != "healthy").then(|| format!("{namespace}/{name}"))
        })
        .map(|proxy| {
            let trail = status_command(host)
                .args(["--audit", &proxy])
                .output()
                .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
                .unwrap_or_else(|e| format!("status --audit failed: {e}"));
            format!("audit trail of {proxy}:\n{trail}")
        })
        .collect()
}

/// Rows of a `status` table whose phase is `healthy`.
pub fn healthy_rows(table: &str) -> usize {
    table
        .lines()
        .filter(|l| l.split_whitespace().nth(2) == Some("healthy"))
        .count()
}

/// The discovery API's `/metrics` (no token needed) once `done` holds for it.
pub async fn metrics_when(host: &Host, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", host.api_port))
            .await
            .expect("connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let request = Request::get("/metrics")
            .header("host", "127.0.0.1")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let response = sender.send_request(request).await.expect("response");
        let body = response.into_body().collect().await.expect("body").to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "metrics never showed {what}:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
