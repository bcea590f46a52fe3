//! The discovery HTTP API (hyper, HTTP/1.1 keep-alive): crawlers list proxies and acquire,
//! renew and release leases; `/healthz`, `/readyz` and `/metrics` serve operations.
//! Documented, with examples that a test runs, in `docs/api.md`.
//!
//! It owns the wire format (JSON in and out, stable error codes), authentication and the
//! request metrics; every lease decision is the [`LeaseStore`]'s. [`handle`] is the whole
//! router as a function of a request (testable without a socket); [`serve`] runs it on a
//! listener until a shutdown future completes, then lets open requests finish.
//!
//! Only the leader serves leases: until [`Readiness`] says synced and leader, `/readyz` answers
//! 503 and lease endpoints answer 503 `not_ready` / `not_leader` (with `Retry-After`).

pub mod auth;
mod http_errors;
mod metrics;
pub mod openapi;
mod wire;

#[cfg(test)]
mod tests;

use std::{
    convert::Infallible,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{
    Method, Request, Response, StatusCode,
    body::Body,
    header::{self, HeaderValue},
};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::watch};

pub use auth::{
    AnyOf, AuthError, Authenticator, Identity, NoAuthentication, ReloadingTokens, StaticTokens, TokenFile,
    TokenReviewAuthenticator, TokenSecret,
};
pub use metrics::DiscoveryMetrics;
pub use wire::{
    AcquireBody, AcquireResponse, ERROR_CODES, ErrorBody, ErrorDetail, ListResponse, ProxyJson, ReleaseBody,
    ReleaseResponse, RenewBody, RenewResponse, StatusBody,
};

use crate::lease::{
    AcquireRequest, LeaseError, LeaseStore, Outcome, Selector,
    checkpoint::BanCheckpoint,
    journal::{Journal, JournalError, Record},
    rfc3339,
    token::{LeaseSigner, MAX_ID_LEN},
};
use metrics::{CodeLabels, ResultLabels};

/// Whether this replica may serve leases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    /// Caches synced and proxies loaded into the store.
    pub synced: bool,
    /// Holds leadership (always true in standalone mode).
    pub leader: bool,
}

/// Limits and defaults of the API.
#[derive(Clone, Debug)]
pub struct DiscoveryConfig {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// TTL of a lease whose request names none.
    pub default_ttl: Duration,
    /// How long a graceful shutdown waits for open requests.
    pub shutdown_grace: Duration,
    /// How long a client may take to send request headers.
    pub header_timeout: Duration,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 * 1024,
            default_ttl: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            header_timeout: Duration::from_secs(30),
        }
    }
}

struct StateInner {
    store: LeaseStore,
    signer: LeaseSigner,
    auth: Arc<dyn Authenticator>,
    readiness: watch::Receiver<Readiness>,
    registry: Arc<Registry>,
    metrics: DiscoveryMetrics,
    config: DiscoveryConfig,
    ui: std::sync::OnceLock<Arc<crate::ui::StatusPage>>,
    journal: std::sync::OnceLock<Journal>,
}

/// What the API serves from; cheap to clone.
#[derive(Clone)]
pub struct DiscoveryState {
    inner: Arc<StateInner>,
}

