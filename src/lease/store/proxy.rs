//! One proxy's state in its shard ([`ProxyState`]) and its leases ([`LeaseRecord`]).

use std::sync::Arc;

use smol_str::SmolStr;

use crate::{
    api::ProxyKey,
    lease::{LeaseClaim, LeaseHint, LeaseId, LeaseTarget, ProxyInfo, token::IssuedId},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AdmissionState {
    Open,
    Closed,
    Draining,
}

#[derive(Debug)]
pub(super) struct LeaseRecord {
    pub(super) first_token: u64,
    pub(super) token: u64,
    pub(super) acquired_at: u64,
    pub(super) expires_at: u64,
    /// What the holder asked for (capped), the default length of a renewal.
    pub(super) ttl_ms: u64,
    /// Kept inline up to 23 bytes (holder names are short): no allocation or free per lease
    /// on the hot path; a released lease hands it on ([`crate::lease::Released::holder`]).
    pub(super) holder: SmolStr,
    pub(super) target_domain: Option<Box<str>>,
    pub(super) session_key: Option<Box<str>>,
    /// The request ID it was granted for, if any (kept so a checkpoint can rebuild the index).
    pub(super) request_id: Option<Box<str>>,
    /// Loaded from a checkpoint and not touched since: the holder may hold a newer token
    /// (a renewal the checkpoint missed), so a higher presented token is taken as current.
    pub(super) restored: bool,
    /// The lease ID this process issued for it (a cached verdict: renewals and releases
    /// presenting that very ID skip the HMAC). `None` for leases restored or reinstated until
    /// their ID has been verified once in full.
    pub(super) issued_id: Option<IssuedId>,
}

/// One proxy as the store holds it: its lease limits, admission, cooldown, bans and leases.
#[derive(Debug)]
pub(super) struct ProxyState {
    /// The proxy.
    pub(super) key: ProxyKey,
    /// `None` while only restored from a checkpoint and not configured again yet.
    pub(super) info: Option<Arc<ProxyInfo>>,
    /// Its attributes as interned `key=value` ids, sorted (what selectors match).
    pub(super) pairs: Vec<u32>,
    /// Leases it may hold at once.
    pub(super) max_concurrent: u32,
    /// Rest after each release.
    pub(super) cooldown_ms: u64,
    /// Longest TTL a holder may ask for.
    pub(super) max_ttl_ms: u64,
    /// Whether it takes new leases and renewals.
    pub(super) admission: AdmissionState,
    /// Closed by the engine while it was open (health checks failing, or being replaced):
    /// renewals say so ([`crate::lease::Renewed::out_of_rotation`]). Not set by a restart's
    /// closed-until-probed state, which says nothing about the instance.
    pub(super) out_of_rotation: bool,
    /// End of its cooldown (0 or past: not resting).
    pub(super) cooling_until: u64,
    /// Per-domain bans: (domain, end), expired ones dropped lazily.
    pub(super) bans: Vec<(Box<str>, u64)>,
    /// Its active leases.
    pub(super) leases: Vec<LeaseRecord>,
    /// In its shard's list of eligible proxies (open, a free slot, not resting).
    pub(super) linked: bool,
    /// Leases whose first token is below this were revoked: never reinstated.
    pub(super) revoked_below: u64,
    /// For restored, unconfigured entries: dropped by the reaper after this time.
    pub(super) parked_until: u64,
    /// When its entry in the shard's expiry heap is due (0: none); never after its earliest
    /// lease expiry, so [`super::shard::Shard::settle`] sees every expiry on time.
    pub(super) check_at: u64,
    /// In its shard's list of proxies changed since the last checkpoint
    /// ([`super::shard::Shard::mark`]).
    pub(super) changed: bool,
}

impl LeaseRecord {
    /// What this lease's ID says: it as granted on `key`, kept at `hint` (its first expiry is
    /// the grant's TTL, capped, from the grant).
    pub(super) fn claim(&self, key: &ProxyKey, hint: LeaseHint) -> LeaseClaim {
        LeaseClaim {
            id: LeaseId {
                key: key.clone(),
                first_token: self.first_token,
                hint,
            },
            holder: self.holder.as_str().to_owned(),
            acquired_at_ms: self.acquired_at,
            expires_at_ms: self.acquired_at + self.ttl_ms,
            target_domain: self.target_domain.as_deref().map(str::to_owned),
            session_key: self.session_key.as_deref().map(str::to_owned),
        }
    }
}

impl ProxyState {
    pub(super) fn new(key: ProxyKey) -> Self {
        Self {
            key,
            info: None,
            pairs: Vec::new(),
            max_concurrent: 1,
            cooldown_ms: 0,
            max_ttl_ms: 3_600_000,
            admission: AdmissionState::Closed,
            out_of_rotation: false,
            cooling_until: 0,
            bans: Vec::new(),
            leases: Vec::new(),
            linked: false,
            revoked_below: 0,
            parked_until: 0,
            check_at: 0,
            changed: false,
        }
    }

    #[inline]
    pub(super) fn banned_for(&self, domain: Option<&str>, now: u64) -> bool {
        match domain {
            None => false,
            Some(d) => self.bans.iter().any(|(b, until)| *until > now && &**b == d),
        }
    }

    #[inline]
    pub(super) fn eligible(&self, now: u64) -> bool {
        self.info.is_some()
            && self.admission == AdmissionState::Open
            && self.cooling_until <= now
            && (self.leases.len() as u32) < self.max_concurrent
    }

    pub(super) fn apply_policy(&mut self, target: &LeaseTarget) {
        self.max_concurrent = target.policy.max_concurrent.max(1) as u32;
        self.cooldown_ms = target.policy.cooldown_seconds.max(0) as u64 * 1000;
        self.max_ttl_ms = target.policy.max_ttl_seconds.max(1) as u64 * 1000;
    }
}
