//! The leases the gateway holds on its clients' behalf, taken and ended in the lease store
//! directly: neither signed nor written to the lease journal. Only this process's gateway holds
//! them, so after a crash no client could present one, and the sessions that would reuse them
//! are gone with the process. Journalled, they only outlived a crash as leases left to expire,
//! at the cost of two fsync waits per request without a session (the gateway served about a
//! third of its rate with them); a signed ID would only be handed to this code, which keeps the
//! lease's [`LeaseId`] instead (signing and the presented ID's check cost about 3,000
//! instructions a request without a session). A clean stop gives them all back before the last
//! checkpoint is taken.
//!
//! - A request without a session takes a lease of its own and ends it when its answer is
//!   sent (or its tunnel closes, or its client goes away): a [`Lent`] whose Drop releases it.
//! - A request with a session key uses the session's lease: one per (holder, session key,
//!   target host, selector), taken with the session key (so the store's sticky binding applies), renewed
//!   while used, ended when its proxy is banned for the domain, dies or stops taking leases
//!   (by [`Held::upkeep`] while no request uses it, so a drain does not wait for the session),
//!   and released by [`Held::upkeep`] once idle for [`GatewayConfig::session_idle`].
//!
//! [`Held::upkeep`] also renews every lease in use that nears its expiry (a long tunnel keeps
//! its proxy), and releases every held lease when the gateway stops.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tracing::{debug, warn};

use super::{GatewayConfig, GatewayDeps, user::Who};
use crate::politeness::Turn;
use crate::{
    api::ProxyKey,
    hashing::FastMap,
    lease::{AcquireRequest, LeaseError, LeaseId, Outcome, ProxyInfo, Selector},
    sync::lock,
};

/// Leases on the proxy to avoid that [`Held::take_loose`] holds before it gives up.
const MAX_AVOIDED: usize = 4;

/// One lease the gateway holds.
#[derive(Clone)]
struct HeldLease {
    id: LeaseId,
    token: u64,
    expires_at_ms: u64,
    proxy: Arc<ProxyInfo>,
    /// The token of the request that took it (its identity name): usage counts its time.
    taken_by: Arc<str>,
}

/// A sticky session: its lease (while it has one) and who is using it.
struct Session {
    /// Locked while a request takes, renews or ends the lease (so two requests of one session
    /// never take two leases).
    lease: tokio::sync::Mutex<Option<HeldLease>>,
    /// Requests using it now.
    uses: AtomicUsize,
    /// When it was last let go (ms since the epoch, the store's clock).
    last_used_ms: AtomicU64,
    /// Removed from the table: a request that finds it so starts again.
    closed: std::sync::atomic::AtomicBool,
}

/// (holder, session key, target host, selector): a session sticks per target host, whose bans
/// it follows, and per selector, which its proxy must match.
type SessionKey = (String, String, Option<String>, BTreeMap<String, String>);

/// What the gateway holds.
pub(super) struct Held {
    deps: GatewayDeps,
    config: GatewayConfig,
    sessions: Mutex<FastMap<SessionKey, Arc<Session>>>,
    /// Leases of requests without a session, in use now, by a number of their own.
    loose: Mutex<FastMap<u64, HeldLease>>,
    next_loose: AtomicU64,
}

/// A lease lent to one request; ending it, or dropping it, gives it back.
pub(super) struct Lent {
    held: Arc<Held>,
    proxy: Arc<ProxyInfo>,
    lease: LeaseId,
    kind: Kind,
    done: bool,
    /// The request's politeness turn, freed with the lease.
    turn: Option<Turn>,
}

enum Kind {
    Session(Arc<Session>),
    Loose(u64),
}

impl Lent {
    /// The proxy to go through.
    pub(super) fn proxy(&self) -> &Arc<ProxyInfo> {
        &self.proxy
    }

    /// Holds `turn` (a politeness turn) as long as the lease is lent.
    pub(super) fn with_turn(mut self, turn: Option<Turn>) -> Self {
        self.turn = turn;
        self
    }

    /// The request is done and went well: a lease of its own goes back now (`ok`); a
    /// session keeps its lease (Drop lets the session go).
    pub(super) async fn give_back(self) {
        if matches!(self.kind, Kind::Loose(_)) {
            self.end(Outcome::Ok).await;
        }
    }

