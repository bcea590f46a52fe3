//! The lease store: which crawler holds which proxy, until when, and what each proxy may still
//! be given.
//!
//! It owns per-proxy lease state (active leases, fencing tokens, cooldowns, per-domain bans,
//! admission) and sticky-session bindings. It does not probe health or talk to Kubernetes: the
//! controller feeds it proxies ([`LeaseStore::upsert_proxy`]) and the lifecycle engine's effects
//! ([`LeaseStore::set_admission`], [`LeaseStore::drain`], [`LeaseStore::revoke_all`]); the
//! discovery API calls [`LeaseStore::acquire`], [`LeaseStore::renew`], [`LeaseStore::release`]
//! and [`LeaseStore::list`]. It owns the lease executor's interface, [`LeaseControl`], which
//! the store implements and the reconciler calls.
//!
//! # Rules
//! - **Admission.** A proxy starts `Closed`; only `Open` proxies (the engine opens Healthy
//!   ones) get new leases. `Closed` keeps existing leases running; draining also refuses their
//!   renewal, so they end at their expiry or release; revoking drops them at once. A renewal
//!   of a lease on a proxy closed since it was open says so ([`Renewed::out_of_rotation`]),
//!   so that its holder moves off a proxy whose checks fail.
//! - **Expiry.** A lease exists while `now < expiresAt`, for every operation alike: at
//!   `expiresAt` its slot is free and it is unknown to renew and release. Each operation
//!   settles the shards it touches first (a per-shard heap of expiry times), so nothing waits
//!   for the reaper ([`LeaseStore::reap`], run every second by [`maintenance`], which only
//!   tidies). The `*_at` operations take the request's one `now` ([`LeaseStore::now_ms`]).
//! - **Limits.** At most `maxConcurrent` active leases per proxy.
//! - **Cooldowns.** Every release rests the proxy for its `cooldownSeconds` from the release;
//!   every expiry likewise from the lease's `expiresAt` (as if released then). A `banned` outcome also rests it for the target domain alone, for
//!   [`LeaseStoreConfig::ban_cooldown`]. Requests without a target domain ignore domain bans.
//! - **Choice.** Among eligible proxies, the least recently used one (acquired or released the
//!   longest ago). The store is split into shards, each with its own lock and LRU lists; a
//!   thread's acquires start in one shard for 4,096 acquires (`store::select::BURST`), then in the next, round robin
//!   (concurrent threads split the shards between them, so no shard's data moves between cores
//!   on every call), so the choice is LRU within a shard and close to LRU overall. `shards: 1`
//!   makes it strict. A selector with several terms gets a list of its
//!   own for its combination the first time it is compiled (up to [`MAX_INDEXED_COMBINATIONS`],
//!   first come first served), so its acquire takes that list's head. Beyond the cap, a
//!   selector walks its rarest term's list and skips proxies that miss another term; those
//!   gather at the head of the list, so such a walk costs O(skipped).
//! - **Sticky sessions.** An acquire with a session key returns the proxy bound to that key
//!   while it stays eligible (open, a free slot, matching the selector, not banned for the
//!   domain; its post-release cooldown does not apply to its own session). Otherwise a new
//!   proxy is chosen and bound. Bindings end [`LeaseStoreConfig::session_idle_ttl`] after the
//!   last lease's expiry.
//! - **Fencing.** Every acquire and every renew issues a new fencing token, greater than every
//!   token issued before for that proxy (tokens are seeded from the wall clock and persisted, so
//!   this holds across restarts and leader changes; they stay below 2^53 for JSON clients). A
//!   renew or release must present the lease's latest token; an older one is refused.
//!
//! # Persistence
//! Standalone mode (by default) makes every acquire, renewal and release durable before it is
//! answered: the discovery API appends what changed to the [`journal`] and awaits its group
//! commit; the journal is compacted into the checkpoint file and replayed onto it at start.
//! Otherwise (cluster mode, or `--no-durable-leases`):
//! mutations mark their proxy changed (and its shard dirty); [`maintenance`] periodically saves
//! what changed to a [`checkpoint::CheckpointStore`]: in standalone mode a delta of the changed
//! proxies appended after a snapshot file ([`checkpoint::FileCheckpoint`]), in cluster mode the
//! dirty shards' parts in Kubernetes objects, off the hot path. On start,
//! [`LeaseStore::restore`] loads it. Leases issued after the last checkpoint are not lost either:
//! lease IDs are signed ([`token::LeaseSigner`]) and carry what the store needs to take a lease
//! back ([`LeaseStore::reinstate`]) when its holder next renews or releases it. The windows in
//! which a lease can still be lost or over-admitted are documented in `docs/api.md`.

