//! Outcome statistics per proxy × target domain: what happened to the requests that went
//! through each proxy, as the gateway saw them (statuses, failures, latency, bytes) and as lease
//! API clients report them (`POST /v1/leases/{id}/outcomes`). Documented in docs/gateway.md
//! ("Outcome statistics").
//!
//! It owns the numbers and their bounds, nothing else: it takes no lease decision (the gateway's
//! rules may read it, [`Outcomes::pair`]) and names no mode. Memory is bounded: at most
//! [`Limits::max_pairs`] (proxy, domain) pairs and [`Limits::max_domains_per_proxy`] per proxy,
//! the least recently seen pair evicted first ([`table`]); each pair's latency is a window of
//! its last [`WINDOW`] samples ([`window`]). Statistics live in memory only: a restart, or a
//! leader change, starts them afresh.
//!
//! Served by the discovery API (`GET /v1/proxies`), the status page and `/metrics`
//! ([`metrics`]: per-proxy totals only, so label cardinality stays the pool's size).

pub mod metrics;
mod table;
mod window;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use self::table::Table;
pub use self::window::{Quantiles, WINDOW};
use crate::{api::ProxyKey, lease::rfc3339, sync::lock};

/// Why a request through a proxy failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// No connection to the proxy (refused, unreachable).
    Connect,
    /// No connection, or no answer, in time.
    Timeout,
    /// The connection broke before the answer was complete (the proxy died mid-request, or
    /// the tunnel broke).
    Reset,
    /// The proxy answered itself instead of the target (Squid's error page, `X-Squid-Error`:
    /// target unreachable, access denied; or a refused `CONNECT`).
    ProxyError,
    /// The target answered 4xx.
    ClientError,
    /// The target answered 5xx.
    ServerError,
}

impl Failure {
    /// Every kind, in the order metrics and pages list them.
    pub const ALL: [Failure; 6] = [
        Failure::Connect,
        Failure::Timeout,
        Failure::Reset,
        Failure::ProxyError,
        Failure::ClientError,
        Failure::ServerError,
    ];

    /// Its name in JSON and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Reset => "reset",
            Failure::ProxyError => "proxy_error",
            Failure::ClientError => "client_error",
            Failure::ServerError => "server_error",
        }
    }
}

/// How one request (or tunnel) ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The target answered with this status: below 400 a success, else a failure
    /// ([`Failure::ClientError`], [`Failure::ServerError`]).
    Status(u16),
    /// It went well and no status is known (a tunnel that closed cleanly).
    Succeeded,
    /// It failed.
    Failed(Failure),
}

impl Ended {
    /// The failure it counts as, if any.
    pub fn failure(self) -> Option<Failure> {
        match self {
            Ended::Status(status) if status >= 500 => Some(Failure::ServerError),
            Ended::Status(status) if status >= 400 => Some(Failure::ClientError),
            Ended::Status(_) | Ended::Succeeded => None,
            Ended::Failed(failure) => Some(failure),
        }
    }
}

/// One outcome, as it is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// How it ended.
    pub ended: Ended,
    /// Until the answer's head (a request) or the tunnel's opening (`CONNECT`); `None` when
    /// nothing answered.
    pub latency: Option<Duration>,
    /// Bytes from the target to the client (an answer's body; a tunnel's bytes that way).
    pub bytes_received: u64,
    /// Bytes from the client to the target.
    pub bytes_sent: u64,
    /// A rule banned the proxy for the domain on this answer.
    pub banned: bool,
}

/// Failures, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Failures {
    /// See [`Failure::Connect`].
    pub connect: u64,
    /// See [`Failure::Timeout`].
    pub timeout: u64,
    /// See [`Failure::Reset`].
    pub reset: u64,
    /// See [`Failure::ProxyError`].
    pub proxy_error: u64,
    /// See [`Failure::ClientError`].
    pub client_error: u64,
    /// See [`Failure::ServerError`].
    pub server_error: u64,
}

impl Failures {
    /// The count of `kind`.
    pub fn of(&self, kind: Failure) -> u64 {
        match kind {
            Failure::Connect => self.connect,
            Failure::Timeout => self.timeout,
            Failure::Reset => self.reset,
            Failure::ProxyError => self.proxy_error,
            Failure::ClientError => self.client_error,
            Failure::ServerError => self.server_error,
        }
    }

    fn count(&mut self, kind: Failure) {
        let n = match kind {
            Failure::Connect => &mut self.connect,
            Failure::Timeout => &mut self.timeout,
            Failure::Reset => &mut self.reset,
            Failure::ProxyError => &mut self.proxy_error,
            Failure::ClientError => &mut self.client_error,
            Failure::ServerError => &mut self.server_error,
        };
        *n += 1;
    }

    /// Every failure.
    pub fn total(&self) -> u64 {
        Failure::ALL.iter().map(|&kind| self.of(kind)).sum()
    }
}

