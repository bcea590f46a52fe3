//! `GET /v1/usage`: what each token and holder used since the process started, and each
//! token's quotas ([`crate::usage`]); and the 429 `quota_exceeded` an acquire gets when its
//! token is over a quota.

use std::time::Duration;

use hyper::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use super::{
    ErrorBody, StateInner,
    handlers::{AuthErrors, NotServing, for_each_query_parameter, parse_limit},
    router::{Answer, ApiError, json},
};
use crate::usage::{Counters, QuotaExceeded, QuotaState, TokenUsage};

/// Entries per list when `limit` is not given.
const DEFAULT_LIMIT: usize = 100;
/// Most entries per list.
const MAX_LIMIT: usize = 1000;

/// What a token or holder used since the process started.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageCounters {
    /// Requests admitted: gateway requests and tunnels, lease acquires.
    pub requests: u64,
    /// Bytes through the gateway (sent and received) plus the bytes outcome reports gave.
    pub bytes: u64,
    /// Seconds leases were held, from grant to release (millisecond precision); a holder's also
    /// counts leases it never released, from grant to expiry.
    pub lease_seconds: f64,
    /// Leases released with outcome `banned`.
    pub bans: u64,
}

impl From<&Counters> for UsageCounters {
    fn from(c: &Counters) -> Self {
        Self {
            requests: c.requests,
            bytes: c.bytes,
            lease_seconds: c.lease_seconds(),
            bans: c.bans,
        }
    }
}

/// One limit of a quota: used in this window, of `limit`.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct QuotaUse {
    /// Used in the current window.
    pub used: u64,
    /// The limit per window.
    pub limit: u64,
}

/// A quota of a token, as it stands now.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaJson {
    /// The period, as the quotas file gives it (`30s`, `15m`, `1h`, `7d`).
    pub period: String,
    /// The requests limit, if the quota has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<QuotaUse>,
    /// The bytes limit, if the quota has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<QuotaUse>,
    /// When the current window ends and the counts start over (RFC 3339).
    pub resets_at: String,
}

impl From<&QuotaState> for QuotaJson {
    fn from(q: &QuotaState) -> Self {
        let used = |limit: Option<u64>, used| limit.map(|limit| QuotaUse { used, limit });
        Self {
            period: q.quota.period.clone(),
            requests: used(q.quota.requests, q.requests_used),
            bytes: used(q.quota.bytes, q.bytes_used),
            resets_at: q.resets_at(),
        }
    }
}

/// A token's usage: named by its identity name, never its value.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsageJson {
    /// The token's name (the token file's name, the Kubernetes user, or `anonymous`).
    pub token: String,
    /// What it used since the process started.
    #[serde(flatten)]
    pub counters: UsageCounters,
    /// Its quotas.
    pub quotas: Vec<QuotaJson>,
}

/// A holder's usage.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HolderUsageJson {
    /// The holder.
    pub holder: String,
    /// What it used since the process started.
    #[serde(flatten)]
    pub counters: UsageCounters,
}

/// `GET /v1/usage`.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageResponse {
    /// Tokens, most requests first (then most bytes, then by name), at most `limit`.
    pub tokens: Vec<TokenUsageJson>,
    /// Holders, in the same order, at most `limit`.
    pub holders: Vec<HolderUsageJson>,
    /// Tokens tracked (or with a quota) in all.
    pub tokens_total: u64,
    /// Holders tracked in all.
    pub holders_total: u64,
}

/// Usage per token and holder since the process started, and each token's quotas.
#[utoipa::path(
    get,
    path = "/v1/usage",
    tag = "leases",
    params(("limit" = Option<usize>, Query, minimum = 1, maximum = 1000,
        description = "Entries per list, the most requests first (default 100)")),
    responses(
        (status = 200, description = "Usage per token and per holder", body = UsageResponse),
        (status = 400, description = "`malformed_request`: a bad limit or an unknown query parameter", body = ErrorBody),
        AuthErrors,
        NotServing,
    ),
    security(("bearer" = [])),
)]
pub(super) fn usage(s: &StateInner, parts: &hyper::http::request::Parts, now: u64) -> Answer {
    let mut limit = DEFAULT_LIMIT;
    for_each_query_parameter(parts, |k, v| {
        if k != "limit" {
            return Ok(false);
        }
        limit = parse_limit(&v, MAX_LIMIT)?;
        Ok(true)
    })?;
    let tokens = s.deps.usage.tokens(now);
    let holders = s.deps.usage.holders();
    let body = UsageResponse {
        tokens_total: tokens.len() as u64,
        holders_total: holders.len() as u64,
        tokens: (tokens.iter().take(limit))
            .map(|t: &TokenUsage| TokenUsageJson {
                token: t.token.clone(),
                counters: (&t.counters).into(),
                quotas: t.quotas.iter().map(QuotaJson::from).collect(),
            })
            .collect(),
        holders: (holders.iter().take(limit))
            .map(|(holder, counters)| HolderUsageJson {
                holder: holder.clone(),
                counters: counters.into(),
            })
            .collect(),
    };
    Ok(json(StatusCode::OK, &body))
}

impl From<QuotaExceeded> for ApiError {
    fn from(over: QuotaExceeded) -> Self {
        let after = Duration::from_millis(over.retry_after_ms).max(Duration::from_secs(1));
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", over.to_string()).retry(after)
    }
}
