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

mod held;
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

pub use self::shard::DrainedHook;
use self::{
    proxy::{AdmissionState, LeaseRecord},
    shard::Shard,
    snapshot::RestoreInfo,
};
use super::{
    Admission, DrainStatus, ExpiredLease, LeaseError, LeaseStoreConfig, LeaseTarget, ProxyInfo, ProxyKey,
    selector::Interner,
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
    /// Each shard's [`Shard::proxies`], in shard order.
    shard_proxies: Box<[Arc<std::sync::atomic::AtomicUsize>]>,
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
                shard_proxies: shard_vec.iter().map(|s| lock(&s.0).proxies.clone()).collect(),
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

    /// Calls `hook` with a draining proxy's key when its last lease ends (a release or an
    /// expiry), so whoever waits for the drain looks again now rather than at its next poll.
    pub fn on_drained(&self, hook: DrainedHook) {
        for shard in self.inner.shards.iter() {
            lock(&shard.0).on_drained = Some(hook.clone());
        }
    }

    /// Closes a proxy and refuses renewals of its leases; `Drained` once none is active.
    /// Call again to poll (or be told: [`Self::on_drained`]). An unknown proxy is drained.
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
