//! Tracing as an operator sees it, with a loopback OTLP/HTTP collector. Standalone mode runs
//! the real binary: one `reconcile` span per reconcile naming the Proxy arrives over OTLP
//! (protobuf) while the operator runs, the last spans are flushed on SIGTERM, an unreachable
//! collector is logged and does not stop the operator, `--json-logs` writes one JSON object per
//! line carrying the span's fields, and a canary secret (cloud-init content, proxy password)
//! reaches neither the exported spans nor the logs. Cluster mode runs the controller in
//! process against a real kube-apiserver with the library's exporter set-up.

#[allow(dead_code)] // Each test binary uses a different part of the support code.
mod support {
    pub mod control_plane;
    pub mod controller;
    pub mod origin;
    pub mod otlp;
    pub mod ports;
    pub mod process;
    pub mod scripted;
}

use std::{
    path::Path,
    process::{Command, ExitStatus},
    sync::Arc,
    time::{Duration, Instant},
};

use egress_proxies_operator::{
    api::Proxy,
    health::Verdict,
    provider::{ProviderRegistry, memory::MemoryProvider},
    telemetry::tracing_setup::{OtlpSettings, otel_layer, otlp_tracer_provider},
};
use kube::{Api, api::PostParams};
use support::{
    control_plane::ControlPlane,
    controller::ControllerSetup,
    origin::OriginServer,
    otlp::Collector,
    process::GroupChild,
    scripted::{ScriptedHealth, ScriptedLeases, key},
};
use tracing_subscriber::layer::SubscriberExt;

const BIN: &str = env!("CARGO_BIN_EXE_egress-proxies-operator");
const CANARY: &str = "canary-5d1e08b4-do-not-export";

/// A folder to run the operator in; kills every Squid started from it on Drop.
struct Workdir(tempfile::TempDir);

impl Workdir {
    fn new(providers: &str, manifests: &str) -> Workdir {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("manifests")).expect("mkdir");
        std::fs::write(dir.path().join("providers.yaml"), providers).expect("providers");
        std::fs::write(dir.path().join("manifests/proxies.yaml"), manifests).expect("manifests");
        Workdir(dir)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    /// The `status` table, empty while the state folder does not exist yet.
    fn status(&self) -> String {
        let output = Command::new(BIN)
            .current_dir(self.path())
            .args(["status", "--state", "state"])
            .output()
            .expect("status runs");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        for pid in support::process::squids(self.path()) {
            support::process::kill_squid(pid);
        }
    }
}

/// The operator in standalone mode, in its own process group (killed on Drop). Its output is
/// all log lines: standalone mode writes nothing to stdout.
struct Operator(GroupChild);

impl Operator {
    fn start(dir: &Workdir, extra_args: &[&str], env: &[(&str, String)]) -> Operator {
        let mut command = Command::new(BIN);
        command
            .current_dir(dir.path())
            .args(["standalone", "--manifests", "manifests", "--providers-config"])
            .args(["providers.yaml", "--state", "state", "--listen", "127.0.0.1:0"])
            .args(extra_args)
            .env("RUST_LOG", "info");
        for var in [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_SERVICE_NAME",
            "OTEL_RESOURCE_ATTRIBUTES",
            "OTEL_SDK_DISABLED",
            "OTEL_TRACES_EXPORTER",
            "OTEL_BSP_SCHEDULE_DELAY",
        ] {
            command.env_remove(var);
        }
        for (name, value) in env {
            command.env(name, value);
        }
        Operator(GroupChild::spawn(&mut command, &dir.path().join("operator.log")))
    }

    fn log(&self) -> String {
        self.0.log()
    }

    /// SIGTERM and wait for the exit (graceful shutdown flushes the last spans). Waits without
    /// blocking the runtime: the collector answers the final export from this test's runtime.
    async fn stop(mut self) -> ExitStatus {
        match self.0.terminate_async(Duration::from_secs(20)).await {
            Some(status) => status,
            None => panic!("operator did not stop on SIGTERM:\n{}", self.log()),
        }
    }
}

