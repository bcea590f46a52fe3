//! The status page, `GET /ui`: one read-only, server-rendered HTML page (inline CSS, no
//! script, no external asset) of the proxies (phase, provider, endpoint, health, leases), the
//! provider instances' health and the last audit entries per proxy.
//!
//! The page is mode-free: each mode implements [`ProxySource`] (the Proxies' status and audit:
//! the embedded store in standalone mode, the controller's cache and an in-memory audit log in
//! cluster mode), and [`StatusPage`] adds what both modes share (the lease store, the health
//! engine, provider availability). Every string is HTML-escaped (names and messages are user
//! input) and nothing carries credentials: endpoints are `host:port`, never proxy URLs.
//!
//! The page is authenticated like the discovery API: `Authorization: Bearer <token>`, or HTTP
//! Basic with the token as the password (what a browser can send; a 401 asks for it).

mod render;

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
    api::ProxyStatus,
    controller::ProviderAvailability,
    discovery::auth::{AuthError, Authenticator, Presented, presented},
    health::{HealthEvent, HealthHandle, HealthSnapshot, Verdict},
    lease::{LeaseStore, ProxyView, Selector},
    machine::audit::AuditEntry,
    telemetry::admin::Page,
};

pub use render::age;

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
    /// Proxies, by namespace and name.
    pub proxies: Vec<ProxyRow>,
}

/// One proxy with everything the page shows of it.
#[derive(Clone, Debug)]
pub struct ProxyRow {
    /// From the mode.
    pub state: ProxyState,
    /// From the lease store (`None`: not in rotation yet).
    pub leases: Option<ProxyView>,
    /// From the health engine (`None`: not probed).
    pub health: Option<HealthSnapshot>,
    /// The last verdict changes, oldest first.
    pub health_history: Vec<HealthChange>,
    /// The last audit entries, oldest first.
    pub audit: Vec<AuditRow>,
}

/// What the status page reads: a mode's [`ProxySource`] and the parts both modes share.
pub struct PageInputs {
    pub source: Arc<dyn ProxySource>,
    pub leases: LeaseStore,
    pub health: HealthHandle,
    pub availability: ProviderAvailability,
    /// The configured provider instance names.
    pub providers: Vec<String>,
    /// The discovery API's: the page admits the same callers.
    pub auth: Arc<dyn Authenticator>,
}

/// The status page over its inputs, with the health verdict log the mode feeds.
pub struct StatusPage {
    inputs: PageInputs,
    health_log: HealthLog,
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

    /// Gathers what the page shows, now.
    pub fn view(&self) -> Result<StatusView, UiError> {
        let mut states = self.inputs.source.proxies()?;
        states.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let selector = self.inputs.leases.compile(&Selector::default());
        let mut leases: BTreeMap<(String, String), ProxyView> = self
            .inputs
            .leases
            .list(&selector)
            .into_iter()
            .map(|view| {
                let key = (
                    view.info.key.namespace().to_owned(),
                    view.info.key.name().to_owned(),
                );
                (key, view)
            })
            .collect();
        let mut per_provider: BTreeMap<&str, usize> = BTreeMap::new();
        for state in &states {
            *per_provider.entry(state.provider.as_str()).or_default() += 1;
        }
        let providers = self
            .inputs
            .providers
            .iter()
            .map(|name| ProviderRow {
                name: name.clone(),
                down_reason: self.inputs.availability.down_reason(name),
                proxies: per_provider.get(name.as_str()).copied().unwrap_or(0),
            })
            .collect();
        // Verdict changes of Proxies that are gone are dropped here, so the log stays bounded.
        self.health_log
            .retain(|namespace, name| states.iter().any(|s| s.namespace == namespace && s.name == name));
        let proxies = states
            .into_iter()
            .map(|state| {
                let key = crate::api::ProxyKey::new(&state.namespace, &state.name);
                ProxyRow {
                    leases: leases.remove(&(state.namespace.clone(), state.name.clone())),
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
        })
    }
}

#[async_trait]
impl Page for StatusPage {
    /// Answers `GET /ui` with these request headers: the page, or 401 (with a Basic challenge
    /// a browser answers), 403, or 503 when the caller cannot be checked or the view not taken.
    async fn respond(&self, headers: &HeaderMap) -> Response<Full<Bytes>> {
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
        match self.view() {
            Ok(view) => {
                let mut response = Response::new(Full::new(Bytes::from(render::page(&view))));
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
            Err(err) => plain(StatusCode::SERVICE_UNAVAILABLE, &format!("{err}\n")),
        }
    }
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
