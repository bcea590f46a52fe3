//! The status page, `GET /ui`: one read-only, server-rendered HTML page (inline CSS, no
//! script, no external asset) of the proxies (phase, provider, endpoint, attributes, health,
//! slots, lease holders, per-domain bans, restarts of a supervised local process), the provider
//! instances' health and the last audit entries per proxy. It reloads itself with a meta refresh
//! (the same URL, query string included) and shows one page of proxies at a time, filtered by
//! phase or text ([`PageQuery`]), so it stays small and fast at 10,000 proxies.
//!
//! The page is mode-free: each mode implements [`ProxySource`] (the Proxies' status and audit:
//! the embedded store in standalone mode, the controller's cache and an in-memory audit log in
//! cluster mode), and [`StatusPage`] adds what both modes share (the lease store, the health
//! engine, provider availability and process supervision). Every string is HTML-escaped (names
//! and messages are user input) and nothing carries credentials: endpoints are `host:port`,
//! never proxy URLs, and a lease shows the last characters of its ID only.
//!
//! The page is authenticated like the discovery API: `Authorization: Bearer <token>`, or HTTP
//! Basic with the token as the password (what a browser can send; a 401 asks for it).

mod render;
mod usage;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{Arc, Mutex},
};

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    HeaderMap, Response, StatusCode,
    header::{self, HeaderValue},
};
use jiff::Timestamp;

use crate::{
    api::{Attributes, ProxyKey, ProxyStatus},
    controller::ProviderAvailability,
    discovery::auth::{AuthError, Authenticator, Presented, presented},
    health::{HealthEvent, HealthHandle, HealthSnapshot, Verdict},
    lease::{Availability, LeaseStore, ProxyView, Selector},
    machine::audit::AuditEntry,
    outcomes::{Outcomes, ProxyOutcomes, Quantiles},
    provider::{ProviderId, SharedProvider, local::SupervisionStatus},
    telemetry::admin::Page,
};

pub use render::age;
pub use usage::{USAGE_ROWS, UsageView};

/// How many audit entries per proxy the page shows (and cluster mode keeps in memory).
pub const AUDIT_ENTRIES_SHOWN: usize = 8;

/// Why the page could not be built.
#[derive(Debug, thiserror::Error)]
pub enum UiError {
    /// The mode's source could not be read (e.g. the embedded store).
    #[error("reading the proxies: {0}")]
    Source(String),
}

/// One Proxy as its mode knows it (desired and observed state; no secret).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyState {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `spec.provider`.
    pub provider: String,
    /// `status.phase` (`pending` before the first status).
    pub phase: String,
    /// Deletion requested.
    pub deleting: bool,
    /// `status.endpoint` (`host:port`).
    pub endpoint: Option<String>,
    /// The Ready condition's reason and message.
    pub ready: Option<(String, String)>,
    /// When the Proxy was created.
    pub created: Option<Timestamp>,
    /// `status.providerId` (`type/instance/native-id`): where process restarts are looked up.
    pub provider_id: Option<String>,
}

impl ProxyState {
    /// The state of a Proxy with this spec provider and status (either mode's form).
    pub fn from_status(
        namespace: &str,
        name: &str,
        provider: &str,
        status: Option<&ProxyStatus>,
        deleting: bool,
        created: Option<Timestamp>,
    ) -> Self {
        let ready = status
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
            .map(|c| (c.reason.clone(), c.message.clone()));
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            provider: provider.to_owned(),
            phase: status
                .and_then(|s| s.phase.clone())
                .unwrap_or_else(|| "pending".to_owned()),
            deleting,
            endpoint: status.and_then(|s| s.endpoint.clone()),
            ready,
            created,
            provider_id: status.and_then(|s| s.provider_id.clone()),
        }
    }
}

/// One audit entry as the page shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    /// When the transition was decided.
    pub at: Timestamp,
    /// `from --event--> to`.
    pub arrow: String,
    /// The row's reason.
    pub reason: String,
    /// The cause or message (never secret content).
    pub message: String,
}

