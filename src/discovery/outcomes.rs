//! `POST /v1/leases/{id}/outcomes`: a lease's holder reports what one of its requests through
//! the proxy did, for the outcome statistics ([`crate::outcomes`]) that the gateway feeds with
//! what it sees itself. Fenced as a renewal is (a released, expired or foreign lease ID, or a
//! stale token, is refused with the errors a renewal gets), and it changes nothing of the lease.

use std::time::Duration;

use hyper::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use super::{
    ErrorBody, StateInner,
    handlers::{AuthErrors, LeaseIdErrors, LeaseIdPath},
    leases::not_before,
    request::leases,
    router::{Answer, json},
    wire::OutcomeBody,
};
use crate::outcomes::{Ended, Seen};

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