    /// Ends the lease now with `outcome` (a ban is for the lease's target domain); a session
    /// loses it, so its next request takes another.
    pub(super) async fn end(self, outcome: Outcome) {
        self.end_banning(outcome, None).await;
    }

    /// [`Lent::end`], a `banned` outcome resting the proxy for the domain for `ban_for`
    /// (`None`: the store's ban cooldown).
    pub(super) async fn end_banning(mut self, outcome: Outcome, ban_for: Option<Duration>) {
        self.done = true;
        match &self.kind {
            Kind::Session(session) => {
                let mut slot = session.lease.lock().await;
                if slot.as_ref().is_some_and(|l| l.id == self.lease)
                    && let Some(lease) = slot.take()
                {
                    self.held.release_banning(&lease, outcome, ban_for).await;
                }
                drop(slot);
                self.held.let_go(session);
            }
            Kind::Loose(n) => {
                let lease = lock(&self.held.loose).remove(n);
                if let Some(lease) = lease {
                    self.held.release_banning(&lease, outcome, ban_for).await;
                }
            }
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        match &self.kind {
            Kind::Session(session) => self.held.let_go(session),
            Kind::Loose(n) => {
                let Some(lease) = lock(&self.held.loose).remove(n) else {
                    return;
                };
                // Dropped with the request or its answer (the client may have gone): released
                // off this thread, since Drop cannot wait.
                let held = self.held.clone();
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move { held.release(&lease, Outcome::Ok).await });
                }
            }
        }
    }
}

impl Held {
    pub(super) fn new(deps: GatewayDeps, config: GatewayConfig) -> Self {
        Self {
            deps,
            config,
            sessions: Mutex::new(FastMap::default()),
            loose: Mutex::new(FastMap::default()),
            next_loose: AtomicU64::new(0),
        }
    }

    pub(super) fn deps(&self) -> &GatewayDeps {
        &self.deps
    }

    /// A lease for one request of `who` to `domain`: the session's (taken or renewed as
    /// needed), or one of its own.
    pub(super) async fn take(self: &Arc<Self>, who: &Who, domain: Option<&str>) -> Result<Lent, LeaseError> {
        match &who.session {
            Some(session) => self.take_session(who, session, domain).await,
            None => self.take_loose(who, domain, None).await,
        }
    }

    /// A lease of its own, on another proxy than `avoid`. The store has no "anything but":
    /// a lease it grants on `avoid` (which has free slots besides the caller's) is held while
    /// the next is asked for, so its least-recently-used choice moves on, and all of those are
    /// given back at the end; after [`MAX_AVOIDED`] of them, no other proxy is taken to be
    /// free and this fails.
    pub(super) async fn take_loose(
        self: &Arc<Self>,
        who: &Who,
        domain: Option<&str>,
        avoid: Option<&ProxyKey>,
    ) -> Result<Lent, LeaseError> {
        // Each taken lease is lent at once, so whatever ends this (an error, a cancelled
        // request) gives the avoided ones back through their Drop.
        let mut avoided = Vec::new();
        loop {
            let lease = self.acquire(who, domain, None).await?;
            let n = self.next_loose.fetch_add(1, Ordering::Relaxed);
            let lent = Lent {
                held: self.clone(),
                proxy: lease.proxy.clone(),
                lease: lease.id.clone(),
                kind: Kind::Loose(n),
                done: false,
                turn: None,
            };
            lock(&self.loose).insert(n, lease);
            if avoid.is_none_or(|key| *key != lent.proxy.key) {
                return Ok(lent);
            }
            avoided.push(lent);
            if avoided.len() >= MAX_AVOIDED {
                return Err(LeaseError::NoProxyAvailable {
                    retry_after: Duration::from_secs(1),
                });
            }
        }
    }

