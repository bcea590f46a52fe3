//! JSON bodies of the discovery API. Requests reject unknown fields; field names are camelCase.
//! Their `ToSchema` derives are the OpenAPI contract's schemas (`super::openapi`): the doc
//! comments are its descriptions, the `schema` attributes its limits.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use utoipa::{
    ToSchema,
    openapi::{ObjectBuilder, Type, schema::Object},
};

pub(crate) use self::json::proxy_json;
use super::terms::SelectorTerms;
use crate::{
    api::Attributes,
    lease::{Availability, Outcome, ProxyInfo, ProxyView, Rfc3339, rfc3339},
    outcomes::{Failure, ProxyOutcomes},
};

mod json;

/// Longest lease TTL a request may ask for (the proxy's `maxTtlSeconds` caps it further).
pub const MAX_TTL_SECONDS: u64 = 86_400;
/// Longest holder name.
pub const MAX_HOLDER_LEN: usize = 128;
/// Longest sticky-session key.
pub const MAX_SESSION_KEY_LEN: usize = 256;
/// Longest target domain.
pub const MAX_DOMAIN_LEN: usize = 253;
/// Longest request ID.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// Longest selector key (an attribute key: optional DNS prefix, '/', name).
pub const MAX_SELECTOR_KEY_LEN: usize = 317;
/// Longest selector value.
pub const MAX_SELECTOR_VALUE_LEN: usize = 256;
/// Most selector terms in a request body.
pub const MAX_SELECTOR_TERMS: usize = crate::lease::MAX_SELECTOR_TERMS;

/// `POST /v1/leases`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireBody<'a> {
    /// Required attributes (all must match); empty or absent: any proxy. At most 32; keys of
    /// 1-317 characters, values of at most 256.
    #[serde(default, borrow)]
    #[schema(schema_with = selector_schema)]
    pub selector: SelectorTerms<'a>,
    /// Who holds the lease: 1-128 printable characters.
    #[serde(borrow)]
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$"
    )]
    pub holder: Cow<'a, str>,
    /// Lease length in seconds; default 60, capped by the proxy's `lease.maxTtlSeconds`. A
    /// whole number written with a fraction or an exponent (`60.0`, `6e1`) counts as one.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 1, maximum = 86400)]
    pub ttl_seconds: Option<u64>,
    /// The domain to be crawled through the proxy: proxies banned for it are skipped.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$")]
    pub target_domain: Option<String>,
    /// Sticky-session key: 1-256 printable characters.
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$"
    )]
    pub session_key: Option<String>,
    /// Makes the acquire safe to send again (1-128 printable characters, e.g. a UUID): while
    /// the lease an acquire with this `requestId` and `holder` was granted is active, sending
    /// it again answers that lease (the same `leaseId`, its current token and expiry) instead
    /// of granting another. The rest of the repeated body is not compared.
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$"
    )]
    pub request_id: Option<String>,
}

/// The body selector's schema: what `AcquireBody::validate` checks of it.
fn selector_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "Required attributes (all must match); empty or absent: any proxy. At most 32; keys \
             of 1-317 characters, values of at most 256.",
        ))
        .max_properties(Some(MAX_SELECTOR_TERMS))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
                .max_length(Some(MAX_SELECTOR_KEY_LEN)),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(MAX_SELECTOR_VALUE_LEN)),
        ))
        .build()
}

/// A JSON number that is a whole number of at most `u64::MAX`, however it is written: JSON
/// Schema's `integer` (the contract's type) includes `60.0` and `6e1`, which serde's `u64`
/// refuses.
pub(super) fn whole_number<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct Whole;
    impl serde::de::Visitor<'_> for Whole {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a non-negative whole number")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
        }
        fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<u64, E> {
            // 2^64 is the first f64 past u64::MAX; every f64 below it with no fraction fits.
            if v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v) {
                Ok(v as u64)
            } else {
                Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
            }
        }
    }
    deserializer.deserialize_any(Whole)
}

/// [`whole_number`] for an optional field (`null` is absent).
pub(super) fn whole_seconds<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrapped(#[serde(deserialize_with = "whole_number")] u64);
    Ok(Option::<Wrapped>::deserialize(deserializer)?.map(|Wrapped(v)| v))
}

fn printable(s: &str) -> bool {
    !s.chars().any(char::is_control)
}