/// A port that was free a moment ago (bound to 0 and released).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("bound address").port()
}

/// Polls `done` every 100 ms for up to `within`.
async fn wait_for(
    within: Duration,
    what: &str,
    mut done: impl FnMut() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\n{}",
            context()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const LOCAL_PROVIDER: &str =
    "providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: local\n";

/// A Proxy `crawl/traced` on the local provider whose cloud-init content and proxy password
/// both hold the canary.
fn secretive_proxy(port: u16, health_url: &str) -> String {
    format!(
        r##"apiVersion: v1
kind: Secret
metadata:
  name: init
  namespace: crawl
  labels:
    crawl.example.com/cloud-init: "true"
stringData:
  user-data: "#cloud-config\npassword: {CANARY}\n"
---
apiVersion: v1
kind: Secret
metadata:
  name: creds
  namespace: crawl
stringData:
  username: crawler
  password: {CANARY}
---
apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: traced
  namespace: crawl
spec:
  provider: local
  placement:
    address: 127.0.0.1
  port: {port}
  cloudInit:
    secretRef:
      name: init
  auth:
    secretRef:
      name: creds
  health:
    url: {health_url}
    intervalSeconds: 2
    timeoutSeconds: 1
    failureThreshold: 2
"##
    )
}

/// A Proxy naming a provider that is not configured: reconciled (and traced) without any Squid.
fn unprovidable_proxy(name: &str) -> String {
    format!(
        "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata:\n  name: {name}\n  namespace: edge\nspec:\n  provider: nowhere\n"
    )
}

fn reconcile_spans_of<'a>(
    spans: &'a [support::otlp::Span],
    namespace: &str,
    name: &str,
) -> Vec<&'a support::otlp::Span> {
    spans
        .iter()
        .filter(|s| {
            s.name == "reconcile"
                && s.attributes.get("proxy.namespace").map(String::as_str) == Some(namespace)
                && s.attributes.get("proxy.name").map(String::as_str) == Some(name)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_spans_reach_an_otlp_collector_and_json_logs_carry_them_without_secrets() {
    let collector = Collector::start().await;
    let origin = OriginServer::start().await;
    let dir = Workdir::new(
        LOCAL_PROVIDER,
        &secretive_proxy(free_port(), &origin.url("/health")),
    );
    let operator = Operator::start(
        &dir,
        &["--json-logs"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200".to_owned()),
        ],
    );

    // Exported while running: the reconcile that found the proxy healthy.
    wait_for(
        Duration::from_secs(90),
        "a reconcile span of crawl/traced in phase healthy",
        || {
            reconcile_spans_of(&collector.spans(), "crawl", "traced")
                .iter()
                .any(|s| s.attributes.get("proxy.phase").map(String::as_str) == Some("healthy"))
        },
        || format!("status:\n{}\nlog:\n{}", dir.status(), operator.log()),
    )
    .await;
    let log = operator.log();
    let status = operator.stop().await;
    assert!(status.success(), "operator exited with {status}:\n{log}");

    let received = collector.received();
    for request in &received {
        assert_eq!(request.path, "/v1/traces");
        assert_eq!(request.content_type, "application/x-protobuf");
        assert!(
            !request.request.resource_spans.is_empty(),
            "every request decodes as OTLP protobuf"
        );
        assert!(
            !request.raw.windows(CANARY.len()).any(|w| w == CANARY.as_bytes()),
            "the canary leaked into an export request"
        );
    }
    let spans = collector.spans();
    let reconciles = reconcile_spans_of(&spans, "crawl", "traced");
    assert!(reconciles.len() >= 2, "one span per reconcile: {reconciles:#?}");
    for span in &reconciles {
        assert_eq!(
            span.resource.get("service.name").map(String::as_str),
            Some("egress-proxies-operator")
        );
        assert_eq!(span.scope, "egress-proxies-operator");
    }
    assert!(
        reconciles.iter().all(|s| s.status_code != 2),
        "no reconcile failed: {reconciles:#?}"
    );
    // Events logged inside a reconcile travel with its span.
    assert!(
        reconciles
            .iter()
            .any(|s| s.events.iter().any(|(name, attributes)| name == "transition"
                && attributes.get("transition").map(String::as_str)
                    == Some("provisioning --health_passed--> healthy"))),
        "the transition to healthy is an event of a reconcile span: {reconciles:#?}"
    );
    let ids: std::collections::HashSet<_> = reconciles.iter().map(|s| s.span_id.clone()).collect();
    assert_eq!(ids.len(), reconciles.len(), "each reconcile is its own span");

    // --json-logs: the log is one JSON object per line, and the lines logged inside a reconcile
    // carry the span with the proxy's namespace and name.
    let mut in_reconcile = 0;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let object: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(object.is_object(), "not an object: {line}");
        let span = &object["span"];
        if span["name"] == "reconcile" {
            assert_eq!(span["proxy.namespace"], "crawl", "{line}");
            assert_eq!(span["proxy.name"], "traced", "{line}");
            in_reconcile += 1;
        }
    }
    assert!(in_reconcile > 0, "no log line inside a reconcile span:\n{log}");
    assert!(!log.contains(CANARY), "the canary leaked into the logs");
}

#[tokio::test]
async fn the_last_spans_are_flushed_on_sigterm() {
    let collector = Collector::start().await;
    let dir = Workdir::new(LOCAL_PROVIDER, &unprovidable_proxy("lonely"));
    // Batches would wait ten minutes: whatever arrives was sent by the shutdown flush.
    let operator = Operator::start(
        &dir,
        &[],
        &[
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                format!("{}/v1/traces", collector.endpoint()),
            ),
            ("OTEL_BSP_SCHEDULE_DELAY", "600000".to_owned()),
            ("OTEL_SERVICE_NAME", "edge-operator".to_owned()),
        ],
    );
    wait_for(
        Duration::from_secs(30),
        "edge/lonely reconciled",
        || dir.status().contains("lonely"),
        || operator.log(),
    )
    .await;
    let log = operator.log();
    let status = operator.stop().await;
    assert!(status.success(), "operator exited with {status}:\n{log}");

    let spans = collector.spans();
    let reconciles = reconcile_spans_of(&spans, "edge", "lonely");
    assert!(
        !reconciles.is_empty(),
        "no reconcile span was flushed: {spans:#?}"
    );
    assert_eq!(
        reconciles[0].resource.get("service.name").map(String::as_str),
        Some("edge-operator"),
        "OTEL_SERVICE_NAME names the service"
    );
}

