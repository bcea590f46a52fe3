//! The operations on one held lease: finding it (by its ID, or by a presented ID the store
//! kept), checking it without a change (what an outcome report needs), renewing and releasing
//! it, and keeping the ID issued for it.

use std::time::Duration;

use super::{LeaseStore, normalize_domain, proxy::AdmissionState, shard::Shard};
use crate::{
    lease::{
        Checked, LeaseError, LeaseId, Outcome, Released, Renewed,
        checkpoint::BanCheckpoint,
        token::{IssuedId, PresentedId},
    },
    sync::lock,
};

impl LeaseStore {
    /// Runs `f` on the lease's record in its settled shard: an expired lease is not found.
    pub(super) fn with_lease<R>(
        &self,
        id: &LeaseId,
        now: u64,
        f: impl FnOnce(&mut Shard, u32, usize) -> Result<R, LeaseError>,
    ) -> Result<R, LeaseError> {
        self.locate(id, Some(now), f)
    }

    /// Runs `f` on the lease's record, its shard settled at `settle_at` first if given (else
    /// as it stands: a lease that expired since the last settle is still there).
    fn locate<R>(
        &self,
        id: &LeaseId,
        settle_at: Option<u64>,
        f: impl FnOnce(&mut Shard, u32, usize) -> Result<R, LeaseError>,
    ) -> Result<R, LeaseError> {
        let find = |shard: &Shard, slot: u32| {
            shard
                .proxy(slot)
                .leases
                .iter()
                .position(|l| l.first_token == id.first_token)
        };
        let settle = |shard: &mut Shard| {
            if let Some(now) = settle_at {
                shard.settle(now);
            }
        };
        let hinted = id.hint.shard as usize;
        if hinted < self.inner.shards.len() {
            let mut shard = lock(&self.inner.shards[hinted].0);
            settle(&mut shard);
            if let Some(slot) = shard.slot_by_hint(id) {
                let idx = find(&shard, slot).ok_or(LeaseError::NotFound)?;
                return f(&mut shard, slot, idx);
            }
        }
        let mut shard = self.shard_for(&id.key);
        settle(&mut shard);
        let slot = shard.by_key.get(&id.key).copied().ok_or(LeaseError::NotFound)?;
        let idx = find(&shard, slot).ok_or(LeaseError::NotFound)?;
        f(&mut shard, slot, idx)
    }

    fn check_token(shard: &mut Shard, slot: u32, idx: usize, presented: u64) -> Result<(), LeaseError> {
        let rec = &mut shard.proxy_mut(slot).leases[idx];
        if presented == rec.token {
            return Ok(());
        }
        if rec.restored && presented > rec.token {
            // A renewal the checkpoint missed: the holder's token is the newer one.
            rec.token = presented;
            rec.restored = false;
            shard.observe_token(presented);
            return Ok(());
        }
        Err(LeaseError::StaleToken {
            presented,
            current: rec.token,
        })
    }

    /// Extends a lease by `ttl` from now (default: its first TTL), capped by `maxTtlSeconds`,
    /// and issues a new fencing token.
    pub fn renew(&self, id: &LeaseId, token: u64, ttl: Option<Duration>) -> Result<Renewed, LeaseError> {
        self.renew_at(id, token, ttl, self.now())
    }

    /// [`LeaseStore::renew`] at `now` ([`LeaseStore::now_ms`]).
    pub fn renew_at(
        &self,
        id: &LeaseId,
        token: u64,
        ttl: Option<Duration>,
        now: u64,
    ) -> Result<Renewed, LeaseError> {
        if ttl.is_some_and(|t| t.is_zero()) {
            return Err(LeaseError::Invalid("ttl must be positive".into()));
        }
        self.with_lease(id, now, |shard, slot, idx| {
            Self::renew_in(shard, slot, idx, token, ttl, now)
        })
    }

