//! The endpoints: operations (`/healthz`, `/readyz`, `/metrics`, the OpenAPI document) and
//! the lease API (list, acquire, renew, release), with the checks they share (authentication,
//! readiness, the lease journal, JSON bodies, signed lease IDs).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{
    Response, StatusCode,
    body::Body,
    header::{self, HeaderValue},
};

use super::{
    AcquireBody, AcquireResponse, AuthError, ErrorBody, Identity, ListResponse, ProxyJson, ReleaseBody,
    ReleaseResponse, RenewBody, RenewResponse, StateInner, StatusBody,
    metrics::CodeLabels,
    openapi,
    router::{ApiError, json, json_bytes},
    wire::{self, RequestBody},
};
use crate::discovery::auth::{Presented, presented};
use crate::lease::{
    AcquireRequest, Granted, LeaseError, LeaseStore, Outcome, Selector,
    checkpoint::BanCheckpoint,
    journal::{Journal, JournalError, Record},
    rfc3339,
};

/// What every endpoint that needs a token may answer before it reads the request (documents
/// the OpenAPI contract; never built).
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "only its OpenAPI responses are used")]
enum AuthErrors {
    #[response(status = 401, description = "`unauthorized`")]
    Unauthorized(ErrorBody),
    #[response(status = 403, description = "`forbidden`")]
    Forbidden(ErrorBody),
}

/// The path parameter of renew and release (documents the OpenAPI contract; never built).
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path, names("leaseId"))]
#[expect(dead_code, reason = "only its OpenAPI parameter is used")]
struct LeaseIdPath(
    /// The signed lease ID from the acquire.
    String,
);

/// What renew and release may answer about the lease they name, past authentication.
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "only its OpenAPI responses are used")]
enum LeaseIdErrors {
    #[response(
        status = 404,
        description = "`lease_not_found`: unknown, released, revoked or expired"
    )]
    NotFound(ErrorBody),
    #[response(status = 413, description = "`payload_too_large`")]
    PayloadTooLarge(ErrorBody),
    #[response(
        status = 503,
        description = "`not_ready`, `not_leader`, `auth_unavailable` or `journal_unavailable` (the operation could not be made durable)",
        headers(("Retry-After" = u64, description = "Seconds to wait"))
    )]
    Unavailable(ErrorBody),
}

/// Liveness.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process serves HTTP", body = StatusBody)),
)]
pub(super) fn healthz() -> Response<Full<Bytes>> {
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
pub(super) fn readyz(s: &StateInner) -> Result<Response<Full<Bytes>>, ApiError> {
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
pub(super) fn metrics(s: &StateInner) -> Result<Response<Full<Bytes>>, ApiError> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &s.deps.registry)
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
pub(super) fn openapi_json() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(openapi::served()));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub(super) fn check_ready(s: &StateInner) -> Result<(), ApiError> {
    let r = *s.deps.readiness.borrow();
    if !r.leader {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_leader",
            "this replica is not the leader; retry (the Service routes to the leader once it is ready)",
        )
        .retry(Duration::from_secs(1)));
    }
    if !r.caches_synced {
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
pub(super) fn check_journal(s: &StateInner) -> Result<(), ApiError> {
    match s.journal.get().and_then(Journal::failing) {
        Some(why) => Err(journal_unavailable(&JournalError::Failing(why))),
        None => Ok(()),
    }
}

pub(super) fn journal_unavailable(error: &JournalError) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "journal_unavailable",
        format!("the lease operation could not be made durable: {error}"),
    )
    .retry(Duration::from_secs(1))
}

/// Appends `record` to the journal, if any, and waits until it is durable.
pub(super) async fn commit(s: &StateInner, record: impl FnOnce() -> Record) -> Result<(), ApiError> {
    match s.journal.get() {
        Some(journal) => journal
            .append(&record())
            .wait()
            .await
            .map_err(|e| journal_unavailable(&e)),
        None => Ok(()),
    }
}