#[tokio::test]
async fn an_unreachable_collector_is_logged_and_the_operator_carries_on() {
    let dir = Workdir::new(LOCAL_PROVIDER, &unprovidable_proxy("first"));
    // Nothing listens there (bound a moment ago and released).
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let operator = Operator::start(
        &dir,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "500".to_owned()),
        ],
    );
    wait_for(
        Duration::from_secs(30),
        "a logged export failure",
        || operator.log().contains("BatchSpanProcessor.ExportError"),
        || operator.log(),
    )
    .await;
    // Still reconciling after the failures: a new manifest is picked up.
    std::fs::write(
        dir.path().join("manifests/second.yaml"),
        unprovidable_proxy("second"),
    )
    .expect("write");
    wait_for(
        Duration::from_secs(30),
        "edge/second reconciled",
        || dir.status().contains("second"),
        || operator.log(),
    )
    .await;
    let log = operator.log();
    let status = operator.stop().await;
    assert!(status.success(), "operator exited with {status}:\n{log}");
}

#[tokio::test]
async fn a_misconfigured_exporter_is_logged_and_the_operator_runs_without_it() {
    let dir = Workdir::new(LOCAL_PROVIDER, &unprovidable_proxy("plain"));
    let operator = Operator::start(
        &dir,
        &[],
        &[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://collector:canary-otlp-password@no such host:4318".to_owned(),
        )],
    );
    wait_for(
        Duration::from_secs(30),
        "edge/plain reconciled",
        || dir.status().contains("plain"),
        || operator.log(),
    )
    .await;
    let log = operator.log();
    let status = operator.stop().await;
    assert!(status.success(), "operator exited with {status}:\n{log}");
    assert!(log.contains("OTLP trace export is misconfigured"), "{log}");
    assert!(!log.contains("exporting traces"), "{log}");
    assert!(
        !log.contains("canary-otlp-password"),
        "the endpoint's password reached the log:\n{log}"
    );
}

