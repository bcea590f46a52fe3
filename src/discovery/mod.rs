//! The discovery HTTP API (hyper, HTTP/1.1 keep-alive): crawlers list proxies, acquire, renew
//! and release leases and report their requests' outcomes; `/healthz`, `/readyz` and `/metrics` serve operations.
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
mod fast_body;
mod handlers;
mod http_errors;
mod leases;
mod metrics;
pub mod openapi;
mod outcomes;
mod request;
mod router;
mod terms;
mod usage;
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
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Body};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::watch};

pub use auth::{
    AnyOf, AuthError, Authenticator, Identity, NoAuthentication, ReloadingTokens, RememberedVerdict,
    StaticTokens, TokenFile, TokenReviewAuthenticator, TokenSecret,
};
pub use metrics::DiscoveryMetrics;
pub use outcomes::OutcomeResponse;
pub use terms::SelectorTerms;
pub use usage::{HolderUsageJson, QuotaJson, QuotaUse, TokenUsageJson, UsageCounters, UsageResponse};
pub use wire::{
    AcquireBody, AcquireResponse, ERROR_CODES, ErrorBody, ErrorDetail, LeaseJson, LeasesResponse,
    ListResponse, OutcomeBody, ProxyJson, ReleaseBody, ReleaseResponse, RenewBody, RenewResponse,
    RequestBody, StatusBody, retry_after_header,
};

use crate::{
    lease::{LeaseStore, journal::Journal, token::LeaseSigner},
    outcomes::Outcomes,
    telemetry::admin::Page,
    usage::Usage,
};
use handlers::{healthz, leases_list, list, metrics, readyz};
use leases::{acquire, release, renew};
use metrics::ResultLabels;
use openapi::openapi_json;
use request::{authenticate, check_journal, check_ready, parse_request, read_body};
use router::{Answer, ApiError, OTHER_ROUTE, Route, route};

// One readiness for the replica: the admin endpoint's, whose checkpoint detail this API ignores.
pub use crate::telemetry::admin::Readiness;

/// Limits and defaults of the API.
#[derive(Clone, Debug)]
pub struct DiscoveryConfig {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// TTL of a lease whose request names none.
    pub default_ttl: Duration,
    /// How long a graceful shutdown waits for open requests.
    pub shutdown_grace: Duration,
    /// How long a connection may stay quiet: one that has written nothing and sent no
    /// complete request for this long (idle keep-alive, or a request head that never ends) is
    /// closed, within two to three times this ([`crate::net::QuietLimit`]).
    pub quiet_limit: Duration,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 * 1024,
            default_ttl: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            quiet_limit: Duration::from_secs(30),
        }
    }
}

/// What the API serves from, given once when it is built.
pub struct DiscoveryDeps {
    pub store: LeaseStore,
    /// Signs lease IDs and verifies the ones crawlers present.
    pub signer: LeaseSigner,
    pub auth: Arc<dyn Authenticator>,
    /// Lease endpoints answer 503 until this says synced and leader.
    pub readiness: watch::Receiver<Readiness>,
    /// What `GET /metrics` renders.
    pub registry: Arc<Registry>,
    /// Must have been registered in `registry` (with [`DiscoveryMetrics::register`]) before
    /// that was frozen in an `Arc`.
    pub metrics: DiscoveryMetrics,
    /// Outcome statistics: served in `GET /v1/proxies`, fed by `POST /v1/leases/{id}/outcomes`
    /// and by releases with outcome `banned`.
    pub outcomes: Outcomes,
    /// Usage per token and holder: served in `GET /v1/usage`, fed by acquires, releases and
    /// outcome reports; its quotas refuse acquires.
    pub usage: Usage,
    /// Politeness per proxy and domain, shared with the gateway: acquires for a domain and
    /// outcome reports answer when the holder's next request may go (`notBefore`).
    pub politeness: crate::politeness::Politeness,
    pub config: DiscoveryConfig,
}

struct StateInner {
    deps: DiscoveryDeps,
    /// Every request's identity when the authenticator requires no token, made once: the
    /// authenticator is fixed for the state's life, and one `Arc` a request cost an allocation
    /// and a copy of the name.
    anonymous: Option<Arc<Identity>>,
    ui: std::sync::OnceLock<Arc<dyn Page>>,
    journal: std::sync::OnceLock<Journal>,
}

/// What the API serves from; cheap to clone.
#[derive(Clone)]
pub struct DiscoveryState {
    inner: Arc<StateInner>,
}