/// Whether `s` has 1 to `max` characters (Unicode scalar values, as the docs count them: a
/// byte count would turn 100 × "é" into 200).
fn chars_within(s: &str, max: usize) -> bool {
    // Each character takes 1 to 4 bytes: most strings are decided without counting.
    !s.is_empty() && (s.len() <= max || (s.len() <= 4 * max && s.chars().count() <= max))
}

/// A `targetDomain` query parameter, checked as the request bodies' are.
pub(crate) fn check_domain(d: &str) -> Result<(), String> {
    if valid_domain(d) {
        Ok(())
    } else {
        Err("targetDomain must be a host name".to_owned())
    }
}

fn valid_domain(d: &str) -> bool {
    !d.is_empty()
        && d.len() <= MAX_DOMAIN_LEN
        && d.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
}

/// A request body: its JSON shape is serde's to check, the rest (lengths, ranges, formats the
/// contract states) is `validate`'s, run as it is decoded, so a handler only sees valid ones.
pub trait RequestBody {
    /// What is wrong with it, in words that say what to fix.
    fn validate(&self) -> Result<(), String>;
}

fn valid_ttl(ttl_seconds: Option<u64>) -> Result<(), String> {
    if ttl_seconds.is_some_and(|t| t == 0 || t > MAX_TTL_SECONDS) {
        return Err(format!("ttlSeconds must be between 1 and {MAX_TTL_SECONDS}"));
    }
    Ok(())
}

impl RequestBody for AcquireBody<'_> {
    fn validate(&self) -> Result<(), String> {
        if !chars_within(&self.holder, MAX_HOLDER_LEN) || !printable(&self.holder) {
            return Err(format!("holder must be 1-{MAX_HOLDER_LEN} printable characters"));
        }
        valid_ttl(self.ttl_seconds)?;
        self.target_domain.as_deref().map_or(Ok(()), check_domain)?;
        if let Some(k) = &self.session_key
            && (!chars_within(k, MAX_SESSION_KEY_LEN) || !printable(k))
        {
            return Err(format!(
                "sessionKey must be 1-{MAX_SESSION_KEY_LEN} printable characters"
            ));
        }
        if let Some(id) = &self.request_id
            && (!chars_within(id, MAX_REQUEST_ID_LEN) || !printable(id))
        {
            return Err(format!(
                "requestId must be 1-{MAX_REQUEST_ID_LEN} printable characters"
            ));
        }
        if self.selector.len() > MAX_SELECTOR_TERMS
            || self.selector.iter().any(|(k, v)| {
                !chars_within(k, MAX_SELECTOR_KEY_LEN)
                    || !v.is_empty() && !chars_within(v, MAX_SELECTOR_VALUE_LEN)
            })
        {
            return Err(format!(
                "selector must have at most {MAX_SELECTOR_TERMS} attributes, keys of 1-{MAX_SELECTOR_KEY_LEN} and values of at most {MAX_SELECTOR_VALUE_LEN} characters"
            ));
        }
        Ok(())
    }
}

/// `POST /v1/leases/{id}/renew`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewBody {
    /// The lease's latest fencing token (a whole number however written: `7`, `7.0`).
    #[serde(deserialize_with = "whole_number")]
    pub fencing_token: u64,
    /// New length in seconds from now; default: the lease's own TTL.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 1, maximum = 86400)]
    pub ttl_seconds: Option<u64>,
}

impl RequestBody for RenewBody {
    fn validate(&self) -> Result<(), String> {
        valid_ttl(self.ttl_seconds)
    }
}

/// `POST /v1/leases/{id}/release`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseBody {
    /// The lease's latest fencing token (a whole number however written: `7`, `7.0`).
    #[serde(deserialize_with = "whole_number")]
    pub fencing_token: u64,
    /// How it went.
    pub outcome: Outcome,
    /// For `banned`: the domain that banned the proxy (default: the lease's target domain).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$")]
    pub target_domain: Option<String>,
}

impl RequestBody for ReleaseBody {
    fn validate(&self) -> Result<(), String> {
        self.target_domain.as_deref().map_or(Ok(()), check_domain)
    }
}

