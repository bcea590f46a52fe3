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

mod log;
mod query;
mod render;
mod usage;
mod view;

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
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
    api::{ProxyKey, ProxyStatus},
    controller::ProviderAvailability,
    discovery::auth::{AuthError, Authenticator, Presented, presented},
    health::HealthHandle,
    lease::{LeaseStore, ProxyView, Selector},
    outcomes::Outcomes,
    provider::{ProviderId, SharedProvider},
    telemetry::admin::Page,
};

pub use log::{AuditLog, AuditRow, HealthChange, HealthLog, Recent};
pub use query::{PageQuery, QueryError};
pub use render::{age, phase_label};
pub use usage::{USAGE_ROWS, UsageView};
pub use view::{HolderRow, LeaseRow, ProcessRow, ProviderRow, ProxyRow, StatusView, Traffic};

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

/// What a mode contributes to the page.
pub trait ProxySource: Send + Sync {
    /// Every Proxy, in any order.
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError>;
    /// The last `n` audit entries of a Proxy, oldest first.
    fn audit(&self, namespace: &str, name: &str, n: usize) -> Vec<AuditRow>;
    /// The mode's name, shown in the title.
    fn mode(&self) -> &'static str;
}

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