impl AuditRow {
    /// The row of an audit entry.
    pub fn from_entry(entry: &AuditEntry, message: &str) -> Self {
        let message = if message.is_empty() {
            entry.cause.clone().unwrap_or_default()
        } else {
            message.to_owned()
        };
        Self {
            at: entry.at,
            arrow: entry.arrow(),
            reason: entry.reason.clone(),
            message,
        }
    }
}

/// What a mode contributes to the page.
pub trait ProxySource: Send + Sync {
    /// Every Proxy, in any order.
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError>;
    /// The last `n` audit entries of a Proxy, oldest first.
    fn audit(&self, namespace: &str, name: &str, n: usize) -> Vec<AuditRow>;
    /// The mode's name, shown in the title.
    fn mode(&self) -> &'static str;
}

/// A Proxy's namespace and name.
type NameKey = (String, String);

/// The last entries per proxy (by namespace and name), at most [`AUDIT_ENTRIES_SHOWN`] each;
/// cheap to clone (clones share the entries).
pub struct Recent<T> {
    entries: Arc<Mutex<HashMap<NameKey, VecDeque<T>>>>,
}

impl<T> Clone for Recent<T> {
    fn clone(&self) -> Self {
        Self {
            entries: self.entries.clone(),
        }
    }
}

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Self {
            entries: Arc::default(),
        }
    }
}

impl<T: Clone> Recent<T> {
    /// Appends `items` to `namespace/name`'s entries, dropping the oldest beyond the limit.
    pub fn push(&self, namespace: &str, name: &str, items: impl IntoIterator<Item = T>) {
        let mut all = crate::sync::lock(&self.entries);
        let trail = all.entry((namespace.to_owned(), name.to_owned())).or_default();
        for item in items {
            if trail.len() == AUDIT_ENTRIES_SHOWN {
                trail.pop_front();
            }
            trail.push_back(item);
        }
    }

    /// Forgets a Proxy that is gone.
    pub fn forget(&self, namespace: &str, name: &str) {
        self.retain(|ns, n| (ns, n) != (namespace, name));
    }

