//! The page's "Usage" section: the busiest tokens (with their quotas) and holders, from
//! [`crate::usage`]. Tokens are shown by name, never by value.

use std::fmt::Write as _;

use crate::{
    markup::escape as esc,
    usage::{Counters, TokenUsage, Usage},
};

/// Tokens and holders the page lists (the busiest; `GET /v1/usage` has them all).
pub const USAGE_ROWS: usize = 5;

/// What the page shows of usage.
#[derive(Clone, Debug, Default)]
pub struct UsageView {
    /// The busiest tokens, most requests first.
    pub tokens: Vec<TokenUsage>,
    /// The busiest holders, most requests first.
    pub holders: Vec<(String, Counters)>,
    /// Tokens tracked in all.
    pub tokens_total: usize,
    /// Holders tracked in all.
    pub holders_total: usize,
}

impl UsageView {
    /// The busiest of `usage` at `now_ms`.
    pub fn of(usage: &Usage, now_ms: u64) -> Self {
        let (tokens, holders) = (usage.tokens(now_ms), usage.holders());
        Self {
            tokens_total: tokens.len(),
            holders_total: holders.len(),
            tokens: tokens.into_iter().take(USAGE_ROWS).collect(),
            holders: holders.into_iter().take(USAGE_ROWS).collect(),
        }
    }
}

/// The section; nothing before anything was used or any quota set.
pub(super) fn section(html: &mut String, view: &UsageView) {
    if view.tokens.is_empty() && view.holders.is_empty() {
        return;
    }
    html.push_str(
        "<h2>Usage</h2><table id=\"usage\"><thead><tr><th>token or holder</th><th>requests</th>\
         <th>bytes</th><th>lease-seconds</th><th>bans</th><th>quotas</th></tr></thead><tbody>",
    );
    for t in &view.tokens {
        let quotas: Vec<String> = t
            .quotas
            .iter()
            .map(|q| {
                let mut limits = Vec::new();
                if let Some(limit) = q.quota.requests {
                    limits.push(format!("{} / {limit} requests", q.requests_used));
                }
                if let Some(limit) = q.quota.bytes {
                    limits.push(format!("{} / {limit} bytes", q.bytes_used));
                }
                esc(&format!(
                    "{} per {}, resets {}",
                    limits.join(", "),
                    q.quota.period,
                    q.resets_at()
                ))
            })
            .collect();
        row(html, "token", &t.token, &t.counters, &quotas.join("<br>"));
    }
    for (holder, counters) in &view.holders {
        row(html, "holder", holder, counters, "");
    }
    let _ = write!(
        html,
        "</tbody></table><div class=\"muted\">the busiest of {} tokens and {} holders (at most \
         {USAGE_ROWS} each) since the operator started; all in <code>GET /v1/usage</code></div>",
        view.tokens_total, view.holders_total
    );
}

/// One row; `quotas` is HTML already escaped.
fn row(html: &mut String, kind: &str, name: &str, c: &Counters, quotas: &str) {
    let _ = write!(
        html,
        "<tr><td><span class=\"muted\">{kind}</span> <code>{}</code></td><td>{}</td><td>{}</td>\
         <td>{:.1}</td><td>{}</td><td>{}</td></tr>",
        esc(name),
        c.requests,
        c.bytes,
        c.lease_seconds(),
        c.bans,
        quotas
    );
}
