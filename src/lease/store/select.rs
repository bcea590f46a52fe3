//! Choosing a proxy: selector compilation and the combination index, the per-thread shard
//! cursor, acquire (plain and sticky), the refusal's Retry-After, and listing.

use std::{
    cell::Cell,
    collections::HashMap,
    hash::BuildHasher,
    sync::{
        TryLockError,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use super::{
    Binding, COMBINATION_BASE, DEFAULT_RETRY, LeaseStore, MAX_INDEXED_COMBINATIONS, NIL, SESSION_SHARDS,
    normalize_domain,
    proxy::{AdmissionState, ProxyState},
    shard::{Link, ListHead, Shard, link_of},
};
use crate::{
    api::ProxyKey,
    lease::{
        AcquireRequest, Availability, CompiledSelector, Granted, Lease, LeaseError, LeaseView, ProxyView,
        Selector, selector::is_sorted_subset,
    },
    sync::{lock, read, write},
};

impl Shard {
    pub(super) fn set_pairs(&mut self, slot: u32, pairs: Vec<u32>) {
        let was_linked = self.proxy(slot).linked;
        if was_linked {
            self.unlink(slot);
        }
        let combinations = self
            .combinations
            .iter()
            .enumerate()
            .filter(|(_, terms)| is_sorted_subset(terms, &pairs))
            .map(|(i, _)| COMBINATION_BASE + i as u32);
        let links: Vec<Link> = std::iter::once(0)
            .chain(pairs.iter().map(|p| p + 1))
            .chain(combinations)
            .map(|list| Link {
                list,
                prev: NIL,
                next: NIL,
            })
            .collect();
        if let Some(max) = pairs.iter().max().map(|p| p + 1)
            && self.lists.len() <= max as usize
        {
            self.lists.resize(max as usize + 1, ListHead::EMPTY);
        }
        self.links[slot as usize] = links;
        self.proxy_mut(slot).pairs = pairs;
        if was_linked {
            self.link_tail(slot);
        }
    }

    /// Gives the combination `terms` an LRU list (id `list`) holding every matching proxy;
    /// eligible ones join in their current LRU order, so the new list is as fair as the others.
    pub(super) fn add_combination(&mut self, terms: &[u32], list: u32) {
        debug_assert_eq!(list - COMBINATION_BASE, self.combinations.len() as u32);
        self.combinations.push(terms.into());
        self.combination_lists.push(ListHead::EMPTY);
        let mut cur = self.lists[0].head;
        while cur != NIL {
            let next = link_of(&mut self.links[cur as usize], 0).next;
            if is_sorted_subset(terms, &self.proxy(cur).pairs) {
                self.links[cur as usize].push(Link {
                    list,
                    prev: NIL,
                    next: NIL,
                });
                let pos = self.links[cur as usize].len() - 1;
                self.append(cur, pos);
            }
            cur = next;
        }
        // The others carry the link too, for when they become eligible.
        for slot in 0..self.slots.len() {
            if let Some(p) = &self.slots[slot].proxy
                && !p.linked
                && is_sorted_subset(terms, &p.pairs)
            {
                self.links[slot].push(Link {
                    list,
                    prev: NIL,
                    next: NIL,
                });
            }
        }
    }

    /// The soonest time a proxy matching `selector` (open, configured) could take a lease for
    /// `domain`: the latest of its cooldown's end, its earliest slot's freeing (with the rest
    /// an expiry brings) and the domain ban's end. `None` if no matching proxy is open.
    /// Walks the shard: only the refusal path calls it.
    pub(super) fn next_chance(
        &self,
        selector: &CompiledSelector,
        domain: Option<&str>,
        now: u64,
    ) -> Option<u64> {
        let mut soonest: Option<u64> = None;
        for slot in &self.slots {
            let Some(p) = slot.proxy.as_ref() else { continue };
            if p.info.is_none() || p.admission != AdmissionState::Open || !selector.matches(&p.pairs) {
                continue;
            }
            let mut at = p.cooling_until.max(now);
            if p.leases.len() as u32 >= p.max_concurrent {
                // The slot that frees first; an expiry then rests the proxy.
                let mut ends: Vec<u64> = p.leases.iter().map(|l| l.expires_at).collect();
                ends.sort_unstable();
                let excess = p.leases.len() - p.max_concurrent as usize;
                at = at.max(ends[excess] + p.cooldown_ms);
            }
            if let Some(d) = domain {
                for (b, until) in &p.bans {
                    if &**b == d {
                        at = at.max(*until);
                    }
                }
            }
            soonest = Some(soonest.map_or(at, |s| s.min(at)));
        }
        soonest
    }

    pub(super) fn pick(&self, selector: &CompiledSelector, domain: Option<&str>, now: u64) -> Option<u32> {
        // `exact`: everything on the list matches the selector, so only bans need a look.
        let (list, exact) = match selector {
            CompiledSelector::Unsatisfiable => return None,
            CompiledSelector::Pairs(terms) if terms.is_empty() => (0, true),
            CompiledSelector::Indexed { list, .. } => (*list, true),
            CompiledSelector::Pairs(terms) => {
                // Not indexed: walk the rarest term's list.
                let mut best = None;
                for t in terms {
                    let list = *t + 1;
                    let len = self.lists.get(list as usize).map_or(0, |l| l.len);
                    if len == 0 {
                        return None;
                    }
                    if best.is_none_or(|(_, l)| len < l) {
                        best = Some((list, len));
                    }
                }
                (best?.0, terms.len() == 1)
            }
        };
        let mut cur = self.head(list).head;
        if exact && domain.is_none() {
            return (cur != NIL).then_some(cur);
        }
        while cur != NIL {
            let p = self.proxy(cur);
            if (exact || selector.matches(&p.pairs)) && !p.banned_for(domain, now) {
                return Some(cur);
            }
            cur = self.links[cur as usize]
                .iter()
                .find(|l| l.list == list)
                .map_or(NIL, |l| l.next);
        }
        None
    }
}

/// Acquires that start in one shard before the calling thread's cursor moves to the next:
/// about half a millisecond of a busy thread's work, so that two busy threads settle in
/// different shards instead of trading each shard's cache lines every few microseconds (at 64,
/// 2 threads made 1.4x the pairs of 1 thread on 2 idle cores; at 4096, 1.75x). Fairness is
/// per shard in turn: every shard's LRU order is kept, and each is drawn from as often.
pub(crate) const BURST: u32 = 4096;
/// A shard another thread started acquires in this recently (ms) is left to that thread when
/// this one's cursor moves on.
pub(super) const OWNER_TTL_MS: u64 = 20;

/// Where the calling thread's acquires start: one shard for [`BURST`] acquires, then the next,
/// round robin, so every shard is drawn from evenly (its LRU head first). Concurrent threads
/// split the ring between them: a cursor moving on passes over shards another thread started
/// in within [`OWNER_TTL_MS`], and steps past a shard another thread holds at that instant. So
/// each shard's lock, lists and proxies stay in one core's cache instead of moving from core to
/// core on every acquire (which made a second thread slower than one); a thread that stops
/// leaves its shards to the others after [`OWNER_TTL_MS`].
#[derive(Clone, Copy)]
pub(super) struct Cursor {
    /// Position on the shard ring, in 1/2^32ths of it (so it means the same for any count).
    pub(super) position: u32,
    /// Acquires started in the current shard.
    pub(super) taken: u32,
    /// This thread's number (from 1), as shard owners record it.
    pub(super) thread: u16,
}

pub(super) static THREADS_SEEN: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static CURSOR: Cell<Cursor> = Cell::new({
        let k = THREADS_SEEN.fetch_add(1, Ordering::Relaxed);
        Cursor {
            // Bit-reversed thread numbers spread threads evenly: 0, 1/2, 1/4, 3/4, 1/8...
            position: k.reverse_bits(),
            taken: 0,
            thread: (k % u16::MAX as u32) as u16 + 1,
        }
    });
}

/// The shard `position` falls in.
pub(super) fn shard_at(position: u32, n: usize) -> usize {
    ((position as u64 * n as u64) >> 32) as usize
}

/// One ring step, rounded up so a step always reaches the next shard (n = 1: 0, one shard).
pub(super) fn ring_step(n: usize) -> u32 {
    (1u64 << 32).div_ceil(n as u64) as u32
}

/// A shard's last starting thread and when: thread number in the top 16 bits, ms below.
pub(super) fn owner_word(thread: u16, now: u64) -> u64 {
    (thread as u64) << 48 | (now & ((1 << 48) - 1))
}
impl LeaseStore {
    /// Resolves a selector to attribute-pair ids, once per request. A selector of two or more
    /// terms gets its combination indexed (an LRU list of its own in every shard) the first
    /// time it is seen, up to [`MAX_INDEXED_COMBINATIONS`].
    pub fn compile(&self, selector: &Selector) -> CompiledSelector {
        let compiled = read(&self.inner.interner).compile(selector);
        match compiled {
            CompiledSelector::Pairs(terms) if terms.len() >= 2 => match self.combination_list(&terms) {
                Some(list) => CompiledSelector::Indexed { terms, list },
                None => CompiledSelector::Pairs(terms),
            },
            other => other,
        }
    }

    /// The list id of the combination `terms`, indexing it if new and there is room.
    pub(super) fn combination_list(&self, terms: &[u32]) -> Option<u32> {
        let find = |c: &HashMap<Box<[u32]>, u32>| c.get(terms).copied();
        let combinations = &self.inner.combinations;
        if let Some(list) = find(&read(combinations)) {
            return Some(list);
        }
        // Lock order: combinations, then each shard (no shard holder takes `combinations`).
        let mut combinations = write(combinations);
        if let Some(list) = find(&combinations) {
            return Some(list);
        }
        if combinations.len() >= MAX_INDEXED_COMBINATIONS {
            return None;
        }
        let list = COMBINATION_BASE + combinations.len() as u32;
        for shard in &self.inner.shards {
            lock(&shard.0).add_combination(terms, list);
        }
        // Published only once every shard has the list.
        combinations.insert(terms.into(), list);
        Some(list)
    }

    /// Grants a lease on the least recently used eligible proxy (or the session's proxy).
    pub fn acquire(&self, req: &AcquireRequest<'_>) -> Result<Lease, LeaseError> {
        self.acquire_at(req, self.now())
    }

    /// [`LeaseStore::acquire`] at `now` ([`LeaseStore::now_ms`]).
    pub fn acquire_at(&self, req: &AcquireRequest<'_>, now: u64) -> Result<Lease, LeaseError> {
        self.acquire_granted_at(req, now).map(|granted| granted.lease)
    }

    /// [`LeaseStore::acquire_at`], saying whether a request ID got its earlier grant again.
    pub fn acquire_granted_at(&self, req: &AcquireRequest<'_>, now: u64) -> Result<Granted, LeaseError> {
        if req.ttl.is_zero() {
            return Err(LeaseError::Invalid("ttl must be positive".into()));
        }
        let ttl_ms = req.ttl.as_millis().min(u64::MAX as u128) as u64;
        let domain = req.target_domain.map(normalize_domain);
        let grant = || match req.session_key {
            Some(session) => self.acquire_sticky(req, session, domain.as_deref(), ttl_ms, now),
            None => self.acquire_any(req, domain.as_deref(), ttl_ms, now),
        };
        match req.request_id {
            Some(request_id) => self.acquire_once(req, request_id, now, grant),
            None => grant().map(|lease| Granted {
                lease,
                repeat_of: None,
            }),
        }
    }

    pub(super) fn acquire_any(
        &self,
        req: &AcquireRequest<'_>,
        domain: Option<&str>,
        ttl_ms: u64,
        now: u64,
    ) -> Result<Lease, LeaseError> {
        let n = self.inner.shards.len();
        let mut soonest: Option<u64> = None;
        if !matches!(req.selector, CompiledSelector::Unsatisfiable) {
            let start = self.start_shard(now);
            // Shards another thread holds right now are skipped at first (and this thread's
            // cursor moves past them), and visited last, waiting for their lock then.
            let mut busy: u64 = 0;
            let visit = |shard: &mut Shard, index: usize, soonest: &mut Option<u64>| {
                shard.settle(now);
                if let Some(slot) = shard.pick(req.selector, domain, now) {
                    let lease = shard.grant(slot, req, domain, ttl_ms, now);
                    // A shard with no other eligible proxy would hand out this one again: the
                    // next acquire starts after it, so a small pool (a proxy or two a shard)
                    // rotates through its proxies instead of reusing the first free one.
                    if shard.lists[0].len <= 1 {
                        Self::start_after(index, n);
                    }
                    return Some(lease);
                }
                if let Some(at) = shard.next_chance(req.selector, domain, now) {
                    *soonest = Some(soonest.map_or(at, |s| s.min(at)));
                }
                None
            };
            for i in 0..n {
                let index = (start + i) % n;
                // No proxy, nothing to grant or wait for ([`Shard::proxies`]). One being added
                // meanwhile is missed as it would be had this acquire come a moment earlier.
                if self.inner.shard_proxies[index].load(Ordering::Relaxed) == 0 {
                    continue;
                }
                let mut shard = match self.inner.shards[index].0.try_lock() {
                    Ok(shard) => shard,
                    Err(TryLockError::Poisoned(e)) => e.into_inner(),
                    Err(TryLockError::WouldBlock) => {
                        if i == 0 {
                            Self::step_past(n);
                        }
                        busy |= 1 << index;
                        continue;
                    }
                };
                if let Some(lease) = visit(&mut shard, index, &mut soonest) {
                    return Ok(lease);
                }
            }
            for index in (0..n).filter(|i| busy & (1 << i) != 0) {
                if let Some(lease) = visit(&mut lock(&self.inner.shards[index].0), index, &mut soonest) {
                    return Ok(lease);
                }
            }
        }
        let retry_after = soonest
            .map(|end| Duration::from_millis(end.saturating_sub(now)).max(Duration::from_secs(1)))
            .unwrap_or(DEFAULT_RETRY)
            .min(Duration::from_secs(60));
        Err(LeaseError::NoProxyAvailable { retry_after })
    }

    /// The shard the calling thread's next acquire starts in (see [`Cursor`]), counting it.
    pub(super) fn start_shard(&self, now: u64) -> usize {
        let n = self.inner.shards.len();
        if n == 1 {
            return 0;
        }
        CURSOR.with(|c| {
            let mut cursor = c.get();
            cursor.taken += 1;
            if cursor.taken > BURST {
                cursor.taken = 1;
                let step = ring_step(n);
                let mut position = cursor.position.wrapping_add(step);
                // The next shard no other thread started in lately (else simply the next).
                for k in 1..=n as u32 {
                    let candidate = cursor.position.wrapping_add(step.wrapping_mul(k));
                    let word = self.inner.owners[shard_at(candidate, n)]
                        .0
                        .load(Ordering::Relaxed);
                    let (owner, at) = ((word >> 48) as u16, word & ((1 << 48) - 1));
                    if owner == cursor.thread
                        || owner == 0
                        || (now & ((1 << 48) - 1)).saturating_sub(at) > OWNER_TTL_MS
                    {
                        position = candidate;
                        break;
                    }
                }
                cursor.position = position;
            }
            let shard = shard_at(cursor.position, n);
            if cursor.taken == 1 {
                self.inner.owners[shard]
                    .0
                    .store(owner_word(cursor.thread, now), Ordering::Relaxed);
            }
            c.set(cursor);
            shard
        })
    }

    /// Moves the calling thread's cursor to the next shard (another thread holds its current
    /// one); its next acquire claims it.
    pub(super) fn step_past(n: usize) {
        CURSOR.with(|c| {
            let cursor = c.get();
            c.set(Cursor {
                position: cursor.position.wrapping_add(ring_step(n)),
                taken: 0,
                ..cursor
            })
        });
    }

    /// Moves the calling thread's cursor to the shard after `index`; its next acquire claims it.
    pub(super) fn start_after(index: usize, n: usize) {
        CURSOR.with(|c| {
            let cursor = c.get();
            c.set(Cursor {
                position: ring_step(n).wrapping_mul(((index + 1) % n) as u32),
                taken: 0,
                ..cursor
            })
        });
    }

    pub(super) fn session_shard(&self, session: &str) -> usize {
        (self.inner.hasher.hash_one(session) % SESSION_SHARDS as u64) as usize
    }

    pub(super) fn acquire_sticky(
        &self,
        req: &AcquireRequest<'_>,
        session: &str,
        domain: Option<&str>,
        ttl_ms: u64,
        now: u64,
    ) -> Result<Lease, LeaseError> {
        let idle = self.inner.config.session_idle_ttl.as_millis() as u64;
        // Lock order: session shard, then proxy shard.
        let mut sessions = lock(&self.inner.sessions[self.session_shard(session)].0);
        if let Some(binding) = sessions.map.get_mut(session)
            && binding.expires_at > now
        {
            let mut shard = self.shard_for(&binding.key);
            if let Some(slot) = shard.by_key.get(&binding.key).copied() {
                shard.settle(now);
                let p = shard.proxy(slot);
                // Sticky reuse skips the post-release cooldown, nothing else.
                let eligible = p.info.is_some()
                    && p.admission == AdmissionState::Open
                    && (p.leases.len() as u32) < p.max_concurrent
                    && req.selector.matches(&p.pairs)
                    && !p.banned_for(domain, now);
                if eligible {
                    let lease = shard.grant(slot, req, domain, ttl_ms, now);
                    binding.expires_at = lease.expires_at_ms + idle;
                    sessions.mark(session);
                    return Ok(lease);
                }
            }
        }
        let lease = self.acquire_any(req, domain, ttl_ms, now)?;
        sessions.map.insert(
            session.into(),
            Binding {
                key: lease.id.key.clone(),
                expires_at: lease.expires_at_ms + idle,
                changed: false,
            },
        );
        sessions.mark(session);
        Ok(lease)
    }

    /// Proxies matching `selector`, sorted by key, as listings show them.
    pub fn list(&self, selector: &CompiledSelector) -> Vec<ProxyView> {
        self.list_at(selector, self.now())
    }

    /// [`LeaseStore::list`] at `now` ([`LeaseStore::now_ms`]).
    pub fn list_at(&self, selector: &CompiledSelector, now: u64) -> Vec<ProxyView> {
        self.list_for(selector, None, now)
    }

    /// Active leases at `now`, on the one proxy `key` if given, held by `holder` if given, by
    /// proxy key then first token. O(leases): a listing for
    /// people and tools, not a hot path.
    pub fn leases_at(&self, key: Option<&ProxyKey>, holder: Option<&str>, now: u64) -> Vec<LeaseView> {
        let mut out = Vec::new();
        let indices: Vec<usize> = match key {
            Some(key) => vec![self.shard_index(key)],
            None => (0..self.inner.shards.len()).collect(),
        };
        // One shard locked at a time, as every other operation does.
        for index in indices {
            let mut shard = lock(&self.inner.shards[index].0);
            shard.settle(now);
            for (slot_index, slot) in (0u32..).zip(shard.slots.iter()) {
                let Some(p) = slot.proxy.as_ref() else { continue };
                if key.is_some_and(|k| *k != p.key) {
                    continue;
                }
                for l in p.leases.iter().filter(|l| l.expires_at > now) {
                    if holder.is_some_and(|h| h != l.holder.as_str()) {
                        continue;
                    }
                    out.push(LeaseView {
                        claim: l.claim(&p.key, shard.hint(slot_index)),
                        expires_at_ms: l.expires_at,
                        id_tail: l.issued_id.as_ref().map(|id| id.tail(LeaseView::ID_TAIL)),
                    });
                }
            }
        }
        out.sort_by(|a, b| {
            (&a.claim.id.key, a.claim.id.first_token).cmp(&(&b.claim.id.key, b.claim.id.first_token))
        });
        out
    }

    /// [`LeaseStore::list_at`] as a crawler of `target_domain` sees it: a proxy banned for that
    /// domain (and otherwise free) is [`Availability::Banned`].
    pub fn list_for(
        &self,
        selector: &CompiledSelector,
        target_domain: Option<&str>,
        now: u64,
    ) -> Vec<ProxyView> {
        let domain = target_domain.map(normalize_domain);
        let mut out = Vec::new();
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            shard.settle(now);
            for slot in shard.slots.iter() {
                let Some(p) = slot.proxy.as_ref() else { continue };
                if !selector.matches(&p.pairs) {
                    continue;
                }
                out.extend(view_of(p, domain.as_deref(), now));
            }
        }
        out.sort_by(|a, b| a.info.key.cmp(&b.info.key));
        out
    }

    /// The one proxy `key` as [`LeaseStore::list_at`] shows it (`None`: not in the store):
    /// one shard locked, for pages that show a few proxies of many.
    pub fn view_at(&self, key: &ProxyKey, now: u64) -> Option<ProxyView> {
        let mut shard = self.shard_for(key);
        shard.settle(now);
        let slot = *shard.by_key.get(key)?;
        view_of(shard.proxy(slot), None, now)
    }
}