    /// Keeps the entries of the Proxies `keep` accepts (by namespace and name).
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        let mut all = crate::sync::lock(&self.entries);
        all.retain(|(namespace, name), _| keep(namespace, name));
    }

    /// The last `n` entries of `namespace/name`, oldest first.
    pub fn last(&self, namespace: &str, name: &str, n: usize) -> Vec<T> {
        let all = crate::sync::lock(&self.entries);
        all.get(&(namespace.to_owned(), name.to_owned()))
            .map(|trail| {
                trail
                    .iter()
                    .skip(trail.len().saturating_sub(n))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The last audit entries per proxy, kept in memory as the reconciler produces them (cluster
/// mode, whose audit otherwise lives only in Events and logs).
pub type AuditLog = Recent<AuditRow>;

impl AuditLog {
    /// Records the entries a reconcile of `namespace/name` produced.
    pub fn record<'a>(&self, namespace: &str, name: &str, entries: impl IntoIterator<Item = &'a AuditEntry>) {
        self.push(
            namespace,
            name,
            entries.into_iter().map(|entry| AuditRow::from_entry(entry, "")),
        );
    }

    /// Puts `older` rows (from before this process, any order) in front of `namespace/name`'s
    /// trail: only those older than its first row (a transition this process recorded may also
    /// be among them, published after it was decided), keeping the last [`AUDIT_ENTRIES_SHOWN`].
    pub fn seed(&self, namespace: &str, name: &str, mut older: Vec<AuditRow>) {
        let mut all = crate::sync::lock(&self.entries);
        let trail = all.entry((namespace.to_owned(), name.to_owned())).or_default();
        if let Some(first) = trail.front() {
            older.retain(|row| row.at < first.at);
        }
        older.sort_by_key(|row| row.at);
        for row in older.into_iter().rev() {
            if trail.len() == AUDIT_ENTRIES_SHOWN {
                break;
            }
            trail.push_front(row);
        }
    }
}

/// A change of a proxy's health verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthChange {
    /// When the verdict changed.
    pub at: Timestamp,
    /// The new verdict.
    pub verdict: Verdict,
    /// The last probe's error, when failing.
    pub error: Option<String>,
}

/// The health engine's last verdict changes per proxy (both modes record them as the engine
/// reports them; the engine itself keeps only the current verdict).
pub type HealthLog = Recent<HealthChange>;

impl HealthLog {
    /// Records one verdict change.
    pub fn record(&self, event: &HealthEvent) {
        self.push(
            event.key.namespace(),
            event.key.name(),
            [HealthChange {
                at: event.at,
                verdict: event.verdict,
                error: event.last_error.clone(),
            }],
        );
    }
}

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

/// What a request asks of the page: `?page=`, `?limit=`, `?phase=`, `?q=`, `?refresh=`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageQuery {
    /// The page of proxies, from 1.
    pub page: usize,
    /// Proxies per page.
    pub limit: usize,
    /// Only proxies in this phase (`deleting` for those being deleted).
    pub phase: Option<String>,
    /// Only proxies whose `namespace/name`, provider, endpoint or an attribute `key=value`
    /// contains this text (case-insensitive).
    pub q: Option<String>,
    /// Seconds between reloads; 0: none.
    pub refresh: u32,
}

impl PageQuery {
    /// Proxies per page unless `limit` says otherwise.
    pub const DEFAULT_LIMIT: usize = 50;
    /// The most proxies one page shows.
    pub const MAX_LIMIT: usize = 500;
    /// Seconds between reloads unless `refresh` says otherwise.
    pub const DEFAULT_REFRESH: u32 = 10;
    /// The shortest reload interval accepted (each reload renders a page).
    pub const MIN_REFRESH: u32 = 2;

    /// The query of a request's query string.
    pub fn parse(query: Option<&str>) -> Result<Self, QueryError> {
        let mut out = Self::default();
        for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let number = |max: u64| {
                value.parse::<u64>().ok().filter(|n| *n <= max).ok_or_else(|| {
                    QueryError(format!("{key} must be a whole number up to {max}, not {value:?}"))
                })
            };
            match &*key {
                "page" => {
                    out.page = usize::try_from(number(1_000_000)?).unwrap_or(1).max(1);
                }
                "limit" => {
                    let limit = number(Self::MAX_LIMIT as u64)?;
                    if limit == 0 {
                        return Err(QueryError(format!("limit must be 1-{}", Self::MAX_LIMIT)));
                    }
                    out.limit = usize::try_from(limit).unwrap_or(Self::DEFAULT_LIMIT);
                }
                "phase" => out.phase = Some(value.into_owned()).filter(|p| !p.is_empty()),
                "q" => out.q = Some(value.trim().to_owned()).filter(|q| !q.is_empty()),
                "refresh" => {
                    let secs = u32::try_from(number(3600)?).unwrap_or(Self::DEFAULT_REFRESH);
                    if secs != 0 && secs < Self::MIN_REFRESH {
                        return Err(QueryError(format!(
                            "refresh must be 0 (off) or {}-3600 seconds",
                            Self::MIN_REFRESH
                        )));
                    }
                    out.refresh = secs;
                }
                other => {
                    return Err(QueryError(format!(
                        "unknown query parameter {other:?}: the page knows page, limit, phase, q and refresh"
                    )));
                }
            }
        }
        Ok(out)
    }

    /// This query's string with `page` changed (what a pagination link points at): only the
    /// parameters that differ from the defaults.
    pub fn with_page(&self, page: usize) -> String {
        let mut out = form_urlencoded::Serializer::new(String::new());
        if page != 1 {
            out.append_pair("page", &page.to_string());
        }
        if self.limit != Self::DEFAULT_LIMIT {
            out.append_pair("limit", &self.limit.to_string());
        }
        if let Some(phase) = &self.phase {
            out.append_pair("phase", phase);
        }
        if let Some(q) = &self.q {
            out.append_pair("q", q);
        }
        if self.refresh != Self::DEFAULT_REFRESH {
            out.append_pair("refresh", &self.refresh.to_string());
        }
        let query = out.finish();
        if query.is_empty() {
            "?".to_owned()
        } else {
            format!("?{query}")
        }
    }

    fn admits(&self, state: &ProxyState, attributes: Option<&Attributes>) -> bool {
        if let Some(phase) = &self.phase {
            let shown = if state.deleting {
                "deleting"
            } else {
                state.phase.as_str()
            };
            if shown != phase {
                return false;
            }
        }
        let Some(q) = &self.q else { return true };
        let q = q.to_lowercase();
        let has = |text: &str| text.to_lowercase().contains(&q);
        has(&format!("{}/{}", state.namespace, state.name))
            || has(&state.provider)
            || state.endpoint.as_deref().is_some_and(has)
            || attributes.is_some_and(|attributes| attributes.iter().any(|(k, v)| has(&format!("{k}={v}"))))
    }
}

