//! `POST /v1/leases/{id}/outcomes`: a lease's holder reports what one of its requests through
//! the proxy did, for the outcome statistics ([`crate::outcomes`]) that the gateway feeds with
//! what it sees itself. Fenced as a renewal is (a released, expired or foreign lease ID, or a
//! stale token, is refused with the errors a renewal gets), and it changes nothing of the lease.

use std::time::Duration;

use hyper::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    ErrorBody, StateInner,
    handlers::{AuthErrors, LeaseIdErrors, LeaseIdPath},
    leases::not_before,
    request::leases,
    router::{Answer, json},
    wire::{RequestBody, check_domain, whole_number, whole_seconds},
};
use crate::outcomes::{Ended, Failure, Seen};

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

/// A recorded outcome.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutcomeResponse {
    /// The lease ID.
    pub lease_id: String,
    /// The leased proxy (`namespace/name`) the outcome is recorded against.
    pub proxy: String,
    /// The domain it is recorded for (lowercase, without a final dot).
    pub target_domain: String,
    /// Always true.
    pub recorded: bool,
    /// When a politeness entry covers the proxy and domain: when the holder's next request to
    /// that domain through this proxy may start (RFC 3339; now or later), reserved like an
    /// acquire's.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = DateTime)]
    pub not_before: Option<String>,
}

/// Records how one request through the leased proxy went; the lease is unchanged.
#[utoipa::path(
    post,
    path = "/v1/leases/{leaseId}/outcomes",
    tag = "leases",
    params(LeaseIdPath),
    request_body(content = OutcomeBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Recorded in the proxy's statistics for the domain (and, under a \
            politeness entry, when the next request to it may start)", body = OutcomeResponse),
        (status = 400, description = "`malformed_request`", body = ErrorBody),
        AuthErrors,
        (status = 409, description = "`stale_token`", body = ErrorBody),
        LeaseIdErrors,
    ),
    security(("bearer" = [])),
)]
pub(super) fn report_outcome(
    s: &StateInner,
    identity: &super::Identity,
    id: &str,
    req: OutcomeBody,
    now: u64,
) -> Answer {
    let lease = leases(s).check(id, req.fencing_token, now)?;
    let ended = match (req.error, req.status) {
        (Some(failure), _) => Ended::Failed(failure),
        (None, Some(status)) => Ended::Status(u16::try_from(status).unwrap_or(u16::MAX)),
        (None, None) => Ended::Succeeded,
    };
    let seen = Seen {
        ended,
        latency: req.latency_ms.map(Duration::from_millis),
        bytes_received: req.bytes_received.unwrap_or(0),
        bytes_sent: req.bytes_sent.unwrap_or(0),
        banned: false,
    };
    s.deps
        .outcomes
        .record(&lease.proxy, &req.target_domain, &seen, now);
    let bytes = seen.bytes_sent.saturating_add(seen.bytes_received);
    (s.deps.usage).add_bytes(&identity.name, &lease.holder, bytes, now);
    Ok(json(
        StatusCode::OK,
        &OutcomeResponse {
            lease_id: id.to_owned(),
            proxy: lease.proxy.to_string(),
            target_domain: crate::outcomes::normalize_domain(&req.target_domain),
            recorded: true,
            not_before: if s.deps.politeness.is_off() {
                None
            } else {
                (s.deps.store.view_at(&lease.proxy, now))
                    .and_then(|view| not_before(s, &view.info, &req.target_domain, now))
            },
        },
    ))
}