pub mod checkpoint;
mod clock;
mod control;
mod durable;
pub mod journal;
mod selector;
mod store;
pub mod token;

#[cfg(test)]
mod tests;

use std::{fmt, sync::Arc, time::Duration};

pub use checkpoint::maintenance;
pub use clock::{Clock, Rfc3339, rfc3339};
pub use control::LeaseControl;
pub use durable::{Acquired, DurableError, DurableLeases};
pub use selector::{CompiledSelector, MAX_SELECTOR_LEN, MAX_SELECTOR_TERMS, Selector, SelectorError};
pub use store::{DrainedHook, LeaseStore, MAX_INDEXED_COMBINATIONS, MAX_SHARDS};

use crate::{
    api::{Attributes, LeasePolicy, ProxyKey},
    provider::{Credentials, Endpoint},
};

/// A proxy as the controller hands it to the store.
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseTarget {
    /// The Proxy's `namespace/name`.
    pub key: ProxyKey,
    /// Where crawlers reach it.
    pub endpoint: Endpoint,
    /// Attributes crawlers select by.
    pub attributes: Attributes,
    /// Limits, cooldown and longest TTL.
    pub policy: LeasePolicy,
    /// Credentials crawlers must send to the proxy; handed to lease holders in the proxy URL.
    pub credentials: Option<Credentials>,
}

/// Whether a proxy takes new leases (the engine's enable/disable effects).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Admission {
    /// New leases may be handed out.
    Open,
    /// No new leases; existing ones run on and may be renewed.
    Closed,
}

/// What [`LeaseStore::drain`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainStatus {
    /// No active lease is left.
    Drained,
    /// `active` leases still run; they can be released but not renewed.
    Pending {
        /// Leases still active.
        active: usize,
    },
}

/// How a lease ended, as its holder reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The proxy worked.
    Ok,
    /// The target domain banned the proxy: it rests for that domain only.
    Banned,
    /// Something else failed; treated like `ok` for cooldowns, counted apart in metrics.
    Error,
}

impl Outcome {
    /// The lowercase name used in the API and as a metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Banned => "banned",
            Outcome::Error => "error",
        }
    }
}

/// Store-wide settings.
#[derive(Clone, Debug)]
pub struct LeaseStoreConfig {
    /// Number of independently locked shards (1..=[`MAX_SHARDS`]); 1 gives strict LRU.
    pub shards: usize,
    /// How long a `banned` outcome rests a proxy for the reported domain.
    pub ban_cooldown: Duration,
    /// How long a sticky-session binding outlives the expiry of its last lease.
    pub session_idle_ttl: Duration,
    /// How long state restored from a checkpoint waits for its proxy to be configured again.
    pub restore_grace: Duration,
    /// How long a drain or a deletion waits for a restored lease its holder has not confirmed
    /// (renewed) since the restore: it may have been released just before a crash.
    pub unconfirmed_grace: Duration,
    /// Time source.
    pub clock: Clock,
}

impl Default for LeaseStoreConfig {
    fn default() -> Self {
        Self {
            shards: 16,
            ban_cooldown: Duration::from_secs(30 * 60),
            session_idle_ttl: Duration::from_secs(30 * 60),
            restore_grace: Duration::from_secs(10 * 60),
            unconfirmed_grace: Duration::from_secs(30),
            clock: Clock::System,
        }
    }
}

