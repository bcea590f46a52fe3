//! The page as data: one rendering's view of providers, proxies, leases and traffic.

use std::collections::BTreeMap;

use jiff::Timestamp;

use super::{AuditRow, HealthChange, PageQuery, ProxyState, UsageView};
use crate::{
    health::HealthSnapshot,
    lease::Availability,
    outcomes::{ProxyOutcomes, Quantiles},
    provider::local::SupervisionStatus,
};

/// A provider instance's health as the page shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderRow {
    /// The instance name from the providers config.
    pub name: String,
    /// Why it is down (`None`: available, or not probed yet).
    pub down_reason: Option<String>,
    /// Proxies on it.
    pub proxies: usize,
}

/// Everything one rendering of the page shows.
#[derive(Clone, Debug)]
pub struct StatusView {
    /// `standalone` or `cluster`.
    pub mode: &'static str,
    /// When the view was taken.
    pub now: Timestamp,
    /// Provider instances.
    pub providers: Vec<ProviderRow>,
    /// The proxies of the page asked for, by namespace and name.
    pub proxies: Vec<ProxyRow>,
    /// Every proxy, before the filters.
    pub total: usize,
    /// The proxies the filters let through (all pages).
    pub matched: usize,
    /// Every proxy's phase, counted (before the filters).
    pub phases: BTreeMap<String, usize>,
    /// Active leases on every proxy.
    pub active_leases: usize,
    /// What was asked for; `page` is the one shown (at most the last).
    pub query: PageQuery,
    /// The busiest tokens and holders.
    pub usage: UsageView,
}

/// One proxy with everything the page shows of it.
#[derive(Clone, Debug)]
pub struct ProxyRow {
    /// From the mode.
    pub state: ProxyState,
    /// Its attributes (what selectors match), by key; empty when not in rotation.
    pub attributes: Vec<(String, String)>,
    /// From the lease store (`None`: not in rotation yet).
    pub leases: Option<LeaseRow>,
    /// What the provider's process supervision did (`None`: the provider has none, e.g. VMs
    /// and pods, whose restarts their hypervisor or kubelet count).
    pub process: Option<ProcessRow>,
    /// What went through the proxy, from the outcome statistics; `None` until an outcome is
    /// recorded (shown as "not measured", never as a made-up zero).
    pub traffic: Option<Traffic>,
    /// From the health engine (`None`: not probed).
    pub health: Option<HealthSnapshot>,
    /// The last verdict changes, oldest first.
    pub health_history: Vec<HealthChange>,
    /// The last audit entries, oldest first.
    pub audit: Vec<AuditRow>,
}

/// A proxy's standing in the lease store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRow {
    /// How it stands for new leases (for a crawler naming no domain).
    pub availability: Availability,
    /// Active leases.
    pub active: usize,
    /// Its `maxConcurrent`.
    pub max_concurrent: u32,
    /// End of its cooldown, if resting.
    pub cooldown_until: Option<Timestamp>,
    /// Active bans: domain and end, by domain.
    pub bans: Vec<(String, Timestamp)>,
    /// Who holds its leases, by first token.
    pub holders: Vec<HolderRow>,
}

/// One active lease as the page shows it: no whole ID, no fencing token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderRow {
    /// The holder the crawler named.
    pub holder: String,
    /// The last characters of the lease ID (`None`: restored from a checkpoint, which keeps
    /// no IDs).
    pub id_tail: Option<String>,
    /// When it was granted.
    pub acquired: Timestamp,
    /// When it ends unless renewed.
    pub expires: Timestamp,
    /// The domain it was acquired for.
    pub target_domain: Option<String>,
}

/// What process supervision (the `local` provider's) did for a proxy's instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessRow {
    /// Restarts of a dead process since this operator process started supervising.
    pub restarts: u64,
    /// When the last restart happened.
    pub last_restart: Option<Timestamp>,
    /// Why the last restart attempt failed, if it did.
    pub last_error: Option<String>,
}

impl From<SupervisionStatus> for ProcessRow {
    fn from(s: SupervisionStatus) -> Self {
        Self {
            restarts: s.restarts,
            last_restart: s.last_restart_at,
            last_error: s.last_error,
        }
    }
}

/// What went through one proxy, from the outcome statistics ([`crate::outcomes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Traffic {
    /// Requests and tunnels through the proxy.
    pub requests: u64,
    /// Of those, failed ones.
    pub errors: u64,
    /// Bans for a domain.
    pub bans: u64,
    /// Median and p95 of its last latencies, if any.
    pub latency: Option<Quantiles>,
    /// Its busiest target domain and that domain's requests.
    pub top_domain: Option<(String, u64)>,
    /// Target domains tracked.
    pub domains: usize,
}

impl From<ProxyOutcomes> for Traffic {
    fn from(outcomes: ProxyOutcomes) -> Self {
        Self {
            requests: outcomes.total.requests,
            errors: outcomes.total.failures.total(),
            bans: outcomes.total.bans,
            latency: outcomes.total.latency,
            domains: outcomes.domains.len() + outcomes.other_domains,
            top_domain: (outcomes.domains.into_iter().next()).map(|d| (d.domain, d.stats.requests)),
        }
    }
}