    async fn take_session(
        self: &Arc<Self>,
        who: &Who,
        session_key: &str,
        domain: Option<&str>,
    ) -> Result<Lent, LeaseError> {
        let key = (
            who.holder.clone(),
            session_key.to_owned(),
            domain.map(str::to_owned),
            who.selector.clone(),
        );
        loop {
            let session = lock(&self.sessions)
                .entry(key.clone())
                .or_insert_with(|| {
                    Arc::new(Session {
                        lease: tokio::sync::Mutex::new(None),
                        uses: AtomicUsize::new(0),
                        last_used_ms: AtomicU64::new(0),
                        closed: false.into(),
                    })
                })
                .clone();
            let mut slot = session.lease.lock().await;
            if session.closed.load(Ordering::Acquire) {
                // Upkeep removed it between the lookup and the lock: look it up again.
                continue;
            }
            let lease = self.keep(&mut slot, who, session_key, domain).await?;
            // Counted under the slot's lock, which upkeep takes before it checks the count.
            session.uses.fetch_add(1, Ordering::AcqRel);
            drop(slot);
            return Ok(Lent {
                held: self.clone(),
                proxy: lease.proxy,
                lease: lease.id,
                kind: Kind::Session(session),
                done: false,
                turn: None,
            });
        }
    }

    /// The session's lease, kept in `slot`: the one it has while it is usable (renewed when
    /// half its time is gone), else a new one taken with the session key.
    async fn keep(
        &self,
        slot: &mut Option<HeldLease>,
        who: &Who,
        session_key: &str,
        domain: Option<&str>,
    ) -> Result<HeldLease, LeaseError> {
        let now = self.deps.store.now_ms();
        if let Some(lease) = slot.take() {
            let usable = lease.expires_at_ms > now + 1_000 && self.deps.store.admits(&lease.proxy.key);
            if usable {
                let half = self.config.lease_ttl.as_millis() as u64 / 2;
                if lease.expires_at_ms - now >= half {
                    *slot = Some(lease.clone());
                    return Ok(lease);
                }
                if let Some(renewed) = self.renew(&lease).await {
                    *slot = Some(renewed.clone());
                    return Ok(renewed);
                }
            } else {
                // Expired, or its proxy stopped taking leases (unhealthy, draining, gone).
                debug!(proxy = %lease.proxy.key, "session moves: its proxy no longer takes leases");
                self.release(&lease, Outcome::Ok).await;
            }
        }
        let lease = self.acquire(who, domain, Some(session_key)).await?;
        *slot = Some(lease.clone());
        Ok(lease)
    }

    /// A new lease for `who` to `domain`.
    async fn acquire(
        &self,
        who: &Who,
        domain: Option<&str>,
        session_key: Option<&str>,
    ) -> Result<HeldLease, LeaseError> {
        let selector = self.deps.store.compile(&Selector::from_terms(&who.selector));
        let request = AcquireRequest {
            selector: &selector,
            holder: &who.holder,
            ttl: self.config.lease_ttl,
            target_domain: domain,
            session_key,
            request_id: None,
        };
        let lease = self.deps.store.acquire_at(&request, self.deps.store.now_ms())?;
        debug!(proxy = %lease.proxy.key, holder = %who.holder, "gateway lease granted");
        Ok(HeldLease {
            id: lease.id,
            token: lease.fencing_token,
            expires_at_ms: lease.expires_at_ms,
            proxy: lease.proxy,
            taken_by: who.token.clone(),
        })
    }

    /// `lease` renewed for another TTL, or `None` if the store refuses (it ended).
    async fn renew(&self, lease: &HeldLease) -> Option<HeldLease> {
        let now = self.deps.store.now_ms();
        match (self.deps.store).renew_at(&lease.id, lease.token, Some(self.config.lease_ttl), now) {
            Ok(renewed) => Some(HeldLease {
                token: renewed.fencing_token,
                expires_at_ms: renewed.expires_at_ms,
                ..lease.clone()
            }),
            Err(error) => {
                debug!(proxy = %lease.proxy.key, %error, "gateway lease not renewed");
                None
            }
        }
    }

    /// Releases `lease` with `outcome` (a ban applies to its own target domain).
    async fn release(&self, lease: &HeldLease, outcome: Outcome) {
        self.release_banning(lease, outcome, None).await;
    }