impl DiscoveryState {
    pub fn new(deps: DiscoveryDeps) -> Self {
        // Metrics built for another state keep reading that state's store.
        let _ = deps.metrics.active.0.set(deps.store.clone());
        Self {
            inner: Arc::new(StateInner {
                anonymous: deps.auth.anonymous().map(Arc::new),
                deps,
                ui: std::sync::OnceLock::new(),
                journal: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Serves the status page at `GET /ui` (standalone mode; once).
    pub fn set_status_page(&self, page: Arc<dyn Page>) {
        let _ = self.inner.ui.set(page);
    }

    /// Makes acquires, renewals and releases durable before they are answered (standalone
    /// mode; once): each handler appends what changed to `journal` and awaits its commit.
    pub fn set_journal(&self, journal: Journal) {
        let _ = self.inner.journal.set(journal);
    }

    /// The lease store behind the API.
    pub fn store(&self) -> &LeaseStore {
        &self.inner.deps.store
    }
}

/// Serves the API on `listener` until `shutdown` completes; then stops accepting and waits up
/// to [`DiscoveryConfig::shutdown_grace`] for open connections to finish their requests.
pub async fn serve(
    listener: TcpListener,
    state: DiscoveryState,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let drain = crate::net::Drain::default();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut builder = hyper::server::conn::http1::Builder::new();
    // No hyper timer: QuietLimit closes connections that stall, for less per request.
    builder.keep_alive(true);
    let quiet_limit = state.inner.deps.config.quiet_limit;
    loop {
        tokio::select! {
            stream = crate::net::accept(&listener, "discovery") => {
                let requests = state.inner.deps.metrics.requests.clone();
                let state = state.clone();
                // The connection's own: its requests carry one token, looked up once.
                let remembered = Arc::new(Remembered::default());
                let service = hyper::service::service_fn(move |req| {
                    answer(state.clone(), remembered.clone(), req)
                });
                let stream = crate::net::QuietLimit::new(stream, quiet_limit);
                let io = http_errors::JsonErrors::new(TokioIo::new(stream), move |status| {
                    let code = http_errors::code_for(status).0;
                    requests.get_or_create(&ResultLabels { route: "other", code }).inc();
                });
                let conn = drain.watch(builder.serve_connection(io, service));
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
    if !drain.stop(state.inner.deps.config.shutdown_grace).await {
        tracing::warn!("discovery connections still open after the shutdown grace period");
    }
    Ok(())
}

/// Answers one request: the whole API as a function.
pub async fn handle<B>(state: &DiscoveryState, request: Request<B>) -> Response<Full<Bytes>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Ok(response) = answer(state.clone(), Arc::default(), request).await;
    response
}

/// What a keep-alive connection's requests remember of the ones before it: a crawler sends
/// one token, and mostly one selector, on all of them.
#[derive(Default)]
struct Remembered {
    verdict: RememberedVerdict,
    selector: leases::RememberedSelector,
}

/// [`handle`] for a request of a connection that remembers `remembered`. It owns its handles
/// and is infallible as hyper's service wants it, so its future is the one hyper keeps: a
/// block around it would move the whole request's state into itself once more.
async fn answer<B>(
    state: DiscoveryState,
    remembered: Arc<Remembered>,
    request: Request<B>,
) -> Result<Response<Full<Bytes>>, Infallible>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let (index, result) = match route(&parts.method, parts.uri.path()) {
        Ok(r) => (r.index(), dispatch(&state, r, &parts, body, &remembered).await),
        Err(e) => (OTHER_ROUTE, Err(e)),
    };
    let (code, response) = match result {
        Ok(response) => ("ok", response),
        Err(e) => (e.code, e.into_response()),
    };
    state
        .inner
        .deps
        .metrics
        .record(index, code, started.elapsed().as_secs_f64());
    Ok(response)
}

async fn dispatch<B>(
    state: &DiscoveryState,
    route: Route<'_>,
    parts: &hyper::http::request::Parts,
    body: B,
    remembered: &Remembered,
) -> Answer
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
            return Ok(page.respond(&parts.headers, parts.uri.query()).await);
        }
        _ => {}
    }
    let identity = authenticate(s, parts, &remembered.verdict).await?;
    check_ready(s)?;
    if !matches!(route, Route::List | Route::Leases | Route::Usage) {
        check_journal(s)?;
    }
    // One instant per request: every store decision and every time in the answer is about it.
    match route {
        Route::List => list(s, parts, s.deps.store.now_ms()),
        Route::Leases => leases_list(s, parts, s.deps.store.now_ms()),
        Route::Usage => usage::usage(s, parts, s.deps.store.now_ms()),
        Route::Acquire => {
            let bytes = read_body(s, body).await?;
            let req: AcquireBody<'_> = parse_request(&bytes)?;
            acquire(s, &identity, req, &remembered.selector, s.deps.store.now_ms()).await
        }
        Route::Renew(id) => {
            let req: RenewBody = parse_request(&read_body(s, body).await?)?;
            renew(s, id, req, s.deps.store.now_ms()).await
        }
        Route::Release(id) => {
            let req: ReleaseBody = parse_request(&read_body(s, body).await?)?;
            release(s, &identity, id, req, s.deps.store.now_ms()).await
        }
        Route::Outcomes(id) => {
            let req: OutcomeBody = parse_request(&read_body(s, body).await?)?;
            outcomes::report_outcome(s, &identity, id, req, s.deps.store.now_ms())
        }
        Route::Healthz | Route::Readyz | Route::Metrics | Route::OpenApi | Route::Ui => {
            unreachable!("answered above")
        }
    }
}
