//! The lease calls: acquire, renew and release. Each parses, calls one
//! [`crate::lease::DurableLeases`] operation and answers; the selector a connection asked for
//! last is kept compiled.

use std::{sync::Arc, time::Duration};

use hyper::StatusCode;

use super::{
    AcquireBody, AcquireResponse, ErrorBody, Identity, ProxyJson, ReleaseBody, ReleaseResponse, RenewBody,
    RenewResponse, StateInner,
    handlers::{AuthErrors, LeaseIdErrors, LeaseIdPath},
    metrics::CodeLabels,
    request::leases,
    router::{Answer, json, json_bytes},
    terms::SelectorTerms,
    wire::{self},
};
use crate::lease::{
    AcquireRequest, Acquired, CompiledSelector, DurableError, LeaseStore, Outcome, Rfc3339, Selector, rfc3339,
};

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
    let body = ReleaseResponse {
        lease_id: id,
        released: true,
        outcome: req.outcome,
    };
    let mut bytes = Vec::with_capacity(body.json_len());
    body.write_json(&mut bytes);
    Ok(json_bytes(StatusCode::OK, bytes))
}