#[tokio::test]
async fn without_an_endpoint_no_exporter_is_built() {
    let dir = Workdir::new(LOCAL_PROVIDER, &unprovidable_proxy("quiet"));
    // Only the service name is set: no endpoint, so no exporter.
    let operator = Operator::start(&dir, &[], &[("OTEL_SERVICE_NAME", "quiet".to_owned())]);
    wait_for(
        Duration::from_secs(30),
        "edge/quiet reconciled",
        || dir.status().contains("quiet"),
        || operator.log(),
    )
    .await;
    let log = operator.log();
    let status = operator.stop().await;
    assert!(status.success(), "operator exited with {status}:\n{log}");
    assert!(!log.contains("exporting traces"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_mode_reconciles_are_spans_under_the_controllers_own() {
    let collector = Collector::start().await;
    let provider = otlp_tracer_provider(&OtlpSettings::endpoint(format!(
        "{}/v1/traces",
        collector.endpoint()
    )))
    .expect("exporter");
    // The controller's tasks run on every worker thread: the subscriber must be global (each
    // test runs in its own process under nextest; no other test here installs one).
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(otel_layer(&provider)))
        .expect("the only subscriber of this process");

    let (_plane, client) = ControlPlane::with_crds(&["crawl"]).await;
    let mut providers = ProviderRegistry::new();
    providers.insert(Arc::new(MemoryProvider::new("mem")));
    let health = ScriptedHealth::new();
    health.set(&key("crawl", "spanned"), Verdict::Passing);
    let mut setup = ControllerSetup::new(client.clone(), providers, ScriptedLeases::new(), health.clone());
    setup.deps.identity = "tracing-test".into();
    let controller = setup.start().await;

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": "spanned", "namespace": "crawl"},
        "spec": {"provider": "mem"},
    }))
    .expect("proxy");
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("create");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let phase = proxies.get("spanned").await.ok().and_then(|p| p.status?.phase);
        if phase.as_deref() == Some("healthy") {
            break;
        }
        assert!(Instant::now() < deadline, "no Healthy; phase {phase:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    controller.stop().await;
    // Flushing blocks until the collector (on this runtime) has answered.
    let flushed = tokio::task::spawn_blocking(move || provider.force_flush())
        .await
        .expect("flush task");
    assert!(flushed.is_ok(), "{flushed:?}");

    let spans = collector.spans();
    let reconciles = reconcile_spans_of(&spans, "crawl", "spanned");
    assert!(
        reconciles
            .iter()
            .any(|s| s.attributes.get("proxy.phase").map(String::as_str) == Some("healthy")),
        "{reconciles:#?}"
    );
    // kube-runtime wraps each reconcile in its own span; ours is its child.
    for span in &reconciles {
        let parent = spans
            .iter()
            .find(|p| p.span_id == span.parent_span_id)
            .unwrap_or_else(|| panic!("the parent of {span:?} was exported too"));
        assert_eq!(parent.name, "reconciling object");
    }
}