/// What an acquire asks for.
#[derive(Clone, Copy, Debug)]
pub struct AcquireRequest<'a> {
    /// Which proxies qualify ([`LeaseStore::compile`]).
    pub selector: &'a CompiledSelector,
    /// Who holds the lease (for listings and metrics).
    pub holder: &'a str,
    /// How long the lease lasts unless renewed; capped by the proxy's `maxTtlSeconds`.
    pub ttl: Duration,
    /// The domain the holder will crawl: proxies banned for it are skipped.
    pub target_domain: Option<&'a str>,
    /// Sticky-session key.
    pub session_key: Option<&'a str>,
    /// Makes the acquire safe to send again: while the lease an acquire with this ID and
    /// holder was granted is active, the same ID and holder get that lease back
    /// ([`Granted::repeat_of`]) instead of another; see [`LeaseStore::confirm_request`].
    pub request_id: Option<&'a str>,
}

/// What the store shares about a proxy with lease holders. `Debug` hides the credentials.
///
/// Aligned to two cache lines: every lease hands out a reference to it, and the count of one
/// proxy's info must not share a line with another's that a thread on the other core counts.
#[derive(Clone)]
#[repr(align(128))]
pub struct ProxyInfo {
    /// The Proxy's `namespace/name`.
    pub key: ProxyKey,
    /// Where it listens.
    pub endpoint: Endpoint,
    /// `host:port`.
    pub endpoint_text: String,
    /// Its attributes.
    pub attributes: Attributes,
    url_with_credentials: String,
    url: String,
    /// `Basic <base64 of user:password>` when it takes credentials: what a client that
    /// forwards through it on a holder's behalf sends as `Proxy-Authorization`.
    proxy_authorization: Option<String>,
    /// Its JSON as every lease answer shows it, rendered by the discovery API on first use
    /// (an info is immutable: a changed proxy gets a new one).
    rendered: std::sync::OnceLock<Box<str>>,
}

impl PartialEq for ProxyInfo {
    fn eq(&self, other: &Self) -> bool {
        // The rendering is derived from the rest.
        self.key == other.key
            && self.endpoint == other.endpoint
            && self.endpoint_text == other.endpoint_text
            && self.attributes == other.attributes
            && self.url_with_credentials == other.url_with_credentials
            && self.url == other.url
    }
}

impl Eq for ProxyInfo {}

impl ProxyInfo {
    /// Builds the info (and both proxy URLs) of a target.
    pub fn new(target: &LeaseTarget) -> Self {
        let endpoint_text = target.endpoint.to_string();
        let url = format!("http://{endpoint_text}");
        let url_with_credentials = match &target.credentials {
            Some(c) => format!(
                "http://{}:{}@{endpoint_text}",
                userinfo_escape(&c.username),
                userinfo_escape(&c.password)
            ),
            None => url.clone(),
        };
        let proxy_authorization = target.credentials.as_ref().map(|c| {
            use base64::Engine as _;
            let pair = format!("{}:{}", c.username, c.password);
            format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
        });
        Self {
            key: target.key.clone(),
            endpoint: target.endpoint.clone(),
            endpoint_text,
            attributes: target.attributes.clone(),
            url_with_credentials,
            url,
            proxy_authorization,
            rendered: std::sync::OnceLock::new(),
        }
    }

    /// `render(self)`, computed once per info and kept with it.
    pub(crate) fn rendered(&self, render: impl FnOnce(&Self) -> String) -> &str {
        self.rendered.get_or_init(|| render(self).into_boxed_str())
    }

    /// `http://host:port`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `http://user:password@host:port` (or the plain URL): only for the lease holder.
    pub fn url_with_credentials(&self) -> &str {
        &self.url_with_credentials
    }

    /// The `Proxy-Authorization` value its credentials make (`None`: it takes none): only for
    /// the lease holder.
    pub fn proxy_authorization(&self) -> Option<&str> {
        self.proxy_authorization.as_deref()
    }
}

impl fmt::Debug for ProxyInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyInfo")
            .field("key", &self.key)
            .field("endpoint", &self.endpoint_text)
            .field("attributes", &self.attributes)
            .finish_non_exhaustive()
    }
}

