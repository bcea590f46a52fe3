//! The admin server: `/healthz` (the process is alive), `/readyz` (caches synced and leadership
//! known: only the leader is ready, so a Service sends discovery traffic to it), `/metrics`,
//! and a page at `/ui` (the status page) once this replica leads. Only `/ui` is authenticated
//! (with the discovery API's tokens): the rest is for probes and Prometheus.
//!
//! It owns [`Page`], the interface through which it and the discovery API serve that page, so
//! that neither names what renders it: the renderer implements `Page` and is handed in.

use std::{
    convert::Infallible,
    future::Future,
    sync::{Arc, OnceLock},
};

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    HeaderMap, Method, Request, Response, StatusCode, body::Incoming, server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::watch};
use tracing::debug;

/// What `/readyz` reports, on the admin port and (caches and leadership only) on the discovery API.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    /// The informer caches have synced.
    pub caches_synced: bool,
    /// This replica leads.
    pub leader: bool,
    /// Lease checkpoint saves fail: a detail of `/readyz`, not a reason to stop serving (the
    /// leases are still served and honoured; only a leader change would lose recent ones).
    pub checkpoint_failing: bool,
}

impl Readiness {
    /// Ready for traffic.
    pub fn is_ready(&self) -> bool {
        self.caches_synced && self.leader
    }
}

/// A page served at `GET /ui`, by the admin server and by the discovery API.
#[async_trait]
pub trait Page: Send + Sync {
    /// The answer to a `GET /ui` with these request headers and query string (paging and
    /// filters): the page authenticates the caller itself (a browser answers a Basic
    /// challenge, which the servers know nothing of).
    async fn respond(&self, headers: &HeaderMap, query: Option<&str>) -> Response<Full<Bytes>>;
}

/// Where the status page appears once the replica leads (a follower has no leases or health
/// to show: `/ui` answers 503 until then).
pub type StatusPageSlot = Arc<OnceLock<Arc<dyn Page>>>;

/// Serves the admin endpoints on `listener` until `shutdown` resolves.
pub async fn serve_admin(
    listener: TcpListener,
    readiness: watch::Receiver<Readiness>,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()>,
) {
    serve_admin_with_ui(listener, readiness, registry, StatusPageSlot::default(), shutdown).await;
}

/// [`serve_admin`], with the status page at `/ui` once `ui` is filled.
pub async fn serve_admin_with_ui(
    listener: TcpListener,
    readiness: watch::Receiver<Readiness>,
    registry: Arc<Registry>,
    ui: StatusPageSlot,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            stream = crate::net::accept(&listener, "admin") => stream,
        };
        let readiness = readiness.clone();
        let registry = registry.clone();
        let ui = ui.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let response = respond(&request, &readiness, &registry);
                let ui = ui.clone();
                async move {
                    if request.method() == Method::GET && request.uri().path() == "/ui" {
                        return Ok::<_, Infallible>(match ui.get() {
                            Some(page) => page.respond(request.headers(), request.uri().query()).await,
                            None => text(StatusCode::SERVICE_UNAVAILABLE, "not the leader\n"),
                        });
                    }
                    Ok(response)
                }
            });
            if let Err(err) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(error = %err, "admin connection ended");
            }
        });
    }
}

fn respond(
    request: &Request<Incoming>,
    readiness: &watch::Receiver<Readiness>,
    registry: &Registry,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is supported\n");
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            let state = *readiness.borrow();
            match (state.caches_synced, state.leader) {
                (true, true) if state.checkpoint_failing => text(
                    StatusCode::OK,
                    "ready; lease checkpoint failing (see epo_lease_checkpoint_failures_total and Events on the leader Lease)\n",
                ),
                (true, true) => text(StatusCode::OK, "ready\n"),
                (false, _) => text(StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n"),
                (true, false) => text(StatusCode::SERVICE_UNAVAILABLE, "not the leader\n"),
            }
        }
        "/metrics" => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => {
                    let mut response = text(StatusCode::OK, &body);
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static(
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        ),
                    );
                    response
                }
                Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "encoding metrics failed\n"),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = status;
    response
}
