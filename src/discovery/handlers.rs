//! The endpoints: operations (`/healthz`, `/readyz`, `/metrics`, the OpenAPI document) and
//! the lease API (list, acquire, renew, release), with the checks they share (authentication,
//! readiness, the lease journal, JSON bodies, signed lease IDs). The lease operations themselves,
//! durable ones included, are [`crate::lease::DurableLeases`]'s: a handler parses, calls one and
//! answers.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{
    Response, StatusCode,
    body::Body,
    header::{self, HeaderValue},
};

use super::{
    AcquireBody, AcquireResponse, AuthError, ErrorBody, Identity, LeaseJson, LeasesResponse, ListResponse,
    ProxyJson, ReleaseBody, ReleaseResponse, RememberedVerdict, RenewBody, RenewResponse, StateInner,
    StatusBody,
    metrics::CodeLabels,
    router::{Answer, ApiError, json, json_bytes},
    terms::SelectorTerms,
    wire::{self, RequestBody},
};
use crate::{
    api::ProxyKey,
    discovery::auth::{Presented, presented},
    lease::{
        AcquireRequest, Acquired, CompiledSelector, DurableError, DurableLeases, LeaseStore, Outcome,
        Rfc3339, Selector, journal::JournalError, rfc3339,
    },
};

/// What every endpoint that needs a token may answer before it reads the request (documents
/// the OpenAPI contract; never built).
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "only its OpenAPI responses are used")]
pub(super) enum AuthErrors {
    #[response(status = 401, description = "`unauthorized`")]
    Unauthorized(ErrorBody),
    #[response(status = 403, description = "`forbidden`")]
    Forbidden(ErrorBody),
}

/// What the token-checked reads (proxies, leases, usage) answer while this replica cannot serve
/// them (documents the OpenAPI contract; never built).
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "only its OpenAPI responses are used")]
pub(super) enum NotServing {
    #[response(
        status = 503,
        description = "`not_ready`, `not_leader` or `auth_unavailable`",
        headers(("Retry-After" = u64, description = "Seconds to wait"))
    )]
    Unavailable(ErrorBody),
}

/// The path parameter of renew, release and outcomes (documents the OpenAPI contract; never built).
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path, names("leaseId"))]
#[expect(dead_code, reason = "only its OpenAPI parameter is used")]
pub(super) struct LeaseIdPath(
    /// The signed lease ID from the acquire.
    String,
);