/// `POST /v1/leases/{id}/outcomes`: how one request through the leased proxy went. With
/// `error`, it failed that way; else with `status`, the target answered it (400 and above
/// count as failures); with neither, it went well (e.g. a tunnel whose status nobody saw).
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutcomeBody {
    /// The lease's latest fencing token (a whole number however written: `7`, `7.0`).
    #[serde(deserialize_with = "whole_number")]
    pub fencing_token: u64,
    /// The request's target host (lowercase or not, without a final dot or not).
    #[schema(min_length = 1, max_length = 253, pattern = "^[A-Za-z0-9._-]+$")]
    pub target_domain: String,
    /// The target's status code.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 100, maximum = 599)]
    pub status: Option<u64>,
    /// It failed: `connect` (no connection to the proxy), `timeout`, `reset` (the connection
    /// broke), `proxy_error` (the proxy answered itself: Squid's error page); `client_error`
    /// and `server_error` are what 4xx and 5xx statuses count as.
    #[serde(default)]
    pub error: Option<Failure>,
    /// Milliseconds until the answer's head (or the tunnel's opening).
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 0)]
    pub latency_ms: Option<u64>,
    /// Bytes received from the target.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 0)]
    pub bytes_received: Option<u64>,
    /// Bytes sent to the target.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 0)]
    pub bytes_sent: Option<u64>,
}

impl RequestBody for OutcomeBody {
    fn validate(&self) -> Result<(), String> {
        check_domain(&self.target_domain)?;
        if self.status.is_some_and(|s| !(100..=599).contains(&s)) {
            return Err("status must be an HTTP status code, 100 to 599".to_owned());
        }
        Ok(())
    }
}

// Borrows from the store's proxy info: an answer serializes it without copying.
/// A proxy in responses (never with credentials).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(as = Proxy)]
pub struct ProxyJson<'a> {
    /// `namespace/name`.
    pub key: &'a str,
    /// Namespace.
    pub namespace: &'a str,
    /// Name.
    pub name: &'a str,
    /// `host:port`.
    pub endpoint: &'a str,
    /// Attributes.
    #[schema(value_type = BTreeMap<String, String>)]
    pub attributes: &'a Attributes,
    /// In listings: how it stands.
    pub availability: Option<Availability>,
    /// In listings: active leases.
    pub active_leases: Option<usize>,
    /// In listings: its limit.
    pub max_concurrent: Option<u32>,
    /// In listings: end of its cooldown (RFC 3339), while it rests.
    #[schema(format = DateTime)]
    pub cooldown_until: Option<String>,
    /// In listings: its active per-domain bans, by domain (a banned proxy is skipped for that
    /// domain only).
    pub bans: Option<Vec<BanJson>>,
    /// In listings, once an outcome was recorded: what went through it (the gateway's requests
    /// and the outcomes crawlers reported), in total and for its busiest domains.
    pub outcomes: Option<ProxyOutcomes>,
}

/// A proxy's ban for one target domain.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BanJson {
    /// The domain (lowercase, without a final dot).
    pub domain: String,
    /// When the ban ends (RFC 3339).
    #[schema(format = DateTime)]
    pub until: String,
}

impl<'a> ProxyJson<'a> {
    /// The proxy as an acquire response shows it.
    pub fn from_info(info: &'a ProxyInfo) -> Self {
        Self {
            key: info.key.as_str(),
            namespace: info.key.namespace(),
            name: info.key.name(),
            endpoint: &info.endpoint_text,
            attributes: &info.attributes,
            availability: None,
            active_leases: None,
            max_concurrent: None,
            cooldown_until: None,
            bans: None,
            outcomes: None,
        }
    }

    /// The proxy as a listing shows it.
    pub fn from_view(view: &'a ProxyView) -> Self {
        Self {
            availability: Some(view.availability),
            active_leases: Some(view.active_leases),
            max_concurrent: Some(view.max_concurrent),
            cooldown_until: view.cooldown_until_ms.map(rfc3339),
            bans: Some(
                (view.bans.iter())
                    .map(|(domain, until)| BanJson {
                        domain: domain.clone(),
                        until: rfc3339(*until),
                    })
                    .collect(),
            ),
            ..Self::from_info(&view.info)
        }
    }
}

/// Leases one `GET /v1/leases` page holds at the most, and when `limit` names none.
pub const MAX_LEASES_PAGE: usize = 1000;
/// See [`MAX_LEASES_PAGE`].
pub const DEFAULT_LEASES_PAGE: usize = 100;