impl DiscoveryState {
    /// `metrics` must have been registered in `registry` (with [`DiscoveryMetrics::register`])
    /// before it was frozen in an `Arc`.
    pub fn new(
        store: LeaseStore,
        signer: LeaseSigner,
        auth: Arc<dyn Authenticator>,
        readiness: watch::Receiver<Readiness>,
        registry: Arc<Registry>,
        metrics: DiscoveryMetrics,
        config: DiscoveryConfig,
    ) -> Self {
        // Metrics built for another state keep reading that state's store.
        let _ = metrics.active.0.set(store.clone());
        Self {
            inner: Arc::new(StateInner {
                store,
                signer,
                auth,
                readiness,
                registry,
                metrics,
                config,
                ui: std::sync::OnceLock::new(),
                journal: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Serves the status page at `GET /ui` (standalone mode; once).
    pub fn set_status_page(&self, page: Arc<crate::ui::StatusPage>) {
        let _ = self.inner.ui.set(page);
    }

    /// Makes acquires, renewals and releases durable before they are answered (standalone
    /// mode; once): each handler appends what changed to `journal` and awaits its commit.
    pub fn set_journal(&self, journal: Journal) {
        let _ = self.inner.journal.set(journal);
    }

    /// The lease store behind the API.
    pub fn store(&self) -> &LeaseStore {
        &self.inner.store
    }
}

/// Serves the API on `listener` until `shutdown` completes; then stops accepting and waits up
/// to [`DiscoveryConfig::shutdown_grace`] for open connections to finish their requests.
pub async fn serve(
    listener: TcpListener,
    state: DiscoveryState,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(state.inner.config.header_timeout)
        .keep_alive(true);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(error) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(%error, "accepting a discovery connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let requests = state.inner.metrics.requests.clone();
                let state = state.clone();
                let service = hyper::service::service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(&state, req).await) }
                });
                let io = http_errors::JsonErrors::new(TokioIo::new(stream), move |status| {
                    let code = http_errors::code_for(status).0;
                    requests.get_or_create(&ResultLabels { route: "other", code }).inc();
                });
                let conn = graceful.watch(builder.serve_connection(io, service));
                tokio::spawn(async move {
                    if let Err(error) = conn.await {
                        tracing::debug!(%error, "discovery connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(state.inner.config.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("discovery connections still open after the shutdown grace period");
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route<'a> {
    Healthz,
    Readyz,
    Metrics,
    OpenApi,
    Ui,
    List,
    Acquire,
    Renew(&'a str),
    Release(&'a str),
}

/// The route index of requests no route takes (`metrics::ROUTES`).
const OTHER_ROUTE: usize = 8;

impl Route<'_> {
    /// Its index in `metrics::ROUTES` (its metric label).
    fn index(self) -> usize {
        match self {
            Route::Healthz => 0,
            Route::Readyz => 1,
            Route::Metrics => 2,
            Route::OpenApi => 3,
            Route::List => 4,
            Route::Acquire => 5,
            Route::Renew(_) => 6,
            Route::Release(_) => 7,
            Route::Ui => 9,
        }
    }
}

/// The API's answer to anything that went wrong: status, stable code, message.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<Duration>,
    allow: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
            allow: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "malformed_request", message)
    }

    fn retry(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
            },
        };
        let mut response = json(self.status, &body);
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(allow) = self.allow {
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}

impl From<LeaseError> for ApiError {
    fn from(e: LeaseError) -> Self {
        let status = match &e {
            LeaseError::NotFound | LeaseError::UnknownProxy(_) => StatusCode::NOT_FOUND,
            LeaseError::StaleToken { .. } | LeaseError::Draining => StatusCode::CONFLICT,
            LeaseError::NoProxyAvailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            LeaseError::BanNeedsDomain | LeaseError::Invalid(_) => StatusCode::BAD_REQUEST,
        };
        let retry = match &e {
            LeaseError::NoProxyAvailable { retry_after } => Some(*retry_after),
            _ => None,
        };
        let mut err = ApiError::new(status, e.code(), e.to_string());
        err.retry_after = retry;
        err
    }
}

fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    // Most answers (an acquire's is the largest common one) fit without regrowing.
    let mut bytes = Vec::with_capacity(512);
    serde_json::to_writer(&mut bytes, body).expect("API responses are plain data and always serialize");
    json_bytes(status, bytes)
}

/// A JSON answer from its bytes.
fn json_bytes(status: StatusCode, bytes: Vec<u8>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn route<'a>(method: &Method, path: &'a str) -> Result<Route<'a>, ApiError> {
    let only = |allowed: &'static str, want: &Method, r: Route<'a>| {
        if method == want {
            Ok(r)
        } else {
            let mut e = ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("use {allowed} on this path"),
            );
            e.allow = Some(allowed);
            Err(e)
        }
    };
    match path {
        "/healthz" => only("GET", &Method::GET, Route::Healthz),
        "/readyz" => only("GET", &Method::GET, Route::Readyz),
        "/metrics" => only("GET", &Method::GET, Route::Metrics),
        "/v1/openapi.json" => only("GET", &Method::GET, Route::OpenApi),
        "/ui" => only("GET", &Method::GET, Route::Ui),
        "/v1/proxies" => only("GET", &Method::GET, Route::List),
        "/v1/leases" => only("POST", &Method::POST, Route::Acquire),
        _ => {
            let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint");
            let rest = path.strip_prefix("/v1/leases/").ok_or_else(not_found)?;
            let (id, action) = rest.split_once('/').ok_or_else(not_found)?;
            // No early exit, so the check vectorizes (IDs are a few hundred bytes).
            let base64url = id.bytes().fold(true, |ok, b| {
                ok & (b.is_ascii_alphanumeric() | (b == b'-') | (b == b'_'))
            });
            if id.is_empty() || id.len() > MAX_ID_LEN || !base64url {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "lease_not_found",
                    "lease not found (malformed lease ID)",
                ));
            }
            match action {
                "renew" => only("POST", &Method::POST, Route::Renew(id)),
                "release" => only("POST", &Method::POST, Route::Release(id)),
                _ => Err(not_found()),
            }
        }
    }
}

