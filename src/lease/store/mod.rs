//! The store itself: sharded per-proxy state, LRU lists per attribute pair, cooldown heaps,
//! sticky sessions, and the snapshot/restore of all of it.
//!
//! Layout, for speed: a proxy lives in the shard its key hashes to, in a slab slot (`Vec`
//! indexed by slot number, reused with a generation counter). Each shard keeps one intrusive
//! doubly linked LRU list of its *eligible* proxies (open, a free slot, not cooling down) plus one
//! per attribute pair, plus one per *indexed combination* (a selector of two or more terms,
//! indexed the first time it is compiled, up to [`MAX_INDEXED_COMBINATIONS`]). An acquire walks
//! the list its selector names (its combination's, or else its rarest term's) and takes the
//! first proxy that matches every term and is not banned for the domain. Acquire and release
//! are O(lists a proxy is in) in the common case, under one short shard lock, with no
//! allocation beyond the holder string.
//!
//! Files: this one holds the [`LeaseStore`] handle and the operations on one proxy or one
//! lease (configure, admission, drain, renew, release, reap); `proxy` one proxy's state and
//! lease records; `shard` a shard's slab, LRU lists and expiry/cooldown heaps; `select` the
//! choice of a proxy (selector compilation, the combination index, acquire and its shard
//! cursor, listing); `request` acquires by request ID (idempotent); `snapshot` checkpoints,
//! restore and the reinstatement of claimed leases.
//! The small helpers the hot path calls from one file into another are `#[inline]`, so the
//! split into files (and so into codegen units) costs the acquire path no calls.

mod check;
mod proxy;
mod request;
mod select;
mod shard;
mod snapshot;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, RwLock, atomic::AtomicU64},
    time::Duration,
};

#[cfg(test)]
pub(crate) use select::BURST;

use self::{
    proxy::{AdmissionState, LeaseRecord},
    shard::Shard,
    snapshot::RestoreInfo,
};
use super::{
    Admission, DrainStatus, ExpiredLease, LeaseError, LeaseId, LeaseStoreConfig, LeaseTarget, Outcome,
    ProxyInfo, ProxyKey, Released, Renewed,
    checkpoint::BanCheckpoint,
    selector::Interner,
    token::{IssuedId, PresentedId},
};
use crate::sync::{lock, read, write};

/// Most shards a store may have (the shard number is kept in the low bits of each token).
pub const MAX_SHARDS: usize = 1 << SHARD_BITS;
const SHARD_BITS: u32 = 5;
/// Tokens per millisecond per shard that the clock-seeded sequence allows before it runs ahead
/// of the clock; also keeps tokens below 2^53 until the 2100s.
const SEQ_PER_MS: u64 = 64;
/// On restore, the sequence jumps this far past the checkpoint's high-water mark, so tokens
/// issued after the checkpoint by the previous process stay below ours (one minute's worth).
const RESTORE_SEQ_RESERVE: u64 = SEQ_PER_MS * 60_000;
/// Retry-After when nothing is cooling down (nothing will change on its own soon).
const DEFAULT_RETRY: Duration = Duration::from_secs(5);
const NIL: u32 = u32::MAX;
const SESSION_SHARDS: usize = 16;
/// Most attribute combinations (selectors of two or more terms) that get an LRU list of their
/// own. Each costs one link per matching proxy per shard; selectors beyond the cap still work,
/// walking their rarest term's list instead.
pub const MAX_INDEXED_COMBINATIONS: usize = 64;
/// List ids from here on name combination lists (kept apart from the per-pair lists, whose
/// ids grow with the number of distinct pairs ever interned).
const COMBINATION_BASE: u32 = 1 << 31;
/// Keeps two shards' locks off one cache line.
#[repr(align(128))]
struct Padded<T>(T);
/// A sticky-session binding.
#[derive(Clone, Debug)]
struct Binding {
    key: ProxyKey,
    expires_at: u64,
    /// In its session shard's `changed` list.
    changed: bool,
}