/// Percent-encodes what RFC 3986 does not allow in userinfo.
fn userinfo_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Where the store last kept a lease: a hint that spares a lookup by key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LeaseHint {
    pub(crate) shard: u16,
    pub(crate) slot: u32,
    pub(crate) generation: u32,
}

/// Identifies one lease: its proxy and the fencing token it was acquired with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseId {
    /// The leased proxy.
    pub key: ProxyKey,
    /// The first fencing token of the lease (unique per proxy).
    pub first_token: u64,
    pub(crate) hint: LeaseHint,
}

/// A granted lease.
#[derive(Clone, Debug)]
pub struct Lease {
    /// Its identity.
    pub id: LeaseId,
    /// The token to present with the next renew or release.
    pub fencing_token: u64,
    /// When it was granted (ms since the epoch).
    pub acquired_at_ms: u64,
    /// When it ends unless renewed (ms since the epoch).
    pub expires_at_ms: u64,
    /// The proxy.
    pub proxy: Arc<ProxyInfo>,
}

/// What an acquire got: a lease, and for one that repeated a request ID, the claim that lease
/// was first granted with (sign it again for the same lease ID).
#[derive(Clone, Debug)]
pub struct Granted {
    pub lease: Lease,
    /// `None`: a new grant.
    pub repeat_of: Option<LeaseClaim>,
}

impl Lease {
    /// The claim to sign into this new lease's ID, with the request's fields (the domain as the
    /// store keeps it, so a repeat's claim, made from the store, is the same).
    pub fn claim(&self, holder: &str, target_domain: Option<&str>, session_key: Option<&str>) -> LeaseClaim {
        LeaseClaim {
            id: self.id.clone(),
            holder: holder.to_owned(),
            acquired_at_ms: self.acquired_at_ms,
            expires_at_ms: self.expires_at_ms,
            target_domain: target_domain.map(LeaseStore::normalize_domain),
            session_key: session_key.map(str::to_owned),
        }
    }
}

/// A renewed lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewed {
    /// The new token; the old one is stale from now on.
    pub fencing_token: u64,
    /// The new expiry (ms since the epoch).
    pub expires_at_ms: u64,
    /// The engine took the proxy out of rotation while it was open (its health checks fail,
    /// or it is being replaced): the lease runs on, but its holder should move its work to
    /// another proxy and release it.
    pub out_of_rotation: bool,
}

/// A live lease, as [`DurableLeases::check`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    /// Its proxy.
    pub proxy: ProxyKey,
    /// The target domain it was taken for, if any.
    pub target_domain: Option<String>,
    /// Its holder.
    pub holder: String,
}

/// What a release changed besides ending the lease (what the journal records of it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    /// The domain ban a `banned` outcome started.
    pub ban: Option<checkpoint::BanCheckpoint>,
    /// When the proxy's cooldown ends, if it is resting now.
    pub cooldown_until_ms: Option<u64>,
    /// The lease's holder (what usage metering counts its time for), moved out of the lease.
    pub holder: smol_str::SmolStr,
    /// When the lease was granted (ms since the epoch).
    pub acquired_at_ms: u64,
}

/// A lease that ended at its expiry, never released: who held it and for how long (grant to
/// expiry), for usage's lease-seconds ([`LeaseStore::take_expired`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpiredLease {
    /// Its holder.
    pub holder: String,
    /// Milliseconds from its grant to its expiry.
    pub held_ms: u64,
}

/// Everything a signed lease ID says about its lease: enough to take it back after a restart
/// or a leader change that lost it ([`LeaseStore::reinstate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseClaim {
    /// The lease.
    pub id: LeaseId,
    /// Its holder.
    pub holder: String,
    /// When it was granted.
    pub acquired_at_ms: u64,
    /// Its first expiry (renewals may have moved it later).
    pub expires_at_ms: u64,
    /// Its target domain.
    pub target_domain: Option<String>,
    /// Its sticky-session key.
    pub session_key: Option<String>,
}