/// What renew, release and outcomes may answer about the lease they name, past authentication.
#[derive(utoipa::IntoResponses)]
#[expect(dead_code, reason = "only its OpenAPI responses are used")]
pub(super) enum LeaseIdErrors {
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
pub(super) fn readyz(s: &StateInner) -> Answer {
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
pub(super) fn metrics(s: &StateInner) -> Answer {
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

/// The lease operations of this API: durable first when a journal is set.
pub(super) fn leases(s: &StateInner) -> DurableLeases<'_> {
    DurableLeases::new(&s.deps.store, &s.deps.signer, s.journal.get())
}

/// Refuses lease operations while the journal cannot make them durable.
pub(super) fn check_journal(s: &StateInner) -> Result<(), ApiError> {
    match leases(s).failing() {
        Some(error) => Err(journal_unavailable(&error)),
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

impl From<DurableError> for ApiError {
    fn from(error: DurableError) -> Self {
        match error {
            DurableError::Lease(refused) => refused.into(),
            DurableError::Journal(error) => journal_unavailable(&error),
        }
    }
}

/// Who sent the request, from its bearer token; a connection's last success is recalled from
/// `remembered` rather than looked up again.
pub(super) async fn authenticate(
    s: &StateInner,
    parts: &hyper::http::request::Parts,
    remembered: &RememberedVerdict,
) -> Result<Arc<Identity>, ApiError> {
    if let Some(anonymous) = s.deps.auth.anonymous() {
        return Ok(Arc::new(anonymous));
    }
    let header = parts.headers.get(hyper::header::AUTHORIZATION);
    let look_up = async { look_up(s, parts).await.map(Arc::new) };
    remembered.recall_or(&*s.deps.auth, header, look_up).await
}

/// Who the request's bearer token names, looked up.
async fn look_up(s: &StateInner, parts: &hyper::http::request::Parts) -> Result<Identity, ApiError> {
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

/// Reads a request body: 413 over the size limit, 400 when it breaks off.
pub(super) async fn read_body<B>(s: &StateInner, body: B) -> Result<Bytes, ApiError>
where
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
    // What `Content-Length` announced, without looking the header up again (hyper did).
    if body.size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    match body_bytes(body, limit).await {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Err(too_large()),
        Err(e) => Err(ApiError::bad_request(format!("reading the request body: {e}"))),
    }
}

/// Decodes and validates a request body read by [`read_body`] (its strings may borrow from
/// it): 400 for malformed JSON (saying where) or a value out of range (saying what to fix).
pub(super) fn parse_request<'a, T>(bytes: &'a [u8]) -> Result<T, ApiError>
where
    T: RequestBody + serde::Deserialize<'a>,
{
    // The plain parser for the common, valid body (from text checked once: the byte-slice
    // reader checks every string again); the path-tracking one only to say where a malformed
    // body went wrong (it costs about as much as the parse itself).
    let parsed = std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| serde_json::from_str(text).ok());
    let value: T = match parsed {
        Some(value) => value,
        None => decode_with_path(bytes)?,
    };
    value.validate().map_err(ApiError::bad_request)?;
    Ok(value)
}

/// A request body's bytes, or `None` when it is longer than `limit`. A body that arrives as
/// one frame (a small request with `Content-Length`: nearly every request here) is passed on
/// as it is, without the buffer list and the copy that collecting it builds.
async fn body_bytes<B>(
    body: B,
    limit: usize,
) -> Result<Option<Bytes>, Box<dyn std::error::Error + Send + Sync>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut body = std::pin::pin!(body);
    let mut first = Bytes::new();
    let mut more: Option<bytes::BytesMut> = None;
    while !body.is_end_stream() {
        let Some(frame) = body.frame().await else { break };
        // Trailers carry nothing the API reads.
        let Ok(data) = frame.map_err(Into::into)?.into_data() else {
            continue;
        };
        let held = more.as_ref().map_or(first.len(), |m| m.len());
        if held + data.len() > limit {
            return Ok(None);
        }
        match &mut more {
            None if first.is_empty() => first = data,
            None => {
                let mut joined = bytes::BytesMut::with_capacity(held + data.len());
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                more = Some(joined);
            }
            Some(joined) => joined.extend_from_slice(&data),
        }
    }
    Ok(Some(more.map_or(first, bytes::BytesMut::freeze)))
}

/// Decodes a body the plain parser refused, to say where it went wrong.
fn decode_with_path<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
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

/// Domains per proxy whose outcome statistics `GET /v1/proxies` lists (the busiest).
const OUTCOME_DOMAINS_LISTED: usize = 5;

/// Lists the proxies whose attributes match every term of the selector, sorted by key, with
/// their outcome statistics.
#[utoipa::path(
    get,
    path = "/v1/proxies",
    tag = "leases",
    params(("selector" = Option<String>, Query, max_length = 2048, pattern = "^[ \\t,]*([^,=]*[^ \\t,=][^,=]*=[^,=]*([ \\t]*,[ \\t,]*[^,=]*[^ \\t,=][^,=]*=[^,=]*){0,31})?[ \\t,]*$",
        description = "`key=value[,key=value...]`: at most 32 terms and 2048 characters, spaces and tabs \
            around terms, keys and values ignored, empty terms skipped; absent: every proxy"),
        ("targetDomain" = Option<String>, Query, min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$",
        description = "List as a crawler of this domain sees it: a proxy banned for it is `banned`")),
    responses(
        (status = 200, description = "The matching proxies and how each stands", body = ListResponse),
        (status = 400, description = "`malformed_request`: bad selector or unknown query parameter", body = ErrorBody),
        AuthErrors,
        NotServing,
    ),
    security(("bearer" = [])),
)]
pub(super) fn list(s: &StateInner, parts: &hyper::http::request::Parts, now: u64) -> Answer {
    let mut selector = Selector::default();
    let mut target_domain = None;
    for_each_query_parameter(parts, |k, v| {
        match k {
            "selector" => selector = Selector::parse(&v).map_err(|e| ApiError::bad_request(e.to_string()))?,
            "targetDomain" => {
                wire::check_domain(&v).map_err(ApiError::bad_request)?;
                target_domain = Some(v.into_owned());
            }
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let compiled = s.deps.store.compile(&selector);
    let views = s.deps.store.list_for(&compiled, target_domain.as_deref(), now);
    let proxies = (views.iter())
        .map(|view| ProxyJson {
            outcomes: match &target_domain {
                Some(domain) => (s.deps.outcomes).proxy_for(&view.info.key, OUTCOME_DOMAINS_LISTED, domain),
                None => s.deps.outcomes.proxy(&view.info.key, OUTCOME_DOMAINS_LISTED),
            },
            ..ProxyJson::from_view(view)
        })
        .collect();
    Ok(json(StatusCode::OK, &ListResponse { proxies }))
}

/// Hands each query parameter of `parts` to `take`, which says whether it knows the name; an
/// unknown one is a 400 that names it (a typo must not widen a listing silently).
pub(super) fn for_each_query_parameter(
    parts: &hyper::http::request::Parts,
    mut take: impl FnMut(&str, std::borrow::Cow<'_, str>) -> Result<bool, ApiError>,
) -> Result<(), ApiError> {
    for (k, v) in form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes()) {
        if !take(&k, v)? {
            return Err(ApiError::bad_request(format!("unknown query parameter {k:?}")));
        }
    }
    Ok(())
}

/// A page size `limit=` of 1 to `max`, or a 400 that says so.
pub(super) fn parse_limit(value: &str, max: usize) -> Result<usize, ApiError> {
    value
        .parse()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| ApiError::bad_request(format!("limit must be 1-{max}")))
}

/// Lists active leases (never their IDs or tokens), by proxy key then age, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/leases",
    tag = "leases",
    params(
        ("proxy" = Option<String>, Query, pattern = "^[^/]+/[^/]+$",
            description = "Only the leases on this proxy (`namespace/name`)"),
        ("holder" = Option<String>, Query, description = "Only the leases this holder holds"),
        ("limit" = Option<usize>, Query, minimum = 1, maximum = 1000,
            description = "Leases per page (default 100)"),
        ("after" = Option<String>, Query, pattern = "^[^/]+/[^/]+#[0-9]{1,20}$",
            description = "The `next` of the previous page (`namespace/name#firstToken`: the page \
            goes on after that lease)"),
    ),
    responses(
        (status = 200, description = "A page of active leases", body = LeasesResponse),
        (status = 400, description = "`malformed_request`: a bad parameter or an unknown one", body = ErrorBody),
        AuthErrors,
        NotServing,
    ),
    security(("bearer" = [])),
)]
pub(super) fn leases_list(s: &StateInner, parts: &hyper::http::request::Parts, now: u64) -> Answer {
    let (mut proxy, mut holder, mut after) = (None, None, None);
    let mut limit = wire::DEFAULT_LEASES_PAGE;
    for_each_query_parameter(parts, |k, v| {
        match k {
            "proxy" => {
                let key = v
                    .parse::<ProxyKey>()
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
                proxy = Some(key);
            }
            "holder" => holder = Some(v.into_owned()),
            "limit" => limit = parse_limit(&v, wire::MAX_LEASES_PAGE)?,
            "after" => after = Some(parse_cursor(&v)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    let all = s.deps.store.leases_at(proxy.as_ref(), holder.as_deref(), now);
    // The cursor is the last lease of the previous page: a lease that ended since is skipped,
    // none is listed twice.
    let start = after.map_or(0, |(key, token)| {
        all.partition_point(|l| (&l.claim.id.key, l.claim.id.first_token) <= (&key, token))
    });
    let page = &all[start..all.len().min(start + limit)];
    let next = (start + page.len() < all.len())
        .then(|| (page.last()).map(|l| format!("{}#{}", l.claim.id.key, l.claim.id.first_token)))
        .flatten();
    let leases = page
        .iter()
        .map(|l| LeaseJson {
            proxy: l.claim.id.key.to_string(),
            holder: l.claim.holder.clone(),
            acquired_at: rfc3339(l.claim.acquired_at_ms),
            expires_at: rfc3339(l.expires_at_ms),
            target_domain: l.claim.target_domain.clone(),
            session_key: l.claim.session_key.clone(),
        })
        .collect();
    Ok(json(StatusCode::OK, &LeasesResponse { leases, next }))
}

/// A `GET /v1/leases` cursor: `namespace/name#firstToken`, the token 1-20 digits (one past
/// `u64::MAX` names a place after every lease of that proxy, as the contract's pattern allows).
fn parse_cursor(text: &str) -> Result<(ProxyKey, u64), ApiError> {
    let bad = || ApiError::bad_request("after must be the next of a previous page");
    let (key, token) = text.rsplit_once('#').ok_or_else(bad)?;
    if token.is_empty() || token.len() > 20 || !token.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let token = token.parse().unwrap_or(u64::MAX);
    Ok((key.parse().map_err(|_| bad())?, token))
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
        (status = 429, description = "`quota_exceeded`: the token used up a quota of its window (the \
            message names the quota and when it resets)", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds until the quota's window ends"))),
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
    req: AcquireBody<'_>,
    remembered: &RememberedSelector,
    now: u64,
) -> Answer {
    // New work: refused, before anything changes, when the token is over a quota.
    s.deps.usage.admit(&identity.name, &req.holder, now)?;
    let compiled = remembered.compile(&s.deps.store, &req.selector);
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
    let Acquired {
        lease,
        claim,
        lease_id,
        repeated,
    } = match leases(s).acquire(&request, now).await {
        Ok(acquired) => acquired,
        Err(DurableError::Lease(refused)) => {
            s.deps
                .metrics
                .refused
                .get_or_create(&CodeLabels { code: refused.code() })
                .inc();
            return Err(refused.into());
        }
        Err(not_durable) => return Err(not_durable.into()),
    };
    if repeated {
        // Granted (and made durable) by an earlier acquire with this request ID.
        tracing::debug!(proxy = %lease.id.key, holder = %req.holder, caller = %identity.name, "lease answered again for its request ID");
    } else {
        s.deps.metrics.acquired.inc();
        tracing::debug!(proxy = %lease.id.key, holder = %req.holder, caller = %identity.name, "lease granted");
    }
    let body = AcquireResponse {
        lease_id,
        fencing_token: lease.fencing_token,
        proxy_url: lease.proxy.url_with_credentials(),
        proxy: ProxyJson::from_info(&lease.proxy),
        acquired_at: Rfc3339(lease.acquired_at_ms),
        expires_at: Rfc3339(lease.expires_at_ms),
        // As granted (a repeat's lease may have been renewed since).
        ttl_seconds: (claim.expires_at_ms - claim.acquired_at_ms).div_ceil(1000),
        // A repeated answer reserves no second start.
        not_before: match (&req.target_domain, repeated) {
            (Some(domain), false) => not_before(s, &lease.proxy, domain, now),
            _ => None,
        },
    };
    let mut bytes = Vec::with_capacity(512);
    body.write_json(wire::proxy_json(&lease.proxy), &mut bytes);
    Ok(json_bytes(StatusCode::CREATED, bytes))
}

/// The selector a connection's last acquire asked for, compiled: a crawler asks for the same
/// one on every acquire, and compiling it (copying the terms, two hash lookups a term) cost
/// about 1,200 instructions of an acquire. Only a selector whose every term names a known pair
/// is kept: pair ids are never reused and combination lists never dropped, so its compiled
/// form stays right for the store's life. An unsatisfiable one may become satisfiable when a
/// proxy brings a new pair, so it is compiled again every time.
#[derive(Default)]
pub(super) struct RememberedSelector(std::sync::Mutex<Option<KeptSelector>>);

/// A selector as a request gave it (its terms by key), and compiled.
type KeptSelector = (Selector, Arc<CompiledSelector>);

impl RememberedSelector {
    /// `terms` compiled against `store`, from memory when they are the ones remembered.
    fn compile(&self, store: &LeaseStore, terms: &SelectorTerms<'_>) -> Arc<CompiledSelector> {
        if let Some((kept, compiled)) = crate::sync::lock(&self.0).as_ref()
            && kept
                .terms()
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .eq(terms.iter())
        {
            return compiled.clone();
        }
        let selector = Selector::from_terms(terms.iter());
        let compiled = Arc::new(store.compile(&selector));
        if !matches!(*compiled, CompiledSelector::Unsatisfiable) {
            *crate::sync::lock(&self.0) = Some((selector, compiled.clone()));
        }
        compiled
    }
}

/// When a holder's next request through `proxy` to `domain` may start (RFC 3339), reserved
/// in the politeness state the gateway shares; `None` when no politeness entry covers them.
pub(super) fn not_before(
    s: &StateInner,
    proxy: &crate::lease::ProxyInfo,
    domain: &str,
    now: u64,
) -> Option<String> {
    let wait = (s.deps.politeness).reserve_start(&proxy.key, &proxy.attributes, domain)?;
    Some(rfc3339(now.saturating_add(
        u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
    )))
}

/// Extends a lease from now and issues a new fencing token.
#[utoipa::path(
    post,
    path = "/v1/leases/{leaseId}/renew",
    tag = "leases",
    params(LeaseIdPath),
    request_body(content = RenewBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The new token and expiry, and whether the proxy is out of rotation", body = RenewResponse),
        (status = 400, description = "`malformed_request`", body = ErrorBody),
        AuthErrors,
        (status = 409, description = "`stale_token` or `proxy_draining`", body = ErrorBody),
        LeaseIdErrors,
    ),
    security(("bearer" = [])),
)]
pub(super) async fn renew(s: &StateInner, id: &str, req: RenewBody, now: u64) -> Answer {
    let ttl = req.ttl_seconds.map(Duration::from_secs);
    let renewed = leases(s).renew(id, req.fencing_token, ttl, now).await?;
    Ok(json(
        StatusCode::OK,
        &RenewResponse {
            lease_id: id.to_owned(),
            fencing_token: renewed.fencing_token,
            expires_at: rfc3339(renewed.expires_at_ms),
            out_of_rotation: renewed.out_of_rotation,
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
    identity: &Identity,
    id: &str,
    req: ReleaseBody,
    now: u64,
) -> Answer {
    let domain = req.target_domain.as_deref();
    // A ban counts in the proxy's outcome statistics for the domain it is for.
    let banned = (req.outcome == Outcome::Banned)
        .then(|| leases(s).check(id, req.fencing_token, now).ok())
        .flatten();
    let released = leases(s)
        .release(id, req.fencing_token, req.outcome, domain, None, now)
        .await?;
    let held_ms = now.saturating_sub(released.acquired_at_ms);
    let was_banned = req.outcome == Outcome::Banned;
    (s.deps.usage).lease_ended(&identity.name, &released.holder, held_ms, was_banned);
    if let Some(lease) = banned
        && let Some(domain) = domain.or(lease.target_domain.as_deref())
    {
        s.deps.outcomes.record_ban(&lease.proxy, domain, now);
    }
    s.deps.metrics.count_release(req.outcome);
    let mut bytes = Vec::with_capacity(64 + id.len());
    ReleaseResponse {
        lease_id: id,
        released: true,
        outcome: req.outcome,
    }
    .write_json(&mut bytes);
    Ok(json_bytes(StatusCode::OK, bytes))
}
