//! Logging and trace export set-up for the long-running subcommands (`run`, `standalone`).
//!
//! - Logs go to stderr, as text or (with `--json-logs`) one JSON object per line; `RUST_LOG`
//!   selects what is logged (default `info`).
//! - When `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, spans
//!   (and the events inside them) at INFO and above are also exported over OTLP/HTTP with
//!   protobuf bodies, whatever `RUST_LOG` says. Nothing of this is built when neither is set.
//!
//! The exporter runs on the SDK's batch thread; its requests go through [`ExportClient`], a
//! hyper client (rustls for `https://`) driven by a small runtime of its own, so exporting
//! needs no gRPC stack and does not depend on the operator's runtime still running at exit.
//! Export failures are logged by the SDK (target `opentelemetry_sdk`) and never stop the
//! operator.

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Request, Response};
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::{Resource, trace::SdkTracerProvider};
use tokio_rustls::rustls;
use tracing::Level;
use tracing_subscriber::{
    EnvFilter, Layer,
    filter::{LevelFilter, Targets},
    layer::SubscriberExt,
    util::SubscriberInitExt,
};

/// `service.name` when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` names one.
pub const DEFAULT_SERVICE_NAME: &str = "egress-proxies-operator";

/// Name of the tracer (the instrumentation scope of every exported span).
const TRACER_NAME: &str = "egress-proxies-operator";

/// Per-request deadline when `OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT` is unset (the spec's 10 s).
const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Collector responses are tiny; anything larger is not a collector.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// How long shutdown waits for the last batch to be sent.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why logging or trace export could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TracingError {
    /// The OTLP variables are inconsistent (e.g. an endpoint that is not a URL).
    #[error("OTLP trace exporter")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// The export client's runtime could not start.
    #[error("OTLP export client: {0}")]
    Client(std::io::Error),
    /// A global subscriber is already installed.
    #[error("installing the log subscriber")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// OTLP trace export settings, normally read from the standard `OTEL_*` variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpSettings {
    /// Full URL of the traces endpoint (`…/v1/traces`). `None`: the exporter resolves it from
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`.
    pub traces_endpoint: Option<String>,
    /// Deadline of one export request.
    pub timeout: Duration,
}

impl OtlpSettings {
    /// Export to this traces endpoint (tests; everything else comes from the environment).
    pub fn endpoint(traces_endpoint: impl Into<String>) -> Self {
        Self {
            traces_endpoint: Some(traces_endpoint.into()),
            timeout: DEFAULT_EXPORT_TIMEOUT,
        }
    }

    /// From the process environment; see [`OtlpSettings::from_vars`].
    pub fn from_env() -> Option<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// `None` (no export) unless an endpoint variable is set and non-empty; also `None` with
    /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`, as the spec asks.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let set = |name: &str| var(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
        {
            return None;
        }
        set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"))?;
        let timeout = set("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| set("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .and_then(|ms| ms.parse::<u64>().ok())
            .map_or(DEFAULT_EXPORT_TIMEOUT, Duration::from_millis);
        Some(Self {
            traces_endpoint: None,
            timeout,
        })
    }
}

/// The service resource: `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` as the SDK reads
/// them, with [`DEFAULT_SERVICE_NAME`] instead of the SDK's `unknown_service` fallback.
pub fn service_resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    let builder = Resource::builder().with_attribute(opentelemetry::KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION"),
    ));
    if named {
        builder.build()
    } else {
        builder.with_service_name(DEFAULT_SERVICE_NAME).build()
    }
}

/// A tracer provider exporting batches over OTLP/HTTP (protobuf). `OTEL_BSP_*` tune batching
/// and `OTEL_EXPORTER_OTLP[_TRACES]_HEADERS` add request headers (e.g. an API key).
pub fn otlp_tracer_provider(settings: &OtlpSettings) -> Result<SdkTracerProvider, TracingError> {
    let client = ExportClient::new(settings.timeout)?;
    let mut builder = SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_timeout(settings.timeout);
    if let Some(endpoint) = &settings.traces_endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let exporter = builder.build()?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(service_resource())
        .build())
}

/// The layer that turns `tracing` spans into OpenTelemetry spans of `provider`: INFO and above,
/// never the OpenTelemetry crates' own diagnostics (they would feed back into the exporter).
pub fn otel_layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + Send + Sync + 'static
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span> + Send + Sync,
{
    let filter = Targets::new()
        .with_default(Level::INFO)
        .with_target("opentelemetry", LevelFilter::OFF)
        .with_target("opentelemetry_sdk", LevelFilter::OFF)
        .with_target("opentelemetry_otlp", LevelFilter::OFF)
        .with_target("opentelemetry_http", LevelFilter::OFF);
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(TRACER_NAME))
        .with_filter(filter)
}