/// The statistics of a pair (or a proxy's totals).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Stats {
    /// Requests and tunnels: `successes` plus every failure.
    pub requests: u64,
    /// Answers below 400 and tunnels that closed cleanly.
    pub successes: u64,
    /// Failures by kind.
    pub failures: Failures,
    /// Times the proxy was banned for the domain (by the gateway's rules, or a lease released
    /// with outcome `banned`); a ban's answer counts in `failures` too.
    pub bans: u64,
    /// Median and 95th percentile of the last 64 latencies (to an answer's head, or to a
    /// tunnel's opening), in milliseconds; absent before the first.
    #[serde(rename = "latencyMs", skip_serializing_if = "Option::is_none")]
    pub latency: Option<Quantiles>,
    /// Bytes from targets to clients.
    pub bytes_received: u64,
    /// Bytes from clients to targets.
    pub bytes_sent: u64,
    /// When the last outcome was recorded (RFC 3339).
    #[serde(rename = "lastSeen", serialize_with = "as_rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub last_seen_ms: u64,
}

fn as_rfc3339<S: serde::Serializer>(ms: &u64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&rfc3339(*ms))
}

impl Stats {
    fn add(&mut self, seen: &Seen, now_ms: u64) {
        self.requests += 1;
        match seen.ended.failure() {
            Some(kind) => self.failures.count(kind),
            None => self.successes += 1,
        }
        self.bans += u64::from(seen.banned);
        self.bytes_received = self.bytes_received.saturating_add(seen.bytes_received);
        self.bytes_sent = self.bytes_sent.saturating_add(seen.bytes_sent);
        self.last_seen_ms = now_ms;
    }
}

/// One target domain's statistics on a proxy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DomainStats {
    /// The target domain (lowercase, without a final dot).
    pub domain: String,
    /// Its statistics.
    pub stats: Stats,
}

/// A proxy's statistics: its totals and its busiest domains.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schema(as = ProxyOutcomes)]
pub struct ProxyOutcomes {
    /// Over every domain, those evicted from tracking included.
    pub total: Stats,
    /// The domains with the most requests (ties: by name), at most the number asked for; then
    /// the domain asked for (`GET /v1/proxies?targetDomain=`) if tracked and not among them.
    pub domains: Vec<DomainStats>,
    /// Tracked domains not listed in `domains`.
    pub other_domains: usize,
}

/// How much it tracks at the most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// (proxy, domain) pairs; a new pair past it evicts the least recently seen tenth. A proxy
    /// whose every pair was evicted is forgotten, its totals too.
    pub max_pairs: usize,
    /// Domains per proxy; a new one past it evicts that proxy's least recently seen domain.
    pub max_domains_per_proxy: usize,
}

impl Default for Limits {
    /// 20,000 pairs and 32 domains per proxy: at most about 24 MB (see docs/gateway.md).
    fn default() -> Self {
        Self {
            max_pairs: 20_000,
            max_domains_per_proxy: 32,
        }
    }
}

/// What is tracked now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tracked {
    /// (proxy, domain) pairs.
    pub pairs: usize,
    /// Proxies.
    pub proxies: usize,
    /// Pairs evicted since the start.
    pub evicted: u64,
}

/// The statistics; cheap to clone, shared by the gateway, the API, the page and the metrics.
#[derive(Clone, Default)]
pub struct Outcomes(Arc<Mutex<Table>>);

impl std::fmt::Debug for Outcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outcomes")
            .field("tracked", &self.tracked())
            .finish()
    }
}

/// `domain` as statistics key it: lowercase, without a final dot.
pub fn normalize_domain(domain: &str) -> String {
    domain.trim_end_matches('.').to_ascii_lowercase()
}

impl Outcomes {
    /// Statistics bounded by `limits` (each at least 1).
    pub fn new(limits: Limits) -> Self {
        Self(Arc::new(Mutex::new(Table::new(limits))))
    }

    /// Records what `seen` says about a request through `proxy` to `domain`, at `now_ms`.
    pub fn record(&self, proxy: &ProxyKey, domain: &str, seen: &Seen, now_ms: u64) {
        let domain = normalize_domain(domain);
        lock(&self.0).record(proxy, &domain, |pair| {
            pair.stats.add(seen, now_ms);
            if let Some(latency) = seen.latency {
                pair.window
                    .push(u32::try_from(latency.as_millis()).unwrap_or(u32::MAX));
            }
        });
    }

    /// Records a ban of `proxy` for `domain` that no observed request carried (a lease released
    /// with outcome `banned`).
    pub fn record_ban(&self, proxy: &ProxyKey, domain: &str, now_ms: u64) {
        let domain = normalize_domain(domain);
        lock(&self.0).record(proxy, &domain, |pair| {
            pair.stats.bans += 1;
            pair.stats.last_seen_ms = now_ms;
        });
    }