/// A proxy as listings show it, for a crawler of `domain` (normalized) if given; `None` for a
/// slot without its info yet.
fn view_of(p: &ProxyState, domain: Option<&str>, now: u64) -> Option<ProxyView> {
    let info = p.info.as_ref()?;
    let active = p.leases.iter().filter(|l| l.expires_at > now).count();
    let mut bans: Vec<(String, u64)> = (p.bans.iter())
        .filter(|(_, until)| *until > now)
        .map(|(d, until)| (d.to_string(), *until))
        .collect();
    bans.sort();
    let banned = domain.is_some_and(|domain| bans.iter().any(|(d, _)| d == domain));
    let availability = match p.admission {
        AdmissionState::Closed => Availability::Closed,
        AdmissionState::Draining => Availability::Draining,
        AdmissionState::Open if active as u32 >= p.max_concurrent => Availability::Busy,
        AdmissionState::Open if banned => Availability::Banned,
        AdmissionState::Open if p.cooling_until > now => Availability::CoolingDown,
        AdmissionState::Open => Availability::Available,
    };
    Some(ProxyView {
        info: info.clone(),
        availability,
        active_leases: active,
        max_concurrent: p.max_concurrent,
        cooldown_until_ms: (p.cooling_until > now).then_some(p.cooling_until),
        bans,
    })
}