pub(super) async fn authenticate(
    s: &StateInner,
    parts: &hyper::http::request::Parts,
) -> Result<Identity, ApiError> {
    if let Some(anonymous) = s.deps.auth.anonymous() {
        return Ok(anonymous);
    }
    let unauthenticated = |msg: &str| {
        let mut e = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", msg);
        e.allow = None;
        e
    };
    let token = match presented(&parts.headers) {
        Presented::Nothing => return Err(unauthenticated("missing Authorization: Bearer token")),
        Presented::Bearer(token) if !token.is_empty() => token,
        // The API takes a Bearer token only; the Basic password is the status page's.
        Presented::Bearer(_) | Presented::BasicPassword(_) | Presented::Unusable => {
            return Err(unauthenticated("Authorization must be: Bearer <token>"));
        }
    };
    s.deps.auth.authenticate(&token).await.map_err(|e| match e {
        AuthError::Unauthenticated => unauthenticated("invalid bearer token"),
        AuthError::Forbidden(_) => ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string()),
        AuthError::Unavailable(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "auth_unavailable", e.to_string())
                .retry(Duration::from_secs(1))
        }
    })
}

/// Reads, decodes and validates a request body: 413 over the size limit, 400 for malformed
/// JSON (saying where) or a value out of range (saying what to fix).
pub(super) async fn read_request<T, B>(
    s: &StateInner,
    parts: &hyper::http::request::Parts,
    body: B,
) -> Result<T, ApiError>
where
    T: RequestBody,
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limit = s.deps.config.max_body_bytes;
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
    let value: T = match serde_json::from_slice(&bytes) {
        Ok(value) => value,
        Err(_) => decode_with_path(&bytes)?,
    };
    value.validate().map_err(ApiError::bad_request)?;
    Ok(value)
}

/// Decodes a body the plain parser refused, to say where it went wrong.
fn decode_with_path<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
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
        AuthErrors,
        (status = 503, description = "`not_ready`, `not_leader` or `auth_unavailable`", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ),
    security(("bearer" = [])),
)]
pub(super) fn list(
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
    let compiled = s.deps.store.compile(&selector);
    let views = s.deps.store.list_at(&compiled, now);
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
        AuthErrors,
        (status = 413, description = "`payload_too_large`: body over 16 KiB", body = ErrorBody),
        (status = 503, description = "`no_proxy_available` (nothing eligible now), `not_ready`, `not_leader`, \
            `auth_unavailable`, `journal_unavailable` (the lease could not be made durable) or `request_in_progress` \
            (an acquire with this `requestId` is being granted: ask again)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds until trying again may succeed: 1 to 60"))),
    ),
    security(("bearer" = [])),
)]
pub(super) async fn acquire(
    s: &StateInner,
    identity: &Identity,
    req: AcquireBody,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let selector = Selector::from_map(&req.selector);
    let compiled = s.deps.store.compile(&selector);
    let ttl = req
        .ttl_seconds
        .map_or(s.deps.config.default_ttl, Duration::from_secs);
    let request = AcquireRequest {
        selector: &compiled,
        holder: &req.holder,
        ttl,
        target_domain: req.target_domain.as_deref(),
        session_key: req.session_key.as_deref(),
        request_id: req.request_id.as_deref(),
    };
    let Granted { lease, repeat_of } = match s.deps.store.acquire_granted_at(&request, now) {
        Ok(granted) => granted,
        Err(e) => {
            s.deps
                .metrics
                .refused
                .get_or_create(&CodeLabels { code: e.code() })
                .inc();
            return Err(e.into());
        }
    };
    let repeated = repeat_of.is_some();
    let claim = repeat_of.unwrap_or_else(|| {
        lease.claim(
            &req.holder,
            req.target_domain.as_deref(),
            req.session_key.as_deref(),
        )
    });
    if repeated {
        // Granted (and made durable) by an earlier acquire with this request ID.
        tracing::debug!(proxy = %lease.id.key, holder = %req.holder, caller = %identity.name, "lease answered again for its request ID");
    } else {
        s.deps.metrics.acquired.inc();
        tracing::debug!(proxy = %lease.id.key, holder = %req.holder, caller = %identity.name, "lease granted");
        let request_id = req.request_id.as_deref();
        if let Err(error) = commit(s, || {
            Record::acquired(&lease, &claim, request_id, s.deps.store.config().session_idle_ttl)
        })
        .await
        {
            // Not durable, so not granted: free the slot (nobody was told its token).
            let _ = s
                .deps
                .store
                .release_at(&lease.id, lease.fencing_token, Outcome::Error, None, now);
            if let Some(request_id) = request_id {
                s.deps.store.forget_request(&req.holder, request_id);
            }
            return Err(error);
        }
        if let Some(request_id) = request_id {
            s.deps.store.confirm_request(&req.holder, request_id);
        }
    }
    let lease_id = s.deps.signer.sign(&claim);
    let body = AcquireResponse {
        lease_id,
        fencing_token: lease.fencing_token,
        proxy_url: lease.proxy.url_with_credentials(),
        proxy: ProxyJson::from_info(&lease.proxy),
        acquired_at: rfc3339(lease.acquired_at_ms),
        expires_at: rfc3339(lease.expires_at_ms),
        // As granted (a repeat's lease may have been renewed since).
        ttl_seconds: (claim.expires_at_ms - claim.acquired_at_ms).div_ceil(1000),
    };
    let mut bytes = Vec::with_capacity(512);
    body.write_json(wire::proxy_json(&lease.proxy), &mut bytes);
    Ok(json_bytes(StatusCode::CREATED, bytes))
}