/// Installs the process-wide subscriber: stderr logs (text, or JSON lines with `json_logs`)
/// filtered by `RUST_LOG` (default `info`), plus OTLP export when [`OtlpSettings::from_env`]
/// finds an endpoint (an exporter that can't be built from the variables is logged and left
/// out). Keep the returned [`Telemetry`] until exit and shut it down then.
pub fn init(json_logs: bool) -> Result<Telemetry, TracingError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal, never in log files or container logs.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let fmt = if json_logs {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let settings = OtlpSettings::from_env();
    // A bad OTLP setting costs the traces, never the operator: it runs on without export.
    let (provider, unusable) = match settings.as_ref().map(otlp_tracer_provider) {
        Some(Ok(provider)) => (Some(provider), None),
        Some(Err(err)) => (None, Some(err)),
        None => (None, None),
    };
    let otel = provider.as_ref().map(otel_layer);
    tracing_subscriber::registry().with(fmt).with(otel).try_init()?;
    if let Some(err) = unusable {
        // The exporter's message may quote the endpoint, userinfo and all.
        let error = configured_endpoints()
            .iter()
            .fold(err.to_string(), |message, url| redact_userinfo(&message, url));
        tracing::error!(%error, "OTLP trace export is misconfigured; running without it");
    } else if settings.is_some() {
        let endpoint = configured_endpoints()
            .first()
            .map(|url| without_userinfo(url))
            .unwrap_or_default();
        tracing::info!(%endpoint, "exporting traces over OTLP/HTTP (protobuf)");
        // The exporter would note these before logging is up; say it where it is seen.
        let env = |name: &str| std::env::var(name).ok();
        let only_one_choice = [
            (
                [
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                    "OTEL_EXPORTER_OTLP_PROTOCOL",
                ],
                "http/protobuf",
                "only http/protobuf is supported; using it",
            ),
            (
                [
                    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
                    "OTEL_EXPORTER_OTLP_COMPRESSION",
                ],
                "none",
                "compression is not supported; sending uncompressed",
            ),
        ];
        for (names, supported, consequence) in only_one_choice {
            for (var, value) in unsupported_values(names, supported, env) {
                tracing::warn!(%var, %value, "{consequence}");
            }
        }
    }
    Ok(Telemetry { provider })
}

/// The endpoint variables that are set, the traces-specific one first.
fn configured_endpoints() -> Vec<String> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .filter_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
    .collect()
}

/// Those of the variables `names` that are set to something other than `supported`, with
/// their values, as `var` reads them.
fn unsupported_values(
    names: [&'static str; 2],
    supported: &str,
    var: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String)> {
    names
        .into_iter()
        .filter_map(|name| {
            var(name)
                .filter(|value| value != supported)
                .map(|value| (name, value))
        })
        .collect()
}

/// `message` with the userinfo of `url` (if it has one) replaced by `***`.
fn redact_userinfo(message: &str, url: &str) -> String {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = &authority[..authority.find('/').unwrap_or(authority.len())];
    match authority.rsplit_once('@') {
        Some((userinfo, _)) if !userinfo.is_empty() => message.replace(userinfo, "***"),
        _ => message.to_owned(),
    }
}

/// `url` for a log line: credentials in its userinfo part (`user:pass@`) are left out.
fn without_userinfo(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
            format!("{scheme}://{host}{path}")
        }
        None => url.rsplit_once('@').map_or(url, |(_, host)| host).to_owned(),
    }
}