/// Sticky-session bindings of one session shard, and those changed since the last checkpoint
/// took them (each once: its `changed` flag).
#[derive(Default)]
struct SessionMap {
    map: HashMap<Box<str>, Binding>,
    changed: Vec<Box<str>>,
}

impl SessionMap {
    /// Notes that the binding of `session` changed (the next delta checkpoint writes it).
    fn mark(&mut self, session: &str) {
        if let Some(binding) = self.map.get_mut(session)
            && !binding.changed
        {
            binding.changed = true;
            self.changed.push(session.into());
        }
    }

    /// Forgets the changes noted since the last checkpoint.
    fn clear_changes(&mut self) {
        for session in std::mem::take(&mut self.changed) {
            if let Some(binding) = self.map.get_mut(&session) {
                binding.changed = false;
            }
        }
    }
}
struct Inner {
    shards: Box<[Padded<Mutex<Shard>>]>,
    /// Per shard, the thread that last started acquires in it ([`select::owner_word`]): read and
    /// written once per [`select::BURST`], kept off the locks' lines.
    owners: Box<[Padded<AtomicU64>]>,
    sessions: Box<[Padded<Mutex<SessionMap>>]>,
    /// Acquires by request ID ([`request`]).
    requests: Box<[Padded<Mutex<request::Requests>>]>,
    interner: RwLock<Interner>,
    /// Indexed combinations (sorted pair ids) and their list ids; every shard has their lists.
    combinations: RwLock<HashMap<Box<[u32]>, u32>>,
    restore: RwLock<RestoreInfo>,
    config: LeaseStoreConfig,
    hasher: std::hash::RandomState,
}

/// The lease store: a cheap, cloneable handle (`Send + Sync`). See the module docs.
#[derive(Clone)]
pub struct LeaseStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LeaseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseStore")
            .field("shards", &self.inner.shards.len())
            .finish_non_exhaustive()
    }
}