pub(super) fn verify(s: &StateInner, id: &str) -> Result<crate::lease::LeaseClaim, ApiError> {
    // An ID this key did not sign is simply unknown.
    s.deps.signer.verify(id).map_err(|_| LeaseError::NotFound.into())
}

/// Runs `op`; if the store has no record of the lease, takes it back from its signed claim
/// (a lease the last checkpoint missed) and runs `op` again.
pub(super) fn with_claim<T>(
    s: &StateInner,
    id: &str,
    token: u64,
    now: u64,
    op: impl Fn(&crate::lease::LeaseClaim) -> Result<T, LeaseError>,
) -> Result<T, ApiError> {
    let claim = verify(s, id)?;
    match op(&claim) {
        Err(LeaseError::NotFound) => {
            s.deps.store.reinstate_at(&claim, token, now)?;
            if let Some(journal) = s.journal.get() {
                // The operation's own record follows: its commit makes this one durable too.
                drop(journal.append(&Record::reinstated(&claim, token)));
            }
            tracing::info!(proxy = %claim.id.key, "lease reinstated from its signed ID");
            Ok(op(&claim)?)
        }
        other => Ok(other?),
    }
}

/// Extends a lease from now and issues a new fencing token.
#[utoipa::path(
    post,
    path = "/v1/leases/{leaseId}/renew",
    tag = "leases",
    params(LeaseIdPath),
    request_body(content = RenewBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The new token and expiry", body = RenewResponse),
        (status = 400, description = "`malformed_request`", body = ErrorBody),
        AuthErrors,
        (status = 409, description = "`stale_token` or `proxy_draining`", body = ErrorBody),
        LeaseIdErrors,
    ),
    security(("bearer" = [])),
)]
pub(super) async fn renew(
    s: &StateInner,
    id: &str,
    req: RenewBody,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let ttl = req.ttl_seconds.map(Duration::from_secs);
    let (renewed, lease) = with_claim(s, id, req.fencing_token, now, |claim| {
        s.deps
            .store
            .renew_at(&claim.id, req.fencing_token, ttl, now)
            .map(|r| (r, claim.id.clone()))
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
    params(LeaseIdPath),
    request_body(content = ReleaseBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Released", body = ReleaseResponse),
        (status = 400, description = "`malformed_request` or `target_domain_required`", body = ErrorBody),
        AuthErrors,
        (status = 409, description = "`stale_token`", body = ErrorBody),
        LeaseIdErrors,
    ),
    security(("bearer" = [])),
)]
pub(super) async fn release(
    s: &StateInner,
    id: &str,
    req: ReleaseBody,
    now: u64,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let (lease, own_domain) = with_claim(s, id, req.fencing_token, now, |claim| {
        s.deps
            .store
            .release_at(
                &claim.id,
                req.fencing_token,
                req.outcome,
                req.target_domain.as_deref(),
                now,
            )
            .map(|()| (claim.id.clone(), claim.target_domain.clone()))
    })?;
    commit(s, || {
        let ban = (req.outcome == Outcome::Banned)
            // The store took the lease's own domain when the release named none.
            .then(|| req.target_domain.clone().or(own_domain))
            .flatten()
            .map(|domain| BanCheckpoint {
                domain: LeaseStore::normalize_domain(&domain),
                until_ms: now + s.deps.store.config().ban_cooldown.as_millis() as u64,
            });
        Record::Release {
            cooldown_until_ms: s.deps.store.cooldown_until(&lease.key, now),
            key: lease.key,
            first_token: lease.first_token,
            ban,
        }
    })
    .await?;
    s.deps
        .metrics
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