/// Answers one request: the whole API as a function.
pub async fn handle<B>(state: &DiscoveryState, request: Request<B>) -> Response<Full<Bytes>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let (index, result) = match route(&parts.method, parts.uri.path()) {
        Ok(r) => (r.index(), dispatch(state, r, &parts, body).await),
        Err(e) => (OTHER_ROUTE, Err(e)),
    };
    let (code, response) = match result {
        Ok(response) => ("ok", response),
        Err(e) => (e.code, e.into_response()),
    };
    state
        .inner
        .metrics
        .record(index, code, started.elapsed().as_secs_f64());
    response
}

async fn dispatch<B>(
    state: &DiscoveryState,
    route: Route<'_>,
    parts: &hyper::http::request::Parts,
    body: B,
) -> Result<Response<Full<Bytes>>, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let s = &state.inner;
    match route {
        Route::Healthz => return Ok(healthz()),
        Route::Readyz => return readyz(s),
        Route::Metrics => return metrics(s),
        Route::OpenApi => return Ok(openapi_json()),
        // The page authenticates itself (a browser sends Basic credentials).
        Route::Ui => {
            let page =
                s.ui.get()
                    .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint"))?;
            return Ok(page.respond(&parts.headers).await);
        }
        _ => {}
    }
    let identity = authenticate(s, parts).await?;
    check_ready(s)?;
    if !matches!(route, Route::List) {
        check_journal(s)?;
    }
    // One instant per request: every store decision and every time in the answer is about it.
    match route {
        Route::List => list(s, parts, s.store.now_ms()),
        Route::Acquire => {
            let req: AcquireBody = read_json(s, parts, body).await?;
            acquire(s, &identity, req, s.store.now_ms()).await
        }
        Route::Renew(id) => {
            let req: RenewBody = read_json(s, parts, body).await?;
            renew(s, id, req, s.store.now_ms()).await
        }
        Route::Release(id) => {
            let req: ReleaseBody = read_json(s, parts, body).await?;
            release(s, id, req, s.store.now_ms()).await
        }
        Route::Healthz | Route::Readyz | Route::Metrics | Route::OpenApi | Route::Ui => {
            unreachable!("answered above")
        }
    }
}

/// Liveness.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process serves HTTP", body = StatusBody)),
)]
fn healthz() -> Response<Full<Bytes>> {
    json(StatusCode::OK, &StatusBody { status: "ok" })
}

/// Readiness: caches synced and this replica leads.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready to serve leases", body = StatusBody),
        (status = 503, description = "`not_ready`, `not_leader` or `journal_unavailable` (standalone: \
            the lease journal cannot sync)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait: 1"))),
    ),
)]
fn readyz(s: &StateInner) -> Result<Response<Full<Bytes>>, ApiError> {
    check_ready(s)?;
    check_journal(s)?;
    Ok(json(StatusCode::OK, &StatusBody { status: "ready" }))
}

/// Prometheus/OpenMetrics text of the discovery and controller metrics.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses(
        (status = 200, description = "OpenMetrics text", body = String,
            content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"),
        (status = 500, description = "`internal`: the metrics could not be encoded (a bug)", body = ErrorBody),
    ),
)]
fn metrics(s: &StateInner) -> Result<Response<Full<Bytes>>, ApiError> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &s.registry)
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "encoding metrics"))?;
    let mut response = Response::new(Full::new(Bytes::from(text)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    Ok(response)
}

/// This contract (OpenAPI 3.1). Needs no token.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI document", body = Object)),
)]
fn openapi_json() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(openapi::served()));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn check_ready(s: &StateInner) -> Result<(), ApiError> {
    let r = *s.readiness.borrow();
    if !r.leader {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_leader",
            "this replica is not the leader; retry (the Service routes to the leader once it is ready)",
        )
        .retry(Duration::from_secs(1)));
    }
    if !r.synced {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "caches are not synced yet",
        )
        .retry(Duration::from_secs(1)));
    }
    Ok(())
}