    fn renew_in(
        shard: &mut Shard,
        slot: u32,
        idx: usize,
        token: u64,
        ttl: Option<Duration>,
        now: u64,
    ) -> Result<Renewed, LeaseError> {
        Self::check_token(shard, slot, idx, token)?;
        if shard.proxy(slot).admission == AdmissionState::Draining {
            return Err(LeaseError::Draining);
        }
        let new_token = shard.next_token(now);
        let p = shard.proxy_mut(slot);
        let out_of_rotation = p.out_of_rotation;
        let max_ttl = p.max_ttl_ms;
        let rec = &mut p.leases[idx];
        let ttl_ms = ttl.map_or(rec.ttl_ms, |t| t.as_millis() as u64);
        rec.token = new_token;
        rec.restored = false;
        rec.expires_at = now + ttl_ms.min(max_ttl);
        let expires_at_ms = rec.expires_at;
        shard.mark(slot);
        shard.schedule_expiry(slot, expires_at_ms);
        Ok(Renewed {
            fencing_token: new_token,
            expires_at_ms,
            out_of_rotation,
        })
    }

    /// Ends a lease. The proxy rests for its cooldown; `Banned` also rests it for the domain
    /// (`target_domain`, or the lease's own).
    pub fn release(
        &self,
        id: &LeaseId,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
    ) -> Result<Released, LeaseError> {
        self.release_at(id, token, outcome, target_domain, self.now())
    }

    /// [`LeaseStore::release`] at `now` ([`LeaseStore::now_ms`]); returns the ban and cooldown
    /// it started.
    pub fn release_at(
        &self,
        id: &LeaseId,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
        now: u64,
    ) -> Result<Released, LeaseError> {
        self.release_banning_at(id, token, outcome, target_domain, None, now)
    }