/// FNV-1a: a fixed hash, so a key lands in the same shard in every process.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn normalize_domain(domain: &str) -> String {
    domain.trim_end_matches('.').to_ascii_lowercase()
}
impl LeaseStore {
    /// An empty store.
    pub fn new(config: LeaseStoreConfig) -> Self {
        let shards = config.shards.clamp(1, MAX_SHARDS);
        let now = config.clock.now_ms();
        let shard_vec: Vec<_> = (0..shards)
            .map(|i| {
                let mut s = Shard::new(i as u16);
                s.seq = now * SEQ_PER_MS;
                Padded(Mutex::new(s))
            })
            .collect();
        let sessions: Vec<_> = (0..SESSION_SHARDS)
            .map(|_| Padded(Mutex::new(SessionMap::default())))
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards: shard_vec.into_boxed_slice(),
                owners: (0..shards).map(|_| Padded(AtomicU64::new(0))).collect(),
                sessions: sessions.into_boxed_slice(),
                requests: (0..request::SHARDS).map(|_| Padded(Mutex::default())).collect(),
                interner: RwLock::new(Interner::default()),
                combinations: RwLock::new(HashMap::new()),
                restore: RwLock::new(RestoreInfo {
                    hwm: HashMap::new(),
                    seq_floor: now * SEQ_PER_MS,
                    unconfirmed_until: 0,
                }),
                config,
                hasher: std::hash::RandomState::new(),
            }),
        }
    }

    /// The store's settings.
    pub fn config(&self) -> &LeaseStoreConfig {
        &self.inner.config
    }

    #[inline]
    fn now(&self) -> u64 {
        self.inner.config.clock.now_ms()
    }

    /// The store clock's time (ms since the epoch): read it once per request and pass it to
    /// the `*_at` operations, so every answer to that request is about the same instant.
    pub fn now_ms(&self) -> u64 {
        self.now()
    }

    #[inline]
    fn shard_index(&self, key: &ProxyKey) -> usize {
        (fnv1a(key.as_str().as_bytes()) % self.inner.shards.len() as u64) as usize
    }

    #[inline]
    fn shard_for(&self, key: &ProxyKey) -> MutexGuard<'_, Shard> {
        lock(&self.inner.shards[self.shard_index(key)].0)
    }

    /// Adds a proxy, or updates its endpoint, credentials, attributes and limits in place.
    /// Never drops leases; a lower `maxConcurrent` only stops new leases until enough end.
    /// A new proxy starts `Closed`.
    pub fn upsert_proxy(&self, target: LeaseTarget) {
        let pairs = write(&self.inner.interner).intern_all(&target.attributes);
        let info = Arc::new(ProxyInfo::new(&target));
        let now = self.now();
        let mut shard = self.shard_for(&target.key);
        let slot = match shard.by_key.get(&target.key) {
            Some(slot) => *slot,
            None => shard.allocate(target.key.clone()),
        };
        if shard.proxy(slot).pairs != pairs {
            shard.set_pairs(slot, pairs);
        }
        let p = shard.proxy_mut(slot);
        p.info = Some(info);
        p.parked_until = 0;
        p.apply_policy(&target);
        shard.mark(slot);
        shard.relink(slot, now, false);
    }

    /// Opens or closes a proxy for new leases (the engine's enable/disable effects). Opening
    /// also ends a drain.
    pub fn set_admission(&self, key: &ProxyKey, admission: Admission) -> Result<(), LeaseError> {
        let now = self.now();
        let mut shard = self.shard_for(key);
        let slot = *shard
            .by_key
            .get(key)
            .ok_or_else(|| LeaseError::UnknownProxy(key.clone()))?;
        let p = shard.proxy_mut(slot);
        p.out_of_rotation = match admission {
            Admission::Open => false,
            Admission::Closed => p.out_of_rotation || p.admission == AdmissionState::Open,
        };
        p.admission = match admission {
            Admission::Open => AdmissionState::Open,
            Admission::Closed => AdmissionState::Closed,
        };
        shard.mark(slot);
        shard.relink(slot, now, false);
        Ok(())
    }

    /// Closes a proxy and refuses renewals of its leases; `Drained` once none is active.
    /// Call again to poll. An unknown proxy is drained.
    pub fn drain(&self, key: &ProxyKey) -> DrainStatus {
        let now = self.now();
        let mut shard = self.shard_for(key);
        let Some(slot) = shard.by_key.get(key).copied() else {
            return DrainStatus::Drained;
        };
        shard.settle(now);
        let p = shard.proxy_mut(slot);
        if p.admission != AdmissionState::Draining {
            p.admission = AdmissionState::Draining;
            shard.mark(slot);
        }
        shard.relink(slot, now, false);
        match shard.proxy(slot).leases.len() {
            0 => DrainStatus::Drained,
            active => DrainStatus::Pending { active },
        }
    }

    /// Drops every lease on a proxy at once; returns how many. Their IDs are refused from now
    /// on, even as claims after a restart.
    pub fn revoke_all(&self, key: &ProxyKey) -> usize {
        let now = self.now();
        let mut shard = self.shard_for(key);
        let Some(slot) = shard.by_key.get(key).copied() else {
            return 0;
        };
        let below = (shard.seq + 1) << SHARD_BITS;
        let p = shard.proxy_mut(slot);
        let revoked = p.leases.len();
        p.leases.clear();
        p.revoked_below = below;
        shard.active -= revoked;
        shard.mark(slot);
        shard.relink(slot, now, false);
        revoked
    }

    /// Forgets a proxy and its leases.
    pub fn remove_proxy(&self, key: &ProxyKey) {
        let mut shard = self.shard_for(key);
        if let Some(slot) = shard.by_key.get(key).copied() {
            shard.remove_slot(slot);
        }
    }

    /// Leases a drain or a deletion of `key` waits for: every live lease, except a restored one
    /// its holder has not confirmed once [`LeaseStoreConfig::unconfirmed_grace`] has passed since
    /// the restore (it may have been released just before a crash; its holder would never end
    /// it, and waiting its whole TTL would hold the lifecycle up).
    pub fn leases_to_wait_for(&self, key: &ProxyKey) -> usize {
        let unconfirmed_until = read(&self.inner.restore).unconfirmed_until;
        let now = self.now();
        self.count_leases(key, now, |l| !l.restored || now < unconfirmed_until)
    }

    /// Counts every restored lease as confirmed (drains and deletions wait for it): the
    /// restored state is exact, not possibly stale (standalone mode with the lease journal).
    pub fn trust_restored(&self) {
        write(&self.inner.restore).unconfirmed_until = u64::MAX;
    }

    /// End of `key`'s cooldown at `now`, if it rests (what a release's journal record keeps).
    pub fn cooldown_until(&self, key: &ProxyKey, now: u64) -> Option<u64> {
        let shard = self.shard_for(key);
        let slot = shard.by_key.get(key)?;
        let until = shard.proxy(*slot).cooling_until;
        (until > now).then_some(until)
    }

    /// `domain` as bans and journal records keep it.
    pub fn normalize_domain(domain: &str) -> String {
        normalize_domain(domain)
    }

    /// Whether `key` takes new leases now (known, open, not draining): what a holder that
    /// keeps one lease across many uses checks before each use (the proxy may have turned
    /// unhealthy since, which closes it but lets its leases run on).
    pub fn admits(&self, key: &ProxyKey) -> bool {
        let shard = self.shard_for(key);
        shard.by_key.get(key).is_some_and(|slot| {
            let p = shard.proxy(*slot);
            p.info.is_some() && p.admission == AdmissionState::Open
        })
    }

    /// Active (unexpired) leases on a proxy; 0 if unknown.
    pub fn active_leases(&self, key: &ProxyKey) -> usize {
        self.count_leases(key, self.now(), |_| true)
    }

    /// Unexpired leases on `key` at `now` that `keep` accepts; 0 if unknown.
    fn count_leases(&self, key: &ProxyKey, now: u64, keep: impl Fn(&LeaseRecord) -> bool) -> usize {
        let shard = self.shard_for(key);
        shard.by_key.get(key).map_or(0, |slot| {
            shard
                .proxy(*slot)
                .leases
                .iter()
                .filter(|l| l.expires_at > now && keep(l))
                .count()
        })
    }

    /// Active (unexpired) leases in the whole store.
    pub fn active_total(&self) -> usize {
        let now = self.now();
        self.inner
            .shards
            .iter()
            .map(|s| {
                let mut shard = lock(&s.0);
                shard.settle(now);
                shard.active
            })
            .sum()
    }

    /// Number of proxies in the store.
    pub fn proxy_count(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(&s.0).by_key.len()).sum()
    }

    /// Runs `f` on the lease's record in its settled shard: an expired lease is not found.
    fn with_lease<R>(
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
    /// `ban_for` instead of the store's [`LeaseStoreConfig::ban_cooldown`] (`None`: that one).
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

    /// The leases that ended at their expiry since the last call, each once (at most
    /// [`shard::MAX_EXPIRED_KEPT`] a shard between two calls): the reaper or an acquire ended
    /// them, and no holder released them.
    pub fn take_expired(&self) -> Vec<ExpiredLease> {
        let mut all = Vec::new();
        for shard in self.inner.shards.iter() {
            all.append(&mut lock(&shard.0).expired);
        }
        all
    }

    /// Removes expired leases, bans, bindings and parked entries; returns the number of
    /// leases that expired.
    pub fn reap(&self) -> usize {
        let now = self.now();
        let mut expired = 0;
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            expired += shard.settle(now);
            for slot in 0..shard.slots.len() as u32 {
                if shard.slots[slot as usize].proxy.is_none() {
                    continue;
                }
                let p = shard.proxy_mut(slot);
                p.bans.retain(|(_, until)| *until > now);
                if p.info.is_none() && p.leases.is_empty() && p.parked_until <= now {
                    shard.remove_slot(slot);
                }
            }
            shard.reinstated.retain(|_, until| *until > now);
        }
        for sessions in self.inner.sessions.iter() {
            lock(&sessions.0).map.retain(|_, b| b.expires_at > now);
        }
        expired
    }
}