/// Refuses lease operations while the journal cannot make them durable.
fn check_journal(s: &StateInner) -> Result<(), ApiError> {
    match s.journal.get().and_then(Journal::failing) {
        Some(why) => Err(journal_unavailable(&JournalError::Failing(why))),
        None => Ok(()),
    }
}

fn journal_unavailable(error: &JournalError) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "journal_unavailable",
        format!("the lease operation could not be made durable: {error}"),
    )
    .retry(Duration::from_secs(1))
}

/// Appends `record` to the journal, if any, and waits until it is durable.
async fn commit(s: &StateInner, record: impl FnOnce() -> Record) -> Result<(), ApiError> {
    match s.journal.get() {
        Some(journal) => journal
            .append(&record())
            .wait()
            .await
            .map_err(|e| journal_unavailable(&e)),
        None => Ok(()),
    }
}

async fn authenticate(s: &StateInner, parts: &hyper::http::request::Parts) -> Result<Identity, ApiError> {
    if let Some(anonymous) = s.auth.anonymous() {
        return Ok(anonymous);
    }
    let unauthenticated = |msg: &str| {
        let mut e = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", msg);
        e.allow = None;
        e
    };
    let value = parts
        .headers
        .get(header::AUTHORIZATION)
        .ok_or_else(|| unauthenticated("missing Authorization: Bearer token"))?;
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| unauthenticated("Authorization must be: Bearer <token>"))?;
    s.auth.authenticate(token).await.map_err(|e| match e {
        AuthError::Unauthenticated => unauthenticated("invalid bearer token"),
        AuthError::Forbidden(_) => ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string()),
        AuthError::Unavailable(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "auth_unavailable", e.to_string())
                .retry(Duration::from_secs(1))
        }
    })
}

async fn read_json<T, B>(s: &StateInner, parts: &hyper::http::request::Parts, body: B) -> Result<T, ApiError>
where
    T: serde::de::DeserializeOwned,
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limit = s.config.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request bodies are limited to {limit} bytes"),
        )
    };
    if let Some(len) = parts.headers.get(header::CONTENT_LENGTH)
        && len
            .to_str()
            .ok()
            .and_then(|l| l.parse::<u64>().ok())
            .is_some_and(|l| l > limit as u64)
    {
        return Err(too_large());
    }
    let bytes = match Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => return Err(too_large()),
        Err(e) => return Err(ApiError::bad_request(format!("reading the request body: {e}"))),
    };
    // The plain parser for the common, valid body; the path-tracking one only to say where a
    // malformed body went wrong (it costs about as much as the parse itself).
    if let Ok(value) = serde_json::from_slice(&bytes) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad_request(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::bad_request(format!("invalid JSON body at {path}: {inner}"))
        }
    })?;
    // Trailing bytes after the object are as malformed as a broken object.
    de.end()
        .map_err(|_| ApiError::bad_request("invalid JSON body: trailing characters after the object"))?;
    Ok(value)
}

/// Lists the proxies whose attributes match every term of the selector, sorted by key.
#[utoipa::path(
    get,
    path = "/v1/proxies",
    tag = "leases",
    params(("selector" = Option<String>, Query,
        description = "`key=value[,key=value...]`, at most 32 terms and 2048 bytes; absent: every proxy")),
    responses(
        (status = 200, description = "The matching proxies and how each stands", body = ListResponse),
        (status = 400, description = "`malformed_request`: bad selector or unknown query parameter", body = ErrorBody),
        (status = 401, description = "`unauthorized`", body = ErrorBody),
        (status = 403, description = "`forbidden`", body = ErrorBody),
        (status = 503, description = "`not_ready`, `not_leader` or `auth_unavailable`", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ),
    security(("bearer" = [])),
)]
fn list(
    s: &StateInner,
    parts: &hyper::http::request::Parts,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let mut selector = Selector::default();
    for (k, v) in form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes()) {
        match &*k {
            "selector" => selector = Selector::parse(&v).map_err(|e| ApiError::bad_request(e.to_string()))?,
            other => {
                return Err(ApiError::bad_request(format!(
                    "unknown query parameter {other:?}"
                )));
            }
        }
    }
    let compiled = s.store.compile(&selector);
    let views = s.store.list_at(&compiled, now);
    let proxies = views.iter().map(ProxyJson::from_view).collect();
    Ok(json(StatusCode::OK, &ListResponse { proxies }))
}