    /// [`LeaseStore::release_at`], a `banned` outcome resting the proxy for the domain for
    /// `ban_for` instead of the store's [`crate::lease::LeaseStoreConfig::ban_cooldown`] (`None`: that one).
    /// The gateway's rules use it for a short rest (a cooldown for the domain) and their own
    /// ban durations.
    pub fn release_banning_at(
        &self,
        id: &LeaseId,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
        ban_for: Option<Duration>,
        now: u64,
    ) -> Result<Released, LeaseError> {
        let ban_ms = self.ban_ms(ban_for);
        self.with_lease(id, now, |shard, slot, idx| {
            Self::release_in(shard, slot, idx, token, outcome, target_domain, ban_ms, now)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn release_in(
        shard: &mut Shard,
        slot: u32,
        idx: usize,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
        ban_ms: u64,
        now: u64,
    ) -> Result<Released, LeaseError> {
        Self::check_token(shard, slot, idx, token)?;
        let p = shard.proxy_mut(slot);
        let ban = match outcome {
            Outcome::Banned => Some(
                target_domain
                    .map(normalize_domain)
                    .or_else(|| p.leases[idx].target_domain.as_deref().map(normalize_domain))
                    .ok_or(LeaseError::BanNeedsDomain)?,
            ),
            Outcome::Ok | Outcome::Error => None,
        };
        let ended = p.leases.swap_remove(idx);
        let ban = ban.map(|domain| {
            p.bans.retain(|(d, until)| *until > now && **d != *domain);
            p.bans.push((domain.as_str().into(), now + ban_ms));
            BanCheckpoint {
                domain,
                until_ms: now + ban_ms,
            }
        });
        shard.active -= 1;
        shard.mark(slot);
        shard.start_cooldown(slot, now, now);
        shard.relink(slot, now, true);
        shard.tell_if_drained(slot);
        let cooling_until = shard.proxy(slot).cooling_until;
        Ok(Released {
            ban,
            cooldown_until_ms: (cooling_until > now).then_some(cooling_until),
            holder: ended.holder,
            acquired_at_ms: ended.acquired_at,
        })
    }

    /// Runs `f` on the lease a presented ID names if the presented ID is the one the store kept
    /// for it ([`IssuedId`]); `None` otherwise (no such lease, one restored without its ID, or a
    /// different ID): then the ID must be verified in full and the operation run by [`LeaseId`].
    /// Also returns the lease's ID.
    fn with_presented<R>(
        &self,
        presented: &PresentedId<'_>,
        now: u64,
        f: impl FnOnce(&mut Shard, u32, usize) -> Result<R, LeaseError>,
    ) -> Option<Result<(R, LeaseId), LeaseError>> {
        let hint = presented.hint;
        let mut shard = lock(&self.inner.shards.get(hint.shard as usize)?.0);
        shard.settle(now);
        let s = shard.slots.get(hint.slot as usize)?;
        if s.generation != hint.generation {
            return None;
        }
        let p = s.proxy.as_ref()?;
        let idx = p
            .leases
            .iter()
            .position(|l| l.first_token == presented.first_token)?;
        if !p.leases[idx]
            .issued_id
            .as_ref()?
            .matches(presented.text.as_bytes())
        {
            return None;
        }
        // The ID is the one issued for this lease, so its key is the proxy's (no need to
        // compare the key the slot hint is checked against otherwise).
        let id = LeaseId {
            key: p.key.clone(),
            first_token: presented.first_token,
            hint,
        };
        Some(f(&mut shard, hint.slot, idx).map(|r| (r, id)))
    }

    /// Keeps `text` as the verdict for the lease `id` names ([`IssuedId`]): call it with the
    /// ID just issued for it, or just verified in full.
    pub fn keep_issued_id(&self, id: &LeaseId, text: &str) {
        // Not settled (no clock read either): a lease that expired a moment ago keeps an ID
        // nobody can use, and the next operation on its shard settles it away with the ID.
        let _ = self.locate(id, None, |shard, slot, idx| {
            shard.proxy_mut(slot).leases[idx].issued_id = Some(IssuedId::new(text));
            Ok(())
        });
    }

    /// [`LeaseStore::renew_at`] by a presented lease ID the store kept; `None`: it keeps none
    /// for that ID (verify it in full, then call [`LeaseStore::renew_at`]).
    pub fn renew_presented_at(
        &self,
        presented: &PresentedId<'_>,
        token: u64,
        ttl: Option<Duration>,
        now: u64,
    ) -> Option<Result<(Renewed, LeaseId), LeaseError>> {
        if ttl.is_some_and(|t| t.is_zero()) {
            return Some(Err(LeaseError::Invalid("ttl must be positive".into())));
        }
        self.with_presented(presented, now, |shard, slot, idx| {
            Self::renew_in(shard, slot, idx, token, ttl, now)
        })
    }

    /// [`LeaseStore::release_at`] by a presented lease ID the store kept; `None`: it keeps none
    /// for that ID (verify it in full, then call [`LeaseStore::release_at`]).
    pub fn release_presented_at(
        &self,
        presented: &PresentedId<'_>,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
        ban_for: Option<Duration>,
        now: u64,
    ) -> Option<Result<(Released, LeaseId), LeaseError>> {
        let ban_ms = self.ban_ms(ban_for);
        self.with_presented(presented, now, |shard, slot, idx| {
            Self::release_in(shard, slot, idx, token, outcome, target_domain, ban_ms, now)
        })
    }

    /// How long a ban lasts, in ms: `ban_for`, else the store's ban cooldown.
    fn ban_ms(&self, ban_for: Option<Duration>) -> u64 {
        ban_for.unwrap_or(self.inner.config.ban_cooldown).as_millis() as u64
    }

    /// [`LeaseStore::check_at`] by a presented lease ID the store kept; `None`: it keeps none
    /// for that ID (verify it in full, then call [`LeaseStore::check_at`]).
    pub fn check_presented_at(
        &self,
        presented: &PresentedId<'_>,
        token: u64,
        now: u64,
    ) -> Option<Result<Checked, LeaseError>> {
        self.with_presented(presented, now, |shard, slot, idx| {
            Self::check_in(shard, slot, idx, token)
        })
        .map(|result| result.map(|(checked, _)| checked))
    }

    /// The lease `id` names, if it is live and `token` is its current token (the errors are a
    /// renewal's: not found, stale token).
    pub fn check_at(&self, id: &LeaseId, token: u64, now: u64) -> Result<Checked, LeaseError> {
        self.with_lease(id, now, |shard, slot, idx| {
            Self::check_in(shard, slot, idx, token)
        })
    }

    fn check_in(shard: &mut Shard, slot: u32, idx: usize, token: u64) -> Result<Checked, LeaseError> {
        Self::check_token(shard, slot, idx, token)?;
        let p = shard.proxy(slot);
        Ok(Checked {
            proxy: p.key.clone(),
            target_domain: p.leases[idx].target_domain.as_deref().map(str::to_owned),
            holder: p.leases[idx].holder.as_str().to_owned(),
        })
    }
}