impl Default for PageQuery {
    fn default() -> Self {
        Self {
            page: 1,
            limit: Self::DEFAULT_LIMIT,
            phase: None,
            q: None,
            refresh: Self::DEFAULT_REFRESH,
        }
    }
}

/// A query string the page does not understand (answered 400, saying what to fix).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct QueryError(String);

/// What the status page reads: a mode's [`ProxySource`] and the parts both modes share (cheap
/// handles: a clone shares them).
#[derive(Clone)]
pub struct PageInputs {
    pub source: Arc<dyn ProxySource>,
    pub leases: LeaseStore,
    pub health: HealthHandle,
    pub availability: ProviderAvailability,
    /// The configured provider instances, by name (their process supervision, if any, is
    /// shown per proxy).
    pub providers: Vec<(String, SharedProvider)>,
    /// The discovery API's: the page admits the same callers.
    pub auth: Arc<dyn Authenticator>,
    /// Outcome statistics: each proxy's traffic.
    pub outcomes: Outcomes,
    /// Usage per token and holder: the busiest are shown.
    pub usage: crate::usage::Usage,
}

/// The status page over its inputs, with the health verdict log the mode feeds; cheap to
/// clone (clones share both).
#[derive(Clone)]
pub struct StatusPage {
    inputs: PageInputs,
    health_log: HealthLog,
}

/// Milliseconds since the epoch as a timestamp (the lease store's clock).
fn at_ms(ms: u64) -> Timestamp {
    Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX)).unwrap_or(Timestamp::MAX)
}

impl StatusPage {
    pub fn new(inputs: PageInputs) -> Self {
        Self {
            inputs,
            health_log: HealthLog::default(),
        }
    }

    /// Where the mode records the health engine's verdict changes for the page.
    pub fn health_log(&self) -> HealthLog {
        self.health_log.clone()
    }