/// A lease in `GET /v1/leases` (never its ID or token: those are its holder's).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(as = LeaseInfo)]
pub struct LeaseJson {
    /// The proxy it is on (`namespace/name`).
    pub proxy: String,
    /// Who holds it.
    pub holder: String,
    /// When it was granted (RFC 3339).
    #[schema(format = DateTime)]
    pub acquired_at: String,
    /// When it ends unless renewed (RFC 3339).
    #[schema(format = DateTime)]
    pub expires_at: String,
    /// The domain it was acquired for.
    pub target_domain: Option<String>,
    /// Its sticky-session key.
    pub session_key: Option<String>,
}

/// `GET /v1/leases`.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeasesResponse {
    /// Active leases, by proxy key then age.
    pub leases: Vec<LeaseJson>,
    /// The `after` of the next page; absent on the last page.
    pub next: Option<String>,
}

/// `GET /v1/proxies`.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ListResponse<'a> {
    /// Matching proxies, by key.
    pub proxies: Vec<ProxyJson<'a>>,
}

/// `GET /healthz` and `GET /readyz` when the answer is yes.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StatusBody {
    /// `ok` (`/healthz`) or `ready` (`/readyz`).
    #[schema(pattern = "^(ok|ready)$")]
    pub status: &'static str,
}

/// A granted lease.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireResponse<'a> {
    /// Signed lease ID, for renew and release.
    pub lease_id: String,
    /// Token for the next renew or release.
    pub fencing_token: u64,
    /// `http://[user:password@]host:port`, to configure the crawler's HTTP client.
    pub proxy_url: &'a str,
    /// The proxy.
    pub proxy: ProxyJson<'a>,
    /// When it was granted (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub acquired_at: Rfc3339,
    /// When it ends unless renewed (RFC 3339): from this instant on it does not exist.
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: Rfc3339,
    /// Granted length in seconds (after the proxy's cap).
    pub ttl_seconds: u64,
    /// With a `targetDomain` that a politeness entry covers: when the holder's first request
    /// to that domain through this proxy may start (RFC 3339; now or later). The start is
    /// reserved: other holders and the gateway are spaced after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime)]
    pub not_before: Option<String>,
}

/// A renewed lease.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewResponse {
    /// Unchanged lease ID.
    pub lease_id: String,
    /// New token; the previous one is stale.
    pub fencing_token: u64,
    /// The new expiry (RFC 3339).
    #[schema(format = DateTime)]
    pub expires_at: String,
    /// `true` once the operator has taken the proxy out of rotation since it was leasable:
    /// its health checks fail (a dead or frozen instance) or it is being replaced. The lease
    /// still runs, but requests through the proxy are likely failing or hanging: move the
    /// work to a new lease and release this one (outcome `error`).
    pub out_of_rotation: bool,
}

/// A released lease.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseResponse<'a> {
    /// The lease ID.
    pub lease_id: &'a str,
    /// Always true.
    pub released: bool,
    /// The outcome recorded.
    pub outcome: Outcome,
}

/// Every error: `{"error": {"code": ..., "message": ...}}`.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Error)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// A stable code and a human message.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// Stable, documented code (see docs/api.md, "Errors").
    #[schema(schema_with = error_code_schema)]
    pub code: &'static str,
    /// What happened and what to do.
    pub message: String,
}

/// Every error code the API answers with, as docs/api.md documents them.
pub const ERROR_CODES: &[&str] = &[
    "malformed_request",
    "target_domain_required",
    "unauthorized",
    "forbidden",
    "lease_not_found",
    "not_found",
    "method_not_allowed",
    "stale_token",
    "proxy_draining",
    "payload_too_large",
    "uri_too_long",
    "headers_too_large",
    "internal",
    "no_proxy_available",
    "not_leader",
    "not_ready",
    "auth_unavailable",
    "journal_unavailable",
    "request_in_progress",
    "quota_exceeded",
];

/// The `Retry-After` of an answer that says when to ask again: whole seconds, rounded up (a
/// client that waits what it says never asks too early), at least 1. Both the API and the
/// gateway send it.
pub fn retry_after_header(after: std::time::Duration) -> hyper::header::HeaderValue {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    hyper::header::HeaderValue::from(secs.max(1))
}

fn error_code_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(ERROR_CODES.iter().copied()))
        .description(Some("Stable, documented code (see docs/api.md, \"Errors\")."))
        .build()
}