/// How a proxy stands for new leases, as listings show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub enum Availability {
    /// Can be leased now.
    Available,
    /// Every slot is taken.
    Busy,
    /// Resting after a release.
    CoolingDown,
    /// Banned for the domain the listing asked about (`targetDomain`); other domains may
    /// still lease it.
    Banned,
    /// Not taking new leases (not healthy).
    Closed,
    /// Being drained.
    Draining,
}

/// A proxy as listings show it (no credentials).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyView {
    /// The proxy.
    pub info: Arc<ProxyInfo>,
    /// How it stands.
    pub availability: Availability,
    /// Active leases.
    pub active_leases: usize,
    /// Its `maxConcurrent`.
    pub max_concurrent: u32,
    /// End of its cooldown, if resting.
    pub cooldown_until_ms: Option<u64>,
    /// Its active bans: (domain, end in ms since the epoch), by domain.
    pub bans: Vec<(String, u64)>,
}

/// A lease as the lease listing shows it: what its ID says and when it ends now, but neither
/// its signed ID nor its token (those are the holder's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    /// What it was granted as (its `expires_at_ms` is the first expiry).
    pub claim: LeaseClaim,
    /// When it ends unless renewed (ms since the epoch).
    pub expires_at_ms: u64,
    /// The last [`LeaseView::ID_TAIL`] characters of the lease ID this process issued for it
    /// (`None`: restored from a checkpoint, which keeps no IDs, or held by the gateway, whose
    /// leases have none). Never the whole ID.
    pub id_tail: Option<String>,
}

impl LeaseView {
    /// How many characters of a lease ID [`LeaseView::id_tail`] keeps.
    pub const ID_TAIL: usize = 8;
}

/// Why a store operation was refused. [`LeaseError::code`] is the stable API code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// No such lease: never granted, released, revoked or expired.
    #[error("lease not found (released, revoked, expired or never granted)")]
    NotFound,
    /// The presented fencing token is not the lease's latest.
    #[error("fencing token {presented} is stale: the lease's current token is newer")]
    StaleToken {
        /// What the caller sent.
        presented: u64,
        /// The lease's token.
        current: u64,
    },
    /// The proxy is draining: its leases may be released but not renewed.
    #[error("the proxy is draining: leases on it cannot be renewed")]
    Draining,
    /// No proxy matches and is eligible now. The store does not say which of the reasons held
    /// (keeping refusals cheap when a pool is exhausted); `GET /v1/proxies` shows each proxy's.
    #[error(
        "no proxy is available for this acquire now: none matches, or each that does is full, \
         cooling down, banned for the domain or out of rotation (GET /v1/proxies shows how each \
         stands; add the acquire's ?selector= and ?targetDomain= to see only its candidates)"
    )]
    NoProxyAvailable {
        /// When trying again may help.
        retry_after: Duration,
    },
    /// A `banned` outcome needs the domain that banned the proxy.
    #[error("a banned outcome needs a target domain (in the release or the lease)")]
    BanNeedsDomain,
    /// The proxy is not in the store.
    #[error("proxy {0} is not in the lease store")]
    UnknownProxy(ProxyKey),
    /// A request value out of range.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// An acquire with the same request ID and holder is being granted right now (its lease is
    /// not durable yet), or its lease was restored after a restart and its proxy is not
    /// configured again yet. Ask again in a moment (it is then answered that lease).
    #[error("an acquire with this requestId is in progress: ask again in a moment")]
    RequestInProgress,
}

impl LeaseError {
    /// Stable, bounded code (API error code and metric label).
    pub const fn code(&self) -> &'static str {
        match self {
            LeaseError::NotFound => "lease_not_found",
            LeaseError::StaleToken { .. } => "stale_token",
            LeaseError::Draining => "proxy_draining",
            LeaseError::NoProxyAvailable { .. } => "no_proxy_available",
            LeaseError::BanNeedsDomain => "target_domain_required",
            LeaseError::UnknownProxy(_) => "unknown_proxy",
            LeaseError::Invalid(_) => "invalid_request",
            LeaseError::RequestInProgress => "request_in_progress",
        }
    }
}