    /// The statistics of `proxy` for `domain`, if tracked.
    pub fn pair(&self, proxy: &ProxyKey, domain: &str) -> Option<Stats> {
        lock(&self.0).pair(proxy, &normalize_domain(domain))
    }

    /// `proxy`'s totals and its `top` busiest domains, if tracked.
    pub fn proxy(&self, proxy: &ProxyKey, top: usize) -> Option<ProxyOutcomes> {
        lock(&self.0).proxy(proxy, top, None)
    }

    /// [`Outcomes::proxy`], with `domain` listed after the top ones if it is tracked and not
    /// among them.
    pub fn proxy_for(&self, proxy: &ProxyKey, top: usize, domain: &str) -> Option<ProxyOutcomes> {
        lock(&self.0).proxy(proxy, top, Some(&normalize_domain(domain)))
    }

    /// Forgets every proxy for which `keep` says no (one gone from the pool), with its pairs.
    pub fn retain(&self, keep: impl Fn(&ProxyKey) -> bool) {
        let keys = lock(&self.0).proxy_keys();
        let gone: Vec<ProxyKey> = keys.into_iter().filter(|key| !keep(key)).collect();
        if !gone.is_empty() {
            lock(&self.0).forget(&gone);
        }
    }

    /// Every tracked proxy's totals, by key.
    pub fn totals(&self) -> Vec<(ProxyKey, Stats)> {
        lock(&self.0).totals()
    }

    /// What is tracked now.
    pub fn tracked(&self) -> Tracked {
        lock(&self.0).tracked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::test_key as key;

    fn status(code: u16, ms: u64) -> Seen {
        Seen {
            ended: Ended::Status(code),
            latency: Some(Duration::from_millis(ms)),
            bytes_received: 100,
            bytes_sent: 10,
            banned: false,
        }
    }

    #[test]
    fn outcomes_count_by_kind_per_pair_and_per_proxy() {
        let outcomes = Outcomes::default();
        let a = key("a");
        outcomes.record(&a, "Shop.Example.", &status(200, 40), 1_000);
        outcomes.record(&a, "shop.example", &status(404, 60), 2_000);
        outcomes.record(&a, "shop.example", &status(503, 80), 3_000);
        outcomes.record(
            &a,
            "shop.example",
            &Seen {
                banned: true,
                ..status(429, 20)
            },
            4_000,
        );
        outcomes.record(
            &a,
            "news.example",
            &Seen {
                ended: Ended::Failed(Failure::Connect),
                latency: None,
                bytes_received: 0,
                bytes_sent: 0,
                banned: false,
            },
            5_000,
        );
        outcomes.record_ban(&a, "news.example", 6_000);
        let shop = outcomes.pair(&a, "shop.example").expect("tracked");
        assert_eq!(shop.requests, 4);
        assert_eq!(shop.successes, 1);
        assert_eq!(shop.failures.client_error, 2);
        assert_eq!(shop.failures.server_error, 1);
        assert_eq!(shop.bans, 1);
        assert_eq!(shop.bytes_received, 400);
        assert_eq!(shop.bytes_sent, 40);
        assert_eq!(shop.last_seen_ms, 4_000);
        assert_eq!(
            shop.latency,
            Some(Quantiles {
                p50: 40,
                p95: 80,
                samples: 4
            })
        );
        let news = outcomes.pair(&a, "NEWS.example").expect("tracked");
        assert_eq!((news.requests, news.failures.connect, news.bans), (1, 1, 1));
        assert_eq!(news.latency, None);

        let proxy = outcomes.proxy(&a, 1).expect("tracked");
        assert_eq!(proxy.total.requests, 5);
        assert_eq!(proxy.total.failures.total(), 4);
        assert_eq!(proxy.total.bans, 2);
        assert_eq!(proxy.domains.len(), 1);
        assert_eq!(proxy.domains[0].domain, "shop.example");
        assert_eq!(proxy.other_domains, 1);
        assert!(outcomes.proxy(&key("b"), 5).is_none());
    }

    #[test]
    fn stats_serialize_as_the_api_shows_them() {
        let outcomes = Outcomes::default();
        outcomes.record(&key("a"), "shop.example", &status(200, 40), 0);
        let json = serde_json::to_value(outcomes.pair(&key("a"), "shop.example").expect("tracked"))
            .expect("plain data");
        assert_eq!(
            json,
            serde_json::json!({
                "requests": 1, "successes": 1,
                "failures": {"connect": 0, "timeout": 0, "reset": 0, "proxyError": 0, "clientError": 0, "serverError": 0},
                "bans": 0, "latencyMs": {"p50": 40, "p95": 40, "samples": 1},
                "bytesReceived": 100, "bytesSent": 10, "lastSeen": "1970-01-01T00:00:00Z"
            })
        );
    }
}