    /// Gathers what the page shows for `query`, now. Work per proxy outside the page is a
    /// filter test and a count; leases, health, audit and supervision are read for the page's
    /// proxies only.
    pub fn view(&self, query: &PageQuery) -> Result<StatusView, UiError> {
        let mut states = self.inputs.source.proxies()?;
        states.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let store = &self.inputs.leases;
        let now_ms = store.now_ms();
        // Every proxy's attributes only when a text filter must look at them; otherwise the
        // store is read for the page's proxies alone.
        let mut leases: HashMap<ProxyKey, ProxyView> = if query.q.is_some() {
            let selector = store.compile(&Selector::default());
            store
                .list_at(&selector, now_ms)
                .into_iter()
                .map(|view| (view.info.key.clone(), view))
                .collect()
        } else {
            HashMap::new()
        };
        let mut per_provider: BTreeMap<&str, usize> = BTreeMap::new();
        let mut phases: BTreeMap<String, usize> = BTreeMap::new();
        for state in &states {
            *per_provider.entry(state.provider.as_str()).or_default() += 1;
            let phase = if state.deleting {
                "deleting"
            } else {
                state.phase.as_str()
            };
            if let Some(n) = phases.get_mut(phase) {
                *n += 1;
            } else {
                phases.insert(phase.to_owned(), 1);
            }
        }
        let providers = self
            .inputs
            .providers
            .iter()
            .map(|(name, _)| ProviderRow {
                name: name.clone(),
                down_reason: self.inputs.availability.down_reason(name),
                proxies: per_provider.get(name.as_str()).copied().unwrap_or(0),
            })
            .collect();
        // Verdict changes of Proxies that are gone are dropped here, so the log stays bounded.
        let present: std::collections::HashSet<(&str, &str)> = states
            .iter()
            .map(|s| (s.namespace.as_str(), s.name.as_str()))
            .collect();
        self.health_log
            .retain(|namespace, name| present.contains(&(namespace, name)));
        drop(present);
        let total = states.len();
        let active_leases = store.active_total();
        let matched: Vec<ProxyState> = if query.q.is_some() {
            states
                .into_iter()
                .filter(|state| {
                    let key = ProxyKey::new(&state.namespace, &state.name);
                    query.admits(state, leases.get(&key).map(|l| &l.info.attributes))
                })
                .collect()
        } else {
            states
                .into_iter()
                .filter(|state| query.admits(state, None))
                .collect()
        };
        let pages = matched.len().div_ceil(query.limit).max(1);
        let mut query = query.clone();
        query.page = query.page.min(pages);
        let matched_count = matched.len();
        let proxies = matched
            .into_iter()
            .skip((query.page - 1) * query.limit)
            .take(query.limit)
            .map(|state| {
                let key = ProxyKey::new(&state.namespace, &state.name);
                let view = leases.remove(&key).or_else(|| store.view_at(&key, now_ms));
                let attributes = view.as_ref().map_or_else(Vec::new, |v| {
                    v.info
                        .attributes
                        .iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect()
                });
                let leases = view.map(|v| LeaseRow {
                    availability: v.availability,
                    active: v.active_leases,
                    max_concurrent: v.max_concurrent,
                    cooldown_until: v.cooldown_until_ms.map(at_ms),
                    bans: v.bans.into_iter().map(|(d, until)| (d, at_ms(until))).collect(),
                    holders: store
                        .leases_at(Some(&key), None, now_ms)
                        .into_iter()
                        .map(|l| HolderRow {
                            holder: l.claim.holder,
                            id_tail: l.id_tail,
                            acquired: at_ms(l.claim.acquired_at_ms),
                            expires: at_ms(l.expires_at_ms),
                            target_domain: l.claim.target_domain,
                        })
                        .collect(),
                });
                ProxyRow {
                    attributes,
                    leases,
                    process: self.process(&state),
                    traffic: self.inputs.outcomes.proxy(&key, 1).map(Traffic::from),
                    health: self.inputs.health.snapshot(&key),
                    health_history: self
                        .health_log
                        .last(&state.namespace, &state.name, AUDIT_ENTRIES_SHOWN),
                    audit: self
                        .inputs
                        .source
                        .audit(&state.namespace, &state.name, AUDIT_ENTRIES_SHOWN),
                    state,
                }
            })
            .collect();
        Ok(StatusView {
            mode: self.inputs.source.mode(),
            now: Timestamp::now(),
            providers,
            proxies,
            total,
            matched: matched_count,
            phases,
            active_leases,
            query,
            usage: UsageView::of(&self.inputs.usage, now_ms),
        })
    }

