//! Usage metering and quotas per token and per holder: requests, bytes, lease-seconds and bans
//! caused, counted where the gateway and the lease API do the work, and the quotas per token
//! (`--quotas FILE`, [`quota`]) that refuse new work with 429 once a token used its share of a
//! window. Documented in docs/gateway.md ("Usage and quotas") and docs/api.md (`GET /v1/usage`).
//!
//! It owns the numbers, their bounds and the quota decisions; it names no mode and takes no
//! lease decision. A token is named by its identity name ([`crate::discovery::Identity::name`],
//! `anonymous` without authentication), never by its value. Memory is bounded: at most
//! [`MAX_TOKENS`] tokens and [`MAX_HOLDERS`] holders ([`table`]), the least recently seen
//! evicted first. Counters live in memory since the process started: a restart (or a leader
//! change) starts them over, quota windows included.
//!
//! Served by `GET /v1/usage`, `/metrics` ([`metrics`]: per token only) and the status page.

pub mod metrics;
pub mod quota;
mod table;

#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};

use serde::Serialize;

pub use self::quota::{Quota, QuotaError, Quotas};
use self::{quota::Windows, table::Table};
use crate::{lease::rfc3339, sync::lock};

/// Most tokens tracked (configured tokens and TokenReview users are few; the cap guards
/// against a cluster with many service accounts).
pub const MAX_TOKENS: usize = 10_000;
/// Most holders tracked (holders are whatever crawlers name themselves: an open set).
pub const MAX_HOLDERS: usize = 10_000;

/// What one token or holder used since the process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Counters {
    /// Requests admitted: gateway requests and tunnels, lease API acquires.
    pub requests: u64,
    /// Bytes through the gateway (sent and received) plus what outcome reports said.
    pub bytes: u64,
    /// Time leases were held, from grant to release, in milliseconds (served in seconds); a
    /// holder's also counts leases it never released, from grant to expiry.
    #[serde(skip)]
    pub lease_ms: u64,
    /// Leases released with outcome `banned`.
    pub bans: u64,
}

impl Counters {
    /// Lease time in seconds.
    pub fn lease_seconds(&self) -> f64 {
        self.lease_ms as f64 / 1000.0
    }
}

/// A token over one of its quotas: what the 429 says.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("token {token} used {used} of its {limit} {what} per {period}; it resets at {resets_at}")]
pub struct QuotaExceeded {
    /// The token's name.
    pub token: String,
    /// What it used in this window.
    pub used: u64,
    /// Its limit.
    pub limit: u64,
    /// `requests` or `bytes`.
    pub what: &'static str,
    /// The period as the file wrote it (`1h`).
    pub period: String,
    /// When the window ends (RFC 3339).
    pub resets_at: String,
    /// Milliseconds until the window ends.
    pub retry_after_ms: u64,
}

/// One quota of a token as it stands now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaState {
    /// The quota.
    pub quota: Quota,
    /// Requests used in the current window.
    pub requests_used: u64,
    /// Bytes used in the current window.
    pub bytes_used: u64,
    /// When the current window ends (ms since the epoch).
    pub resets_at_ms: u64,
}

/// A token's usage and its quotas.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenUsage {
    /// The token's name.
    pub token: String,
    /// Its counters.
    pub counters: Counters,
    /// Its quotas, as they stand now.
    pub quotas: Vec<QuotaState>,
}

struct Inner {
    tokens: Table,
    holders: Table,
    windows: Windows,
}

/// Usage per token and per holder, and the quotas; cheap to clone.
#[derive(Clone)]
pub struct Usage(Arc<Mutex<Inner>>);

impl Default for Usage {
    fn default() -> Self {
        Self::with_limits(MAX_TOKENS, MAX_HOLDERS)
    }
}

impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Usage")
    }
}

impl Usage {
    /// Usage tracking at most `tokens` tokens and `holders` holders.
    pub fn with_limits(tokens: usize, holders: usize) -> Self {
        Self(Arc::new(Mutex::new(Inner {
            tokens: Table::new(tokens),
            holders: Table::new(holders),
            windows: Windows::default(),
        })))
    }

    /// Enforces `quotas` from now on (set once at start; replaces any before).
    pub fn set_quotas(&self, quotas: Quotas) {
        lock(&self.0).windows = Windows::new(quotas);
    }

