//! The endpoints that read: operations (`/healthz`, `/readyz`, `/metrics`) and the listings
//! (`GET /v1/proxies`, `GET /v1/leases`), with the responses every endpoint may give as the
//! OpenAPI contract documents them. The lease calls are in `leases`, the checks every lease API
//! request goes through in `request`.

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Response, StatusCode,
    header::{self, HeaderValue},
};

use super::{
    ErrorBody, LeaseJson, LeasesResponse, ListResponse, ProxyJson, StateInner, StatusBody,
    request::{check_journal, check_ready},
    router::{Answer, ApiError, json},
    wire::{self},
};
use crate::{
    api::ProxyKey,
    lease::{Selector, rfc3339},
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