    /// [`Held::release`], a ban lasting `ban_for` (`None`: the store's ban cooldown).
    async fn release_banning(&self, lease: &HeldLease, outcome: Outcome, ban_for: Option<Duration>) {
        let now = self.deps.store.now_ms();
        match (self.deps.store).release_banning_at(&lease.id, lease.token, outcome, None, ban_for, now) {
            Ok(released) => {
                let held_ms = now.saturating_sub(released.acquired_at_ms);
                let banned = outcome == Outcome::Banned;
                (self.deps.usage).lease_ended(&lease.taken_by, &released.holder, held_ms, banned);
                debug!(proxy = %lease.proxy.key, outcome = outcome.as_str(), "gateway lease released")
            }
            // Expired or revoked meanwhile: nothing is held any more.
            Err(LeaseError::NotFound) => {}
            Err(error) => {
                warn!(proxy = %lease.proxy.key, %error, "releasing a gateway lease failed; it ends at its expiry")
            }
        }
    }

    /// A request is done with `session`'s lease.
    fn let_go(&self, session: &Session) {
        session
            .last_used_ms
            .store(self.deps.store.now_ms(), Ordering::Release);
        session.uses.fetch_sub(1, Ordering::AcqRel);
    }

    /// Every `tick`: releases sessions idle for [`GatewayConfig::session_idle`] and the leases
    /// of unused sessions whose proxy stopped taking leases, and renews leases in use that have
    /// used half their time; once `stopped` resolves, releases every lease held and returns.
    pub(super) async fn upkeep(self: Arc<Self>, stopped: impl std::future::Future<Output = ()>) {
        let tick = (self.config.session_idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
        let mut stopped = std::pin::pin!(stopped);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(tick) => self.tidy(false).await,
                _ = &mut stopped => break,
            }
        }
        self.tidy(true).await;
    }

    async fn tidy(&self, all: bool) {
        let now = self.deps.store.now_ms();
        let idle = self.config.session_idle.as_millis() as u64;
        let half = self.config.lease_ttl.as_millis() as u64 / 2;
        let sessions: Vec<(SessionKey, Arc<Session>)> = lock(&self.sessions)
            .iter()
            .map(|(k, s)| (k.clone(), s.clone()))
            .collect();
        for (key, session) in sessions {
            // A request holds the lock: the session is in use.
            let Ok(mut slot) = session.lease.try_lock() else {
                continue;
            };
            let in_use = session.uses.load(Ordering::Acquire) > 0;
            let idle_since = session.last_used_ms.load(Ordering::Acquire);
            if all || (!in_use && now.saturating_sub(idle_since) >= idle) {
                if let Some(lease) = slot.take() {
                    debug!(proxy = %lease.proxy.key, "idle gateway session released");
                    self.release(&lease, Outcome::Ok).await;
                }
                session.closed.store(true, Ordering::Release);
                let mut sessions = lock(&self.sessions);
                if sessions.get(&key).is_some_and(|s| Arc::ptr_eq(s, &session)) {
                    sessions.remove(&key);
                }
                continue;
            }
            // Its proxy stopped taking leases (draining, unhealthy, gone): the session's next
            // request would move anyway, so give the lease back now: a drain (the proxy's
            // deletion or replacement) does not wait for the session to go idle.
            if !in_use && let Some(lease) = slot.take_if(|lease| !self.deps.store.admits(&lease.proxy.key)) {
                debug!(
                    proxy = %lease.proxy.key,
                    "unused gateway session released: its proxy no longer takes leases"
                );
                self.release(&lease, Outcome::Ok).await;
                continue;
            }
            if in_use
                && let Some(lease) = slot.as_ref()
                && lease.expires_at_ms.saturating_sub(now) < half
            {
                let renewed = self.renew(lease).await;
                *slot = renewed;
            }
        }
        let loose: Vec<(u64, HeldLease)> = lock(&self.loose)
            .iter()
            .filter(|(_, l)| all || l.expires_at_ms.saturating_sub(now) < half)
            .map(|(n, l)| (*n, l.clone()))
            .collect();
        for (n, lease) in loose {
            if all {
                if lock(&self.loose).remove(&n).is_some() {
                    self.release(&lease, Outcome::Ok).await;
                }
                continue;
            }
            let Some(renewed) = self.renew(&lease).await else {
                continue;
            };
            // Only if the request still holds it (it may have ended meanwhile, and its
            // release then used the old token: the lease ends at its expiry).
            if let Some(entry) = lock(&self.loose).get_mut(&n) {
                *entry = renewed;
            }
        }
    }
}