    /// New work for `token` on behalf of `holder` at `now_ms`: refused if the token is over a
    /// quota, else counted as one request (for the token, the holder and the token's quota
    /// windows) at once, so concurrent requests cannot overrun a quota.
    pub fn admit(&self, token: &str, holder: &str, now_ms: u64) -> Result<(), QuotaExceeded> {
        let mut inner = lock(&self.0);
        inner.windows.check(token, now_ms)?;
        inner.windows.add(token, 1, 0, now_ms);
        inner.tokens.add(token, |c| c.requests += 1);
        inner.holders.add(holder, |c| c.requests += 1);
        Ok(())
    }

    /// `bytes` went through for `token` and `holder` (counted in the byte quotas' windows too).
    pub fn add_bytes(&self, token: &str, holder: &str, bytes: u64, now_ms: u64) {
        if bytes == 0 {
            return;
        }
        let mut inner = lock(&self.0);
        inner.windows.add(token, 0, bytes, now_ms);
        inner
            .tokens
            .add(token, |c| c.bytes = c.bytes.saturating_add(bytes));
        inner
            .holders
            .add(holder, |c| c.bytes = c.bytes.saturating_add(bytes));
    }

    /// A lease of `holder`, released by `token`, was held `held_ms`; `banned`: it ended banned.
    pub fn lease_ended(&self, token: &str, holder: &str, held_ms: u64, banned: bool) {
        let add = |c: &mut Counters| {
            c.lease_ms = c.lease_ms.saturating_add(held_ms);
            c.bans += u64::from(banned);
        };
        let mut inner = lock(&self.0);
        inner.tokens.add(token, add);
        inner.holders.add(holder, add);
    }

    /// A lease of `holder` ended at its expiry after `held_ms`, never released: its time counts
    /// for the holder (no token released it, and the store does not know which took it).
    pub fn lease_expired(&self, holder: &str, held_ms: u64) {
        lock(&self.0)
            .holders
            .add(holder, |c| c.lease_ms = c.lease_ms.saturating_add(held_ms));
    }

    /// Every token tracked or with a quota, most requests first, at `now_ms`.
    pub fn tokens(&self, now_ms: u64) -> Vec<TokenUsage> {
        let inner = lock(&self.0);
        let mut all: Vec<TokenUsage> = inner
            .tokens
            .iter()
            .map(|(token, counters)| TokenUsage {
                token: token.to_owned(),
                counters: *counters,
                quotas: inner.windows.states(token, now_ms),
            })
            .collect();
        for token in inner.windows.tokens() {
            if inner.tokens.get(token).is_none() {
                all.push(TokenUsage {
                    token: token.to_owned(),
                    counters: Counters::default(),
                    quotas: inner.windows.states(token, now_ms),
                });
            }
        }
        all.sort_by(|a, b| {
            (b.counters.requests, b.counters.bytes)
                .cmp(&(a.counters.requests, a.counters.bytes))
                .then_with(|| a.token.cmp(&b.token))
        });
        all
    }

    /// Every holder tracked, most requests first.
    pub fn holders(&self) -> Vec<(String, Counters)> {
        let inner = lock(&self.0);
        let mut all: Vec<(String, Counters)> = inner
            .holders
            .iter()
            .map(|(holder, counters)| (holder.to_owned(), *counters))
            .collect();
        all.sort_by(|a, b| {
            (b.1.requests, b.1.bytes)
                .cmp(&(a.1.requests, a.1.bytes))
                .then_with(|| a.0.cmp(&b.0))
        });
        all
    }

    /// How many tokens and holders are tracked.
    pub fn tracked(&self) -> (usize, usize) {
        let inner = lock(&self.0);
        (inner.tokens.len(), inner.holders.len())
    }

    /// One holder's counters, if tracked.
    pub fn holder(&self, holder: &str) -> Option<Counters> {
        lock(&self.0).holders.get(holder)
    }

    /// One token's counters, if tracked.
    pub fn token(&self, token: &str) -> Option<Counters> {
        lock(&self.0).tokens.get(token)
    }
}

impl QuotaState {
    /// When the window ends, RFC 3339.
    pub fn resets_at(&self) -> String {
        rfc3339(self.resets_at_ms)
    }
}