    /// What the proxy's provider's process supervision did for its instance, if it has one.
    fn process(&self, state: &ProxyState) -> Option<ProcessRow> {
        let id: ProviderId = state.provider_id.as_deref()?.parse().ok()?;
        let (_, provider) = self
            .inputs
            .providers
            .iter()
            .find(|(name, _)| *name == id.instance)?;
        // A provider with supervision reports every instance it knows, restarted or not.
        if provider.provider_type() != id.provider_type {
            return None;
        }
        match provider.supervision_of(&id.native_id) {
            Some(status) => Some(status.into()),
            None if provider.provider_type() == crate::provider::local::PROVIDER_TYPE => Some(ProcessRow {
                restarts: 0,
                last_restart: None,
                last_error: None,
            }),
            None => None,
        }
    }
}

#[async_trait]
impl Page for StatusPage {
    /// Answers `GET /ui` with these request headers: the page, or 401 (with a Basic challenge
    /// a browser answers), 403, or 503 when the caller cannot be checked or the view not taken.
    async fn respond(&self, headers: &HeaderMap, query: Option<&str>) -> Response<Full<Bytes>> {
        if self.inputs.auth.anonymous().is_none() {
            let Some(token) = presented_token(headers) else {
                return challenge(
                    "a token is required: Authorization: Bearer <token>, or the token as the password",
                );
            };
            match self.inputs.auth.authenticate(&token).await {
                Ok(_) => {}
                Err(AuthError::Unauthenticated) => return challenge("invalid token"),
                Err(AuthError::Forbidden(_)) => return plain(StatusCode::FORBIDDEN, "forbidden\n"),
                Err(AuthError::Unavailable(_)) => {
                    return plain(StatusCode::SERVICE_UNAVAILABLE, "authentication is unavailable\n");
                }
            }
        }
        let query = match PageQuery::parse(query) {
            Ok(query) => query,
            Err(err) => return bad_query(&err),
        };
        // Standalone mode reads a record file per Proxy (~190 ms at 10,000): on the runtime's
        // thread that would stall every lease request while a page is gathered.
        let page = self.clone();
        let gathered = tokio::task::spawn_blocking(move || page.view(&query).map(|view| render(&view))).await;
        match gathered {
            Ok(Ok(html)) => {
                let mut response = Response::new(Full::new(Bytes::from(html)));
                let headers = response.headers_mut();
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/html; charset=utf-8"),
                );
                headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                // Nothing to load from anywhere, and no script at all.
                headers.insert(
                    header::CONTENT_SECURITY_POLICY,
                    HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'"),
                );
                response
            }
            Ok(Err(err)) => plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{err}\n")),
            Err(err) => {
                tracing::error!(error = %err, "gathering the status page failed");
                plain(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the page could not be gathered\n",
                )
            }
        }
    }
}

/// The HTML of a view (what `GET /ui` answers; public for the benchmark and the screenshot
/// test, which render fixed views).
pub fn render(view: &StatusView) -> String {
    render::page(view)
}

/// 400 with the API's error body: what in the query string to fix.
fn bad_query(err: &QueryError) -> Response<Full<Bytes>> {
    let body = serde_json::json!({"error": {"code": "malformed_request", "message": err.to_string()}});
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = StatusCode::BAD_REQUEST;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The token of a Bearer header, or the password of a Basic one (what a browser sends).
fn presented_token(headers: &HeaderMap) -> Option<String> {
    match presented(headers) {
        Presented::Bearer(token) | Presented::BasicPassword(token) => Some(token),
        Presented::Nothing | Presented::Unusable => None,
    }
}

fn challenge(message: &str) -> Response<Full<Bytes>> {
    let mut response = plain(StatusCode::UNAUTHORIZED, &format!("{message}\n"));
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(r#"Basic realm="egress-proxies-operator", charset="UTF-8""#),
    );
    response
}

fn plain(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests;