/// Keeps trace export alive; [`Telemetry::shutdown`] (or Drop) sends the last spans.
#[must_use = "dropping it at once stops trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes the spans still queued and stops the exporter, waiting at most a few seconds
    /// (an unreachable collector must not hold up the exit). Failures are logged.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(err) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT)
        {
            tracing::warn!(error = %err, "the last spans may not have been exported");
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The OTLP/HTTP client: plain HTTP or rustls, one connection per export (batches are seconds
/// apart, and an idle pooled connection is not polled between them), driven by its own
/// current-thread runtime because the SDK exports from a plain thread.
pub struct ExportClient {
    runtime: Option<tokio::runtime::Runtime>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
}

impl fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ExportClient {
    /// A client whose requests (response body included) each end within `timeout`.
    pub fn new(timeout: Duration) -> Result<Self, TracingError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("otlp-export")
            .build()
            .map_err(TracingError::Client)?;
        let mut roots = rustls::RootCertStore::empty();
        let found = rustls_native_certs::load_native_certs();
        for error in &found.errors {
            tracing::warn!(%error, "reading platform trust roots for OTLP export");
        }
        roots.add_parsable_certificates(found.certs);
        let tls =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| TracingError::Client(std::io::Error::other(e)))?
                .with_root_certificates(roots)
                .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        Ok(Self {
            runtime: Some(runtime),
            client,
            timeout,
        })
    }

    async fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let response = self.client.request(request.map(Full::new)).await?;
        let (parts, body) = response.into_parts();
        let body = Limited::new(body, MAX_RESPONSE_BYTES).collect().await?.to_bytes();
        Ok(Response::from_parts(parts, body))
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        // The SDK's batch processor calls this from its own thread; blocking inside a Tokio
        // runtime instead would panic, so refuse rather than crash.
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err("the OTLP export client must not be called from an async runtime".into());
        }
        let runtime = self
            .runtime
            .as_ref()
            .ok_or("the OTLP export client is shut down")?;
        runtime.block_on(async {
            match tokio::time::timeout(self.timeout, self.send(request)).await {
                Ok(result) => result,
                Err(_elapsed) => Err(format!("no response within {:?}", self.timeout).into()),
            }
        })
    }
}

impl Drop for ExportClient {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which panics inside an async context; this never does.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Option<OtlpSettings> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        OtlpSettings::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn no_endpoint_means_no_export() {
        assert_eq!(settings(&[]), None);
        assert_eq!(settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "  ")]), None);
        assert_eq!(settings(&[("OTEL_SERVICE_NAME", "x")]), None);
    }

    #[test]
    fn either_endpoint_variable_turns_export_on() {
        let on = settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")]).expect("on");
        assert_eq!(on.traces_endpoint, None, "the exporter resolves the URL itself");
        assert_eq!(on.timeout, DEFAULT_EXPORT_TIMEOUT);
        assert!(settings(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")]).is_some());
    }

    #[test]
    fn disabled_sdk_or_no_traces_exporter_wins_over_an_endpoint() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        assert_eq!(settings(&[endpoint, ("OTEL_SDK_DISABLED", "TRUE")]), None);
        assert_eq!(settings(&[endpoint, ("OTEL_TRACES_EXPORTER", "none")]), None);
        assert!(settings(&[endpoint, ("OTEL_SDK_DISABLED", "false")]).is_some());
    }

    #[test]
    fn only_set_unsupported_protocol_and_compression_values_are_warned_about() {
        let vars = HashMap::from([
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "none"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
        ]);
        let var = |name: &str| vars.get(name).map(|v| (*v).to_owned());
        let names = [
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ];
        assert_eq!(
            unsupported_values(names, "none", var),
            [("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip".to_owned())]
        );
        let protocols = [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ];
        assert!(
            unsupported_values(protocols, "http/protobuf", var).is_empty(),
            "unset"
        );
    }

    #[test]
    fn logged_endpoints_leave_credentials_out() {
        assert_eq!(
            without_userinfo("https://user:secret@collector:4318/v1/traces"),
            "https://collector:4318/v1/traces"
        );
        assert_eq!(without_userinfo("http://collector:4318"), "http://collector:4318");
        assert_eq!(
            redact_userinfo(
                "invalid URI http://user:s3cret@coll ector:4318/v1/traces",
                "http://user:s3cret@coll ector:4318/v1/traces"
            ),
            "invalid URI http://***@coll ector:4318/v1/traces"
        );
        assert_eq!(
            redact_userinfo("no userinfo here", "http://c:4318/p@x"),
            "no userinfo here"
        );
        assert_eq!(without_userinfo("http://c/p@x"), "http://c/p@x");
    }

    #[test]
    fn the_traces_timeout_overrides_the_general_one() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        let general = settings(&[endpoint, ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")]).expect("on");
        assert_eq!(general.timeout, Duration::from_millis(2500));
        let specific = settings(&[
            endpoint,
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700"),
        ])
        .expect("on");
        assert_eq!(specific.timeout, Duration::from_millis(700));
        let garbage = settings(&[endpoint, ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")]).expect("on");
        assert_eq!(garbage.timeout, DEFAULT_EXPORT_TIMEOUT);
    }
}
