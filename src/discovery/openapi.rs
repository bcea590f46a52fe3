//! The discovery API's OpenAPI 3.1 contract, generated from the request and response types
//! (`wire.rs`) and the handlers' `#[utoipa::path]` attributes, served at
//! `GET /v1/openapi.json` and checked into `docs/openapi.json` (a test keeps it in sync;
//! `egress-proxies-operator openapi > docs/openapi.json` regenerates it).

use std::sync::OnceLock;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Response,
    header::{self, HeaderValue},
};
use utoipa::{
    Modify, OpenApi,
    openapi::{
        ContentBuilder, RefOr, ResponseBuilder,
        link::LinkBuilder,
        security::{Http, HttpAuthScheme, SecurityScheme},
    },
};

use super::outcomes::OutcomeResponse;
use super::usage::{HolderUsageJson, QuotaJson, QuotaUse, TokenUsageJson, UsageCounters, UsageResponse};
use super::wire::{
    AcquireBody, AcquireResponse, ErrorBody, ErrorDetail, LeaseJson, LeasesResponse, ListResponse,
    OutcomeBody, ProxyJson, ReleaseBody, ReleaseResponse, RenewBody, RenewResponse, StatusBody,
};
use crate::{
    lease::{Availability, Outcome},
    outcomes::{DomainStats, Failure, Failures, ProxyOutcomes, Quantiles, Stats},
};

/// The name of the bearer-token security scheme.
pub(crate) const BEARER: &str = "bearer";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "egress-proxies-operator discovery API",
        description = "Crawlers list proxies and lease them: acquire, renew, release, and report \
            their requests' outcomes. Every error \
            is `{\"error\":{\"code\",\"message\"}}` with a stable code, including those the HTTP layer \
            answers before any operation is chosen (the `HttpLayer*` responses in components, \
            which may answer any request; the connection is then closed), `not_found` for a path \
            that names no operation and `method_not_allowed` (with `Allow`) for a wrong method. \
            docs/api.md tells the rules (expiry, cooldowns, fencing, Retry-After).",
        license(name = "Apache-2.0"),
    ),
    paths(
        super::handlers::healthz,
        super::handlers::readyz,
        super::handlers::metrics,
        openapi_json,
        super::handlers::list,
        super::handlers::leases_list,
        super::leases::acquire,
        super::leases::renew,
        super::leases::release,
        super::outcomes::report_outcome,
        super::usage::usage,
    ),
    components(schemas(
        AcquireBody,
        RenewBody,
        ReleaseBody,
        AcquireResponse,
        RenewResponse,
        ReleaseResponse,
        ListResponse,
        LeasesResponse,
        LeaseJson,
        ProxyJson,
        StatusBody,
        ErrorBody,
        ErrorDetail,
        Outcome,
        Availability,
        OutcomeBody,
        OutcomeResponse,
        ProxyOutcomes,
        DomainStats,
        Stats,
        Failures,
        Failure,
        Quantiles,
        UsageResponse,
        TokenUsageJson,
        HolderUsageJson,
        UsageCounters,
        QuotaJson,
        QuotaUse
    )),
    modifiers(&Components),
    tags((name = "leases", description = "Listing and leasing proxies"), (name = "operations", description = "Probes, metrics, this contract")),
)]
struct ApiDoc;

/// Adds the bearer scheme and the responses that no single operation owns.
struct Components;

impl Modify for Components {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(BEARER, SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
        let error = |description: &str| {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name("Error"))))
                        .build(),
                )
                .build()
        };
        for (name, description) in [
            (
                "HttpLayerBadRequest",
                "400 `malformed_request`: the request is not valid HTTP/1 (request line, header, \
                 Content-Length, Transfer-Encoding, chunking)",
            ),
            (
                "HttpLayerUriTooLong",
                "414 `uri_too_long`: the request URI is over 64 KiB",
            ),
            (
                "HttpLayerHeadersTooLarge",
                "431 `headers_too_large`: more than 100 headers or a head over ~400 KiB",
            ),
            ("NotFound", "404 `not_found`: no operation at this path"),
            (
                "MethodNotAllowed",
                "405 `method_not_allowed`: the path has no operation for this method; `Allow` names the one it has",
            ),
        ] {
            components
                .responses
                .insert(name.to_owned(), RefOr::T(error(description)));
        }
        add_lease_links(openapi);
    }
}

/// OpenAPI links from a granted or renewed lease to its renew and release, carrying its ID and
/// latest fencing token: what a client (or a stateful test) chains. None lead to outcome
/// reports, which change nothing of a lease: the stateful test's steps go to the operations
/// that do.
fn add_lease_links(openapi: &mut utoipa::openapi::OpenApi) {
    let token = "$response.body#/fencingToken";
    let link = |operation: &str, lease_id: &str, body: serde_json::Value, description: String| {
        RefOr::T(
            LinkBuilder::new()
                .operation_id(operation)
                .parameter("leaseId", lease_id)
                .request_body(Some(body))
                .description(description)
                .build(),
        )
    };
    let chained = [
        (
            "/v1/leases",
            "201",
            "$response.body#/leaseId",
            "the granted lease",
        ),
        (
            "/v1/leases/{leaseId}/renew",
            "200",
            "$request.path.leaseId",
            "the renewed lease",
        ),
    ];
    for (path, status, lease_id, what) in chained {
        let Some(RefOr::T(response)) = (openapi.paths.paths.get_mut(path))
            .and_then(|item| item.post.as_mut())
            .and_then(|operation| operation.responses.responses.get_mut(status))
        else {
            continue;
        };
        let renew = serde_json::json!({"fencingToken": token});
        let release = serde_json::json!({"fencingToken": token, "outcome": "ok"});
        let links = &mut response.links;
        links.insert(
            "renew".to_owned(),
            link("renew", lease_id, renew, format!("Renew {what}")),
        );
        links.insert(
            "release".to_owned(),
            link("release", lease_id, release, format!("Release {what}")),
        );
    }
}

/// The contract as a value.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The contract as pretty-printed JSON with a final newline (what `docs/openapi.json` holds).
pub fn json() -> String {
    let mut text = document()
        .to_pretty_json()
        .expect("the OpenAPI document is plain data and always serializes");
    text.push('\n');
    text
}

/// The served bytes, rendered once.
pub(crate) fn served() -> Bytes {
    static JSON: OnceLock<Bytes> = OnceLock::new();
    JSON.get_or_init(|| Bytes::from(json())).clone()
}

/// This contract (OpenAPI 3.1). Needs no token.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI document", body = Object)),
)]
pub(super) fn openapi_json() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(served()));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