/// Acquires a lease on the least recently used eligible proxy (or the session's).
#[utoipa::path(
    post,
    path = "/v1/leases",
    tag = "leases",
    request_body(content = AcquireBody, content_type = "application/json"),
    responses(
        (status = 201, description = "The lease", body = AcquireResponse),
        (status = 400, description = "`malformed_request`", body = ErrorBody),
        (status = 401, description = "`unauthorized`", body = ErrorBody),
        (status = 403, description = "`forbidden`", body = ErrorBody),
        (status = 413, description = "`payload_too_large`: body over 16 KiB", body = ErrorBody),
        (status = 503, description = "`no_proxy_available` (nothing eligible now), `not_ready`, `not_leader`, \
            `auth_unavailable` or `journal_unavailable` (the lease could not be made durable)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds until trying again may succeed: 1 to 60"))),
    ),
    security(("bearer" = [])),
)]
async fn acquire(
    s: &StateInner,
    identity: &Identity,
    req: AcquireBody,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    req.validate().map_err(ApiError::bad_request)?;
    let selector = Selector::from_map(&req.selector);
    let compiled = s.store.compile(&selector);
    let ttl = req.ttl_seconds.map_or(s.config.default_ttl, Duration::from_secs);
    let request = AcquireRequest {
        selector: &compiled,
        holder: &req.holder,
        ttl,
        target_domain: req.target_domain.as_deref(),
        session_key: req.session_key.as_deref(),
    };
    let lease = match s.store.acquire_at(&request, now) {
        Ok(lease) => lease,
        Err(e) => {
            s.metrics
                .refused
                .get_or_create(&CodeLabels { code: e.code() })
                .inc();
            return Err(e.into());
        }
    };
    s.metrics.acquired.inc();
    tracing::debug!(proxy = %lease.id.key, holder = %req.holder, caller = %identity.name, "lease granted");
    let claim = lease.claim(
        &req.holder,
        req.target_domain.as_deref(),
        req.session_key.as_deref(),
    );
    if let Err(error) = commit(s, || {
        Record::acquired(&lease, &claim, s.store.config().session_idle_ttl)
    })
    .await
    {
        // Not durable, so not granted: free the slot (nobody was told its token).
        let _ = s
            .store
            .release_at(&lease.id, lease.fencing_token, Outcome::Error, None, now);
        return Err(error);
    }
    let lease_id = s.signer.sign(&claim);
    let body = AcquireResponse {
        lease_id,
        fencing_token: lease.fencing_token,
        proxy_url: lease.proxy.url_with_credentials(),
        proxy: ProxyJson::from_info(&lease.proxy),
        acquired_at: rfc3339(lease.acquired_at_ms),
        expires_at: rfc3339(lease.expires_at_ms),
        ttl_seconds: (lease.expires_at_ms - lease.acquired_at_ms).div_ceil(1000),
    };
    let mut bytes = Vec::with_capacity(512);
    body.write_json(wire::proxy_json(&lease.proxy), &mut bytes);
    Ok(json_bytes(StatusCode::CREATED, bytes))
}

fn verify(s: &StateInner, id: &str) -> Result<crate::lease::LeaseClaim, ApiError> {
    // An ID this key did not sign is simply unknown.
    s.signer.verify(id).map_err(|_| LeaseError::NotFound.into())
}

/// Runs `op`; if the store has no record of the lease, takes it back from its signed claim
/// (a lease the last checkpoint missed) and runs `op` again.
fn with_claim<T>(
    s: &StateInner,
    id: &str,
    token: u64,
    now: u64,
    op: impl Fn(&crate::lease::LeaseId) -> Result<T, LeaseError>,
) -> Result<T, ApiError> {
    let claim = verify(s, id)?;
    match op(&claim.id) {
        Err(LeaseError::NotFound) => {
            s.store.reinstate_at(&claim, token, now)?;
            if let Some(journal) = s.journal.get() {
                // The operation's own record follows: its commit makes this one durable too.
                drop(journal.append(&Record::reinstated(&claim, token)));
            }
            tracing::info!(proxy = %claim.id.key, "lease reinstated from its signed ID");
            Ok(op(&claim.id)?)
        }
        other => Ok(other?),
    }
}

/// Extends a lease from now and issues a new fencing token.
#[utoipa::path(
    post,
    path = "/v1/leases/{leaseId}/renew",
    tag = "leases",
    params(("leaseId" = String, Path, description = "The signed lease ID from the acquire")),
    request_body(content = RenewBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The new token and expiry", body = RenewResponse),
        (status = 400, description = "`malformed_request`", body = ErrorBody),
        (status = 401, description = "`unauthorized`", body = ErrorBody),
        (status = 403, description = "`forbidden`", body = ErrorBody),
        (status = 404, description = "`lease_not_found`: unknown, released, revoked or expired", body = ErrorBody),
        (status = 409, description = "`stale_token` or `proxy_draining`", body = ErrorBody),
        (status = 413, description = "`payload_too_large`", body = ErrorBody),
        (status = 503, description = "`not_ready`, `not_leader`, `auth_unavailable` or `journal_unavailable` (the operation could not be made durable)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ),
    security(("bearer" = [])),
)]
async fn renew(
    s: &StateInner,
    id: &str,
    req: RenewBody,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    if req
        .ttl_seconds
        .is_some_and(|t| t == 0 || t > wire::MAX_TTL_SECONDS)
    {
        return Err(ApiError::bad_request(format!(
            "ttlSeconds must be between 1 and {}",
            wire::MAX_TTL_SECONDS
        )));
    }
    let ttl = req.ttl_seconds.map(Duration::from_secs);
    let (renewed, lease) = with_claim(s, id, req.fencing_token, now, |lease| {
        s.store
            .renew_at(lease, req.fencing_token, ttl, now)
            .map(|r| (r, lease.clone()))
    })?;
    commit(s, || Record::Renew {
        key: lease.key,
        first_token: lease.first_token,
        token: renewed.fencing_token,
        expires_at_ms: renewed.expires_at_ms,
    })
    .await?;
    Ok(json(
        StatusCode::OK,
        &RenewResponse {
            lease_id: id.to_owned(),
            fencing_token: renewed.fencing_token,
            expires_at: rfc3339(renewed.expires_at_ms),
        },
    ))
}

/// Ends a lease, reporting how it went; the proxy rests for its cooldown.
#[utoipa::path(
    post,
    path = "/v1/leases/{leaseId}/release",
    tag = "leases",
    params(("leaseId" = String, Path, description = "The signed lease ID from the acquire")),
    request_body(content = ReleaseBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Released", body = ReleaseResponse),
        (status = 400, description = "`malformed_request` or `target_domain_required`", body = ErrorBody),
        (status = 401, description = "`unauthorized`", body = ErrorBody),
        (status = 403, description = "`forbidden`", body = ErrorBody),
        (status = 404, description = "`lease_not_found`: unknown, released, revoked or expired", body = ErrorBody),
        (status = 409, description = "`stale_token`", body = ErrorBody),
        (status = 413, description = "`payload_too_large`", body = ErrorBody),
        (status = 503, description = "`not_ready`, `not_leader`, `auth_unavailable` or `journal_unavailable` (the operation could not be made durable)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ),
    security(("bearer" = [])),
)]
async fn release(
    s: &StateInner,
    id: &str,
    req: ReleaseBody,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    req.validate().map_err(ApiError::bad_request)?;
    let lease = with_claim(s, id, req.fencing_token, now, |lease| {
        s.store
            .release_at(
                lease,
                req.fencing_token,
                req.outcome,
                req.target_domain.as_deref(),
                now,
            )
            .map(|()| lease.clone())
    })?;
    commit(s, || {
        let ban = (req.outcome == Outcome::Banned)
            .then(|| {
                // The store took the lease's own domain when the release named none.
                req.target_domain
                    .clone()
                    .or_else(|| verify(s, id).ok()?.target_domain)
            })
            .flatten()
            .map(|domain| BanCheckpoint {
                domain: LeaseStore::normalize_domain(&domain),
                until_ms: now + s.store.config().ban_cooldown.as_millis() as u64,
            });
        Record::Release {
            cooldown_until_ms: s.store.cooldown_until(&lease.key, now),
            key: lease.key,
            first_token: lease.first_token,
            ban,
        }
    })
    .await?;
    s.metrics
        .released
        .get_or_create(&CodeLabels {
            code: req.outcome.as_str(),
        })
        .inc();
    let mut bytes = Vec::with_capacity(64 + id.len());
    ReleaseResponse {
        lease_id: id.to_owned(),
        released: true,
        outcome: req.outcome,
    }
    .write_json(&mut bytes);
    Ok(json_bytes(StatusCode::OK, bytes))
}
