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

use std::{
    cell::Cell,
    cmp::Reverse,
    collections::{BTreeMap, BinaryHeap, HashMap},
    hash::BuildHasher,
    sync::{
        Arc, Mutex, MutexGuard, RwLock, TryLockError,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use super::{
    AcquireRequest, Admission, Availability, CompiledSelector, DrainStatus, Lease, LeaseClaim, LeaseError,
    LeaseHint, LeaseId, LeaseStoreConfig, LeaseTarget, Outcome, ProxyInfo, ProxyKey, ProxyView, Renewed,
    Selector,
    checkpoint::{
        BanCheckpoint, Checkpoint, CheckpointAdmission, LeaseCheckpoint, ProxyCheckpoint, SessionCheckpoint,
    },
    selector::{Interner, is_sorted_subset},
};

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a critical section leaves state that is still structurally valid
    // (every mutation keeps the lists consistent before it can panic), so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Keeps two shards' locks off one cache line.
#[repr(align(128))]
struct Padded<T>(T);

/// A proxy's membership in one LRU list.
#[derive(Clone, Copy, Debug)]
struct Link {
    list: u32,
    prev: u32,
    next: u32,
}

#[derive(Clone, Copy, Debug)]
struct ListHead {
    head: u32,
    tail: u32,
    len: u32,
}

impl ListHead {
    const EMPTY: ListHead = ListHead {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AdmissionState {
    Open,
    Closed,
    Draining,
}

/// A short string kept inline: holder names are short, and this spares an allocation (and a
/// free) per lease on the hot path.
#[derive(Clone, Debug)]
enum SmallStr {
    Inline { len: u8, bytes: [u8; 30] },
    Heap(Box<str>),
}

impl SmallStr {
    fn new(s: &str) -> Self {
        if s.len() <= 30 {
            let mut bytes = [0u8; 30];
            bytes[..s.len()].copy_from_slice(s.as_bytes());
            SmallStr::Inline {
                len: s.len() as u8,
                bytes,
            }
        } else {
            SmallStr::Heap(s.into())
        }
    }

    fn as_str(&self) -> &str {
        match self {
            SmallStr::Inline { len, bytes } => std::str::from_utf8(&bytes[..*len as usize])
                .expect("inline bytes are copied whole from a str"),
            SmallStr::Heap(s) => s,
        }
    }
}

#[derive(Debug)]
struct LeaseRecord {
    first_token: u64,
    token: u64,
    acquired_at: u64,
    expires_at: u64,
    /// What the holder asked for (capped), the default length of a renewal.
    ttl_ms: u64,
    holder: SmallStr,
    target_domain: Option<Box<str>>,
    session_key: Option<Box<str>>,
    /// Loaded from a checkpoint and not touched since: the holder may hold a newer token
    /// (a renewal the checkpoint missed), so a higher presented token is taken as current.
    restored: bool,
}

#[derive(Debug)]
struct ProxyState {
    key: ProxyKey,
    /// `None` while only restored from a checkpoint and not configured again yet.
    info: Option<Arc<ProxyInfo>>,
    pairs: Vec<u32>,
    max_concurrent: u32,
    cooldown_ms: u64,
    max_ttl_ms: u64,
    admission: AdmissionState,
    cooling_until: u64,
    bans: Vec<(Box<str>, u64)>,
    leases: Vec<LeaseRecord>,
    linked: bool,
    /// Leases whose first token is below this were revoked: never reinstated.
    revoked_below: u64,
    /// For restored, unconfigured entries: dropped by the reaper after this time.
    parked_until: u64,
    /// When its entry in the shard's expiry heap is due (0: none); never after its earliest
    /// lease expiry, so [`Shard::settle`] sees every expiry on time.
    check_at: u64,
}

impl ProxyState {
    fn new(key: ProxyKey) -> Self {
        Self {
            key,
            info: None,
            pairs: Vec::new(),
            max_concurrent: 1,
            cooldown_ms: 0,
            max_ttl_ms: 3_600_000,
            admission: AdmissionState::Closed,
            cooling_until: 0,
            bans: Vec::new(),
            leases: Vec::new(),
            linked: false,
            revoked_below: 0,
            parked_until: 0,
            check_at: 0,
        }
    }

    fn banned_for(&self, domain: Option<&str>, now: u64) -> bool {
        match domain {
            None => false,
            Some(d) => self.bans.iter().any(|(b, until)| *until > now && &**b == d),
        }
    }

    fn eligible(&self, now: u64) -> bool {
        self.info.is_some()
            && self.admission == AdmissionState::Open
            && self.cooling_until <= now
            && (self.leases.len() as u32) < self.max_concurrent
    }

    fn apply_policy(&mut self, target: &LeaseTarget) {
        self.max_concurrent = target.policy.max_concurrent.max(1) as u32;
        self.cooldown_ms = target.policy.cooldown_seconds.max(0) as u64 * 1000;
        self.max_ttl_ms = target.policy.max_ttl_seconds.max(1) as u64 * 1000;
    }
}

struct Slot {
    generation: u32,
    proxy: Option<ProxyState>,
}

struct Shard {
    id: u16,
    slots: Vec<Slot>,
    /// LRU links per slot, parallel to `slots`; list 0 holds every eligible proxy, list `p + 1`
    /// those with attribute pair `p`.
    links: Vec<Vec<Link>>,
    free: Vec<u32>,
    by_key: HashMap<ProxyKey, u32>,
    lists: Vec<ListHead>,
    /// Lists of the indexed combinations, list id `COMBINATION_BASE + i` at index `i`.
    combination_lists: Vec<ListHead>,
    /// The indexed combinations' sorted pair ids, in list-id order.
    combinations: Vec<Box<[u32]>>,
    cooling: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// When proxies' earliest leases expire: (time, slot, generation), one live entry per
    /// proxy with leases (its `check_at`); stale ones are skipped when popped.
    expiring: BinaryHeap<Reverse<(u64, u32, u32)>>,
    seq: u64,
    active: usize,
    dirty: bool,
    /// First tokens of leases taken back from claims, until their claimed expiry: a claim is
    /// honoured once.
    reinstated: HashMap<u64, u64>,
}

fn link_of(links: &mut [Link], list: u32) -> &mut Link {
    links
        .iter_mut()
        .find(|l| l.list == list)
        .expect("a proxy in a list has a link for that list")
}

impl Shard {
    fn new(id: u16) -> Self {
        Self {
            id,
            slots: Vec::new(),
            links: Vec::new(),
            free: Vec::new(),
            by_key: HashMap::new(),
            lists: vec![ListHead::EMPTY],
            combination_lists: Vec::new(),
            combinations: Vec::new(),
            cooling: BinaryHeap::new(),
            expiring: BinaryHeap::new(),
            seq: 0,
            active: 0,
            dirty: false,
            reinstated: HashMap::new(),
        }
    }

    fn proxy(&self, slot: u32) -> &ProxyState {
        self.slots[slot as usize]
            .proxy
            .as_ref()
            .expect("slots reached through lists or the key map are occupied")
    }

    fn proxy_mut(&mut self, slot: u32) -> &mut ProxyState {
        self.slots[slot as usize]
            .proxy
            .as_mut()
            .expect("slots reached through lists or the key map are occupied")
    }

    fn next_token(&mut self, now: u64) -> u64 {
        self.seq = (self.seq + 1).max(now * SEQ_PER_MS);
        (self.seq << SHARD_BITS) | self.id as u64
    }

    fn observe_token(&mut self, token: u64) {
        self.seq = self.seq.max(token >> SHARD_BITS);
    }

    fn allocate(&mut self, key: ProxyKey) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    proxy: None,
                });
                self.links.push(Vec::new());
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[slot as usize].proxy = Some(ProxyState::new(key.clone()));
        self.by_key.insert(key, slot);
        self.set_pairs(slot, Vec::new());
        slot
    }

    fn head(&self, list: u32) -> &ListHead {
        match list.checked_sub(COMBINATION_BASE) {
            Some(i) => &self.combination_lists[i as usize],
            None => &self.lists[list as usize],
        }
    }

    fn head_mut(&mut self, list: u32) -> &mut ListHead {
        match list.checked_sub(COMBINATION_BASE) {
            Some(i) => &mut self.combination_lists[i as usize],
            None => &mut self.lists[list as usize],
        }
    }

    fn set_pairs(&mut self, slot: u32, pairs: Vec<u32>) {
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
    fn add_combination(&mut self, terms: &[u32], list: u32) {
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

    /// Appends `slot` to the tail of the list its link at `pos` names.
    fn append(&mut self, slot: u32, pos: usize) {
        let list = self.links[slot as usize][pos].list;
        let tail = self.head(list).tail;
        let link = &mut self.links[slot as usize][pos];
        link.prev = tail;
        link.next = NIL;
        if tail == NIL {
            self.head_mut(list).head = slot;
        } else {
            link_of(&mut self.links[tail as usize], list).next = slot;
        }
        let head = self.head_mut(list);
        head.tail = slot;
        head.len += 1;
    }

    fn link_tail(&mut self, slot: u32) {
        for pos in 0..self.links[slot as usize].len() {
            self.append(slot, pos);
        }
        self.proxy_mut(slot).linked = true;
    }

    fn unlink(&mut self, slot: u32) {
        for pos in 0..self.links[slot as usize].len() {
            let Link { list, prev, next } = self.links[slot as usize][pos];
            if prev == NIL {
                self.head_mut(list).head = next;
            } else {
                link_of(&mut self.links[prev as usize], list).next = next;
            }
            if next == NIL {
                self.head_mut(list).tail = prev;
            } else {
                link_of(&mut self.links[next as usize], list).prev = prev;
            }
            self.head_mut(list).len -= 1;
        }
        self.proxy_mut(slot).linked = false;
    }

    /// Puts the proxy in or out of the LRU lists as its state says; `used` moves it to the
    /// most-recently-used end.
    fn relink(&mut self, slot: u32, now: u64, used: bool) {
        let p = self.proxy(slot);
        match (p.eligible(now), p.linked) {
            (true, true) if used => {
                self.unlink(slot);
                self.link_tail(slot);
            }
            (true, false) => self.link_tail(slot),
            (false, true) => self.unlink(slot),
            _ => {}
        }
    }

    /// Rests the proxy for its cooldown counted from `from` (a release's or an expiry's time);
    /// a rest that already ended by `now`, or ends before the current one, changes nothing.
    fn start_cooldown(&mut self, slot: u32, from: u64, now: u64) {
        let generation = self.slots[slot as usize].generation;
        let p = self.proxy_mut(slot);
        if p.cooldown_ms > 0 {
            let until = from + p.cooldown_ms;
            if until > now && until > p.cooling_until {
                p.cooling_until = until;
                self.cooling.push(Reverse((until, slot, generation)));
            }
        }
    }

    /// Makes sure the expiry heap has an entry due no later than `expires_at` for this proxy.
    fn schedule_expiry(&mut self, slot: u32, expires_at: u64) {
        let generation = self.slots[slot as usize].generation;
        let p = self.proxy_mut(slot);
        if p.check_at == 0 || expires_at < p.check_at {
            p.check_at = expires_at;
            self.expiring.push(Reverse((expires_at, slot, generation)));
        }
    }

    /// Brings the shard to `now` under the one expiry rule: a lease exists while
    /// `now < expires_at`; at `expires_at` its slot is free and the proxy rests for its cooldown
    /// counted from `expires_at`, exactly as if it had been released then. Every operation that
    /// reads or changes a shard settles it first, so listing, acquire, renew and release agree
    /// at every instant whatever the reaper has done. Returns how many leases expired.
    fn settle(&mut self, now: u64) -> usize {
        let mut expired = 0;
        while let Some(&Reverse((at, slot, generation))) = self.expiring.peek() {
            if at > now {
                break;
            }
            self.expiring.pop();
            let s = &mut self.slots[slot as usize];
            if s.generation != generation {
                continue;
            }
            match s.proxy.as_mut() {
                Some(p) if p.check_at == at => p.check_at = 0,
                _ => continue,
            }
            expired += self.expire_leases(slot, now);
        }
        self.promote_cooled(now);
        expired
    }

    /// Puts proxies whose cooldown ended back into the lists.
    fn promote_cooled(&mut self, now: u64) {
        while let Some(&Reverse((until, slot, generation))) = self.cooling.peek() {
            if until > now {
                break;
            }
            self.cooling.pop();
            let s = &mut self.slots[slot as usize];
            if s.generation != generation {
                continue;
            }
            if let Some(p) = s.proxy.as_mut()
                && p.cooling_until == until
            {
                p.cooling_until = 0;
                self.relink(slot, now, false);
            }
        }
    }

    /// The soonest time a proxy matching `selector` (open, configured) could take a lease for
    /// `domain`: the latest of its cooldown's end, its earliest slot's freeing (with the rest
    /// an expiry brings) and the domain ban's end. `None` if no matching proxy is open.
    /// Walks the shard: only the refusal path calls it.
    fn next_chance(&self, selector: &CompiledSelector, domain: Option<&str>, now: u64) -> Option<u64> {
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

    fn pick(&self, selector: &CompiledSelector, domain: Option<&str>, now: u64) -> Option<u32> {
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

    fn grant(
        &mut self,
        slot: u32,
        req: &AcquireRequest<'_>,
        domain: Option<&str>,
        ttl_ms: u64,
        now: u64,
    ) -> Lease {
        let token = self.next_token(now);
        let hint = LeaseHint {
            shard: self.id,
            slot,
            generation: self.slots[slot as usize].generation,
        };
        let p = self.proxy_mut(slot);
        let ttl_ms = ttl_ms.min(p.max_ttl_ms);
        let expires_at = now + ttl_ms;
        p.leases.push(LeaseRecord {
            first_token: token,
            token,
            acquired_at: now,
            expires_at,
            ttl_ms,
            holder: SmallStr::new(req.holder),
            target_domain: domain.map(Into::into),
            session_key: req.session_key.map(Into::into),
            restored: false,
        });
        let proxy = p
            .info
            .clone()
            .expect("only configured proxies are eligible for a grant");
        let key = p.key.clone();
        self.active += 1;
        self.dirty = true;
        self.schedule_expiry(slot, expires_at);
        self.relink(slot, now, true);
        Lease {
            id: LeaseId {
                key,
                first_token: token,
                hint,
            },
            fencing_token: token,
            acquired_at_ms: now,
            expires_at_ms: expires_at,
            proxy,
        }
    }

    fn slot_by_hint(&self, id: &LeaseId) -> Option<u32> {
        let s = self.slots.get(id.hint.slot as usize)?;
        let p = s.proxy.as_ref()?;
        (s.generation == id.hint.generation && p.key == id.key).then_some(id.hint.slot)
    }

    /// Removes expired leases of one proxy; each rests the proxy from its `expires_at`, like a
    /// release at that instant. Schedules the next expiry of those left.
    fn expire_leases(&mut self, slot: u32, now: u64) -> usize {
        let p = self.proxy_mut(slot);
        let before = p.leases.len();
        let mut last_end = 0;
        p.leases.retain(|l| {
            let live = l.expires_at > now;
            if !live {
                last_end = last_end.max(l.expires_at);
            }
            live
        });
        let expired = before - p.leases.len();
        let next = p.leases.iter().map(|l| l.expires_at).min();
        if expired > 0 {
            self.active -= expired;
            self.dirty = true;
            self.start_cooldown(slot, last_end, now);
            self.relink(slot, now, false);
        }
        if let Some(next) = next {
            self.schedule_expiry(slot, next);
        }
        expired
    }

    fn remove_slot(&mut self, slot: u32) {
        if self.proxy(slot).linked {
            self.unlink(slot);
        }
        let s = &mut self.slots[slot as usize];
        if let Some(p) = s.proxy.take() {
            self.active -= p.leases.len();
            self.by_key.remove(&p.key);
        }
        s.generation = s.generation.wrapping_add(1);
        self.free.push(slot);
        self.dirty = true;
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
const OWNER_TTL_MS: u64 = 20;

/// Where the calling thread's acquires start: one shard for [`BURST`] acquires, then the next,
/// round robin, so every shard is drawn from evenly (its LRU head first). Concurrent threads
/// split the ring between them: a cursor moving on passes over shards another thread started
/// in within [`OWNER_TTL_MS`], and steps past a shard another thread holds at that instant. So
/// each shard's lock, lists and proxies stay in one core's cache instead of moving from core to
/// core on every acquire (which made a second thread slower than one); a thread that stops
/// leaves its shards to the others after [`OWNER_TTL_MS`].
#[derive(Clone, Copy)]
struct Cursor {
    /// Position on the shard ring, in 1/2^32ths of it (so it means the same for any count).
    position: u32,
    /// Acquires started in the current shard.
    taken: u32,
    /// This thread's number (from 1), as shard owners record it.
    thread: u16,
}

static THREADS_SEEN: AtomicU32 = AtomicU32::new(0);

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
fn shard_at(position: u32, n: usize) -> usize {
    ((position as u64 * n as u64) >> 32) as usize
}

/// One ring step, rounded up so a step always reaches the next shard (n = 1: 0, one shard).
fn ring_step(n: usize) -> u32 {
    (1u64 << 32).div_ceil(n as u64) as u32
}

/// A shard's last starting thread and when: thread number in the top 16 bits, ms below.
fn owner_word(thread: u16, now: u64) -> u64 {
    (thread as u64) << 48 | (now & ((1 << 48) - 1))
}

/// A sticky-session binding.
#[derive(Clone, Debug)]
struct Binding {
    key: ProxyKey,
    expires_at: u64,
}

/// Sticky-session bindings of one session shard.
type SessionMap = HashMap<Box<str>, Binding>;

/// What the last restore said about tokens issued before this process.
#[derive(Debug, Default)]
struct RestoreInfo {
    /// Highest token per shard number that the checkpoint knew of.
    hwm: HashMap<u16, u64>,
    /// Sequence numbers at or below this were issued before this process started.
    seq_floor: u64,
    /// Restored leases nobody confirmed stop holding up drains at this time (ms).
    unconfirmed_until: u64,
}

struct Inner {
    shards: Box<[Padded<Mutex<Shard>>]>,
    /// Per shard, the thread that last started acquires in it ([`owner_word`]): read and
    /// written once per [`BURST`], kept off the locks' lines.
    owners: Box<[Padded<AtomicU64>]>,
    sessions: Box<[Padded<Mutex<SessionMap>>]>,
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
            .map(|_| Padded(Mutex::new(HashMap::new())))
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards: shard_vec.into_boxed_slice(),
                owners: (0..shards).map(|_| Padded(AtomicU64::new(0))).collect(),
                sessions: sessions.into_boxed_slice(),
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

    fn now(&self) -> u64 {
        self.inner.config.clock.now_ms()
    }

    /// The store clock's time (ms since the epoch): read it once per request and pass it to
    /// the `*_at` operations, so every answer to that request is about the same instant.
    pub fn now_ms(&self) -> u64 {
        self.now()
    }

    fn shard_index(&self, key: &ProxyKey) -> usize {
        (fnv1a(key.as_str().as_bytes()) % self.inner.shards.len() as u64) as usize
    }

    fn shard_for(&self, key: &ProxyKey) -> MutexGuard<'_, Shard> {
        lock(&self.inner.shards[self.shard_index(key)].0)
    }

    /// Resolves a selector to attribute-pair ids, once per request. A selector of two or more
    /// terms gets its combination indexed (an LRU list of its own in every shard) the first
    /// time it is seen, up to [`MAX_INDEXED_COMBINATIONS`].
    pub fn compile(&self, selector: &Selector) -> CompiledSelector {
        let compiled = self
            .inner
            .interner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .compile(selector);
        match compiled {
            CompiledSelector::Pairs(terms) if terms.len() >= 2 => match self.combination_list(&terms) {
                Some(list) => CompiledSelector::Indexed { terms, list },
                None => CompiledSelector::Pairs(terms),
            },
            other => other,
        }
    }

    /// The list id of the combination `terms`, indexing it if new and there is room.
    fn combination_list(&self, terms: &[u32]) -> Option<u32> {
        let read = |c: &HashMap<Box<[u32]>, u32>| c.get(terms).copied();
        let combinations = &self.inner.combinations;
        if let Some(list) = read(&combinations.read().unwrap_or_else(|e| e.into_inner())) {
            return Some(list);
        }
        // Lock order: combinations, then each shard (no shard holder takes `combinations`).
        let mut combinations = combinations.write().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = read(&combinations) {
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

    /// Adds a proxy, or updates its endpoint, credentials, attributes and limits in place.
    /// Never drops leases; a lower `maxConcurrent` only stops new leases until enough end.
    /// A new proxy starts `Closed`.
    pub fn upsert_proxy(&self, target: LeaseTarget) {
        let pairs = self
            .inner
            .interner
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .intern_all(&target.attributes);
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
        shard.dirty = true;
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
        shard.proxy_mut(slot).admission = match admission {
            Admission::Open => AdmissionState::Open,
            Admission::Closed => AdmissionState::Closed,
        };
        shard.dirty = true;
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
            shard.dirty = true;
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
        shard.dirty = true;
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
        let unconfirmed_until = self
            .inner
            .restore
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .unconfirmed_until;
        let now = self.now();
        self.count_leases(key, now, |l| !l.restored || now < unconfirmed_until)
    }

    /// Counts every restored lease as confirmed (drains and deletions wait for it): the
    /// restored state is exact, not possibly stale (standalone mode with the lease journal).
    pub fn trust_restored(&self) {
        self.inner
            .restore
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .unconfirmed_until = u64::MAX;
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

    /// Grants a lease on the least recently used eligible proxy (or the session's proxy).
    pub fn acquire(&self, req: &AcquireRequest<'_>) -> Result<Lease, LeaseError> {
        self.acquire_at(req, self.now())
    }

    /// [`LeaseStore::acquire`] at `now` ([`LeaseStore::now_ms`]).
    pub fn acquire_at(&self, req: &AcquireRequest<'_>, now: u64) -> Result<Lease, LeaseError> {
        if req.ttl.is_zero() {
            return Err(LeaseError::Invalid("ttl must be positive".into()));
        }
        let ttl_ms = req.ttl.as_millis().min(u64::MAX as u128) as u64;
        let domain = req.target_domain.map(normalize_domain);
        match req.session_key {
            Some(session) => self.acquire_sticky(req, session, domain.as_deref(), ttl_ms, now),
            None => self.acquire_any(req, domain.as_deref(), ttl_ms, now),
        }
    }

    fn acquire_any(
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
            let visit = |shard: &mut Shard, soonest: &mut Option<u64>| {
                shard.settle(now);
                if let Some(slot) = shard.pick(req.selector, domain, now) {
                    return Some(shard.grant(slot, req, domain, ttl_ms, now));
                }
                if let Some(at) = shard.next_chance(req.selector, domain, now) {
                    *soonest = Some(soonest.map_or(at, |s| s.min(at)));
                }
                None
            };
            for i in 0..n {
                let index = (start + i) % n;
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
                if let Some(lease) = visit(&mut shard, &mut soonest) {
                    return Ok(lease);
                }
            }
            for index in (0..n).filter(|i| busy & (1 << i) != 0) {
                if let Some(lease) = visit(&mut lock(&self.inner.shards[index].0), &mut soonest) {
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
    fn start_shard(&self, now: u64) -> usize {
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
    fn step_past(n: usize) {
        CURSOR.with(|c| {
            let cursor = c.get();
            c.set(Cursor {
                position: cursor.position.wrapping_add(ring_step(n)),
                taken: 0,
                ..cursor
            })
        });
    }

    fn session_shard(&self, session: &str) -> usize {
        (self.inner.hasher.hash_one(session) % SESSION_SHARDS as u64) as usize
    }

    fn acquire_sticky(
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
        if let Some(binding) = sessions.get_mut(session)
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
                    return Ok(lease);
                }
            }
        }
        let lease = self.acquire_any(req, domain, ttl_ms, now)?;
        sessions.insert(
            session.into(),
            Binding {
                key: lease.id.key.clone(),
                expires_at: lease.expires_at_ms + idle,
            },
        );
        Ok(lease)
    }

    /// Runs `f` on the lease's record in its settled shard: an expired lease is not found.
    fn with_lease<R>(
        &self,
        id: &LeaseId,
        now: u64,
        f: impl FnOnce(&mut Shard, u32, usize) -> Result<R, LeaseError>,
    ) -> Result<R, LeaseError> {
        let find = |shard: &Shard, slot: u32| {
            shard
                .proxy(slot)
                .leases
                .iter()
                .position(|l| l.first_token == id.first_token)
        };
        let hinted = id.hint.shard as usize;
        if hinted < self.inner.shards.len() {
            let mut shard = lock(&self.inner.shards[hinted].0);
            shard.settle(now);
            if let Some(slot) = shard.slot_by_hint(id) {
                let idx = find(&shard, slot).ok_or(LeaseError::NotFound)?;
                return f(&mut shard, slot, idx);
            }
        }
        let mut shard = self.shard_for(&id.key);
        shard.settle(now);
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
            Self::check_token(shard, slot, idx, token)?;
            if shard.proxy(slot).admission == AdmissionState::Draining {
                return Err(LeaseError::Draining);
            }
            let new_token = shard.next_token(now);
            let p = shard.proxy_mut(slot);
            let max_ttl = p.max_ttl_ms;
            let rec = &mut p.leases[idx];
            let ttl_ms = ttl.map_or(rec.ttl_ms, |t| t.as_millis() as u64);
            rec.token = new_token;
            rec.restored = false;
            rec.expires_at = now + ttl_ms.min(max_ttl);
            let expires_at_ms = rec.expires_at;
            shard.dirty = true;
            shard.schedule_expiry(slot, expires_at_ms);
            Ok(Renewed {
                fencing_token: new_token,
                expires_at_ms,
            })
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
    ) -> Result<(), LeaseError> {
        self.release_at(id, token, outcome, target_domain, self.now())
    }

    /// [`LeaseStore::release`] at `now` ([`LeaseStore::now_ms`]).
    pub fn release_at(
        &self,
        id: &LeaseId,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
        now: u64,
    ) -> Result<(), LeaseError> {
        let ban_ms = self.inner.config.ban_cooldown.as_millis() as u64;
        self.with_lease(id, now, |shard, slot, idx| {
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
            p.leases.swap_remove(idx);
            if let Some(domain) = ban {
                p.bans.retain(|(d, until)| *until > now && **d != *domain);
                p.bans.push((domain.into(), now + ban_ms));
            }
            shard.active -= 1;
            shard.dirty = true;
            shard.start_cooldown(slot, now, now);
            shard.relink(slot, now, true);
            Ok(())
        })
    }

    /// Takes back a lease this store does not know from its signed claim, if the claim was
    /// issued after the last checkpoint this store restored and before this store started
    /// issuing (the only leases a restart or leader change can have lost). Its slot counts
    /// against `maxConcurrent` again from now on, even beyond the limit. `token` is the
    /// holder's latest fencing token.
    pub fn reinstate(&self, claim: &LeaseClaim, token: u64) -> Result<(), LeaseError> {
        self.reinstate_at(claim, token, self.now())
    }

    /// [`LeaseStore::reinstate`] at `now` ([`LeaseStore::now_ms`]).
    pub fn reinstate_at(&self, claim: &LeaseClaim, token: u64, now: u64) -> Result<(), LeaseError> {
        let first = claim.id.first_token;
        if claim.expires_at_ms <= now {
            return Err(LeaseError::NotFound);
        }
        if token < first {
            return Err(LeaseError::StaleToken {
                presented: token,
                current: first,
            });
        }
        let unknown_to_checkpoint = {
            let restore = self.inner.restore.read().unwrap_or_else(|e| e.into_inner());
            let hwm = restore
                .hwm
                .get(&((first & (MAX_SHARDS as u64 - 1)) as u16))
                .copied()
                .unwrap_or(0);
            first > hwm && (first >> SHARD_BITS) <= restore.seq_floor
        };
        if !unknown_to_checkpoint {
            return Err(LeaseError::NotFound);
        }
        let mut shard = self.shard_for(&claim.id.key);
        shard.settle(now);
        let slot = shard
            .by_key
            .get(&claim.id.key)
            .copied()
            .ok_or(LeaseError::NotFound)?;
        let p = shard.proxy(slot);
        if p.leases.iter().any(|l| l.first_token == first) {
            return Ok(());
        }
        if first < p.revoked_below || shard.reinstated.contains_key(&first) {
            return Err(LeaseError::NotFound);
        }
        let p = shard.proxy_mut(slot);
        p.leases.push(LeaseRecord {
            first_token: first,
            token,
            acquired_at: claim.acquired_at_ms,
            expires_at: claim.expires_at_ms,
            ttl_ms: claim.expires_at_ms.saturating_sub(claim.acquired_at_ms).max(1),
            holder: SmallStr::new(&claim.holder),
            target_domain: claim.target_domain.as_deref().map(Into::into),
            session_key: claim.session_key.as_deref().map(Into::into),
            restored: false,
        });
        shard.reinstated.insert(first, claim.expires_at_ms);
        shard.observe_token(token);
        shard.active += 1;
        shard.dirty = true;
        shard.schedule_expiry(slot, claim.expires_at_ms);
        shard.relink(slot, now, false);
        Ok(())
    }

    /// Proxies matching `selector`, sorted by key, as listings show them.
    pub fn list(&self, selector: &CompiledSelector) -> Vec<ProxyView> {
        self.list_at(selector, self.now())
    }

    /// [`LeaseStore::list`] at `now` ([`LeaseStore::now_ms`]).
    pub fn list_at(&self, selector: &CompiledSelector, now: u64) -> Vec<ProxyView> {
        let mut out = Vec::new();
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            shard.settle(now);
            for slot in shard.slots.iter() {
                let Some(p) = slot.proxy.as_ref() else { continue };
                let Some(info) = p.info.as_ref() else { continue };
                if !selector.matches(&p.pairs) {
                    continue;
                }
                let active = p.leases.iter().filter(|l| l.expires_at > now).count();
                let availability = match p.admission {
                    AdmissionState::Closed => Availability::Closed,
                    AdmissionState::Draining => Availability::Draining,
                    AdmissionState::Open if active as u32 >= p.max_concurrent => Availability::Busy,
                    AdmissionState::Open if p.cooling_until > now => Availability::CoolingDown,
                    AdmissionState::Open => Availability::Available,
                };
                out.push(ProxyView {
                    info: info.clone(),
                    availability,
                    active_leases: active,
                    max_concurrent: p.max_concurrent,
                    cooldown_until_ms: (p.cooling_until > now).then_some(p.cooling_until),
                });
            }
        }
        out.sort_by(|a, b| a.info.key.cmp(&b.info.key));
        out
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
            lock(&sessions.0).retain(|_, b| b.expires_at > now);
        }
        expired
    }

    /// Whether anything changed since the last call (and clears the marks).
    pub fn take_dirty(&self) -> bool {
        let mut dirty = false;
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            dirty |= std::mem::take(&mut shard.dirty);
        }
        dirty
    }

    /// The store shards changed since the last call (and clears their marks): what a sharded
    /// checkpoint ([`Self::checkpoint_shards`]) writes.
    pub fn take_dirty_shards(&self) -> Vec<usize> {
        let mut dirty = Vec::new();
        for (i, shard) in self.inner.shards.iter().enumerate() {
            if std::mem::take(&mut lock(&shard.0).dirty) {
                dirty.push(i);
            }
        }
        dirty
    }

    /// Number of store shards.
    pub fn shard_count(&self) -> usize {
        self.inner.shards.len()
    }

    /// A snapshot of everything worth keeping across a restart: admission, cooldowns, bans,
    /// leases, sessions and the token high-water marks. Proxy configuration and credentials
    /// are not in it: the controller configures proxies again.
    pub fn checkpoint(&self) -> Checkpoint {
        let all: Vec<usize> = (0..self.inner.shards.len()).collect();
        let now = self.now();
        let mut out = Checkpoint {
            version: Checkpoint::VERSION,
            saved_at_ms: now,
            ..Checkpoint::default()
        };
        // The parts hold disjoint proxies and sessions (each its own shard's), each sorted, all
        // saved at the same instant: joining them is a stable sort of sorted runs, not the
        // general `Checkpoint::merge` (a map insert per proxy: most of the time of a
        // checkpoint of 10k proxies, taken every second on a serving thread).
        for part in self.checkpoint_shards(&all) {
            out.saved_at_ms = part.saved_at_ms;
            for (shard, hwm) in part.token_hwm {
                let have = out.token_hwm.entry(shard).or_insert(0);
                *have = (*have).max(hwm);
            }
            out.proxies.extend(part.proxies);
            out.sessions.extend(part.sessions);
        }
        out.proxies.sort_by(|a, b| a.key.cmp(&b.key));
        out.sessions.sort_by(|a, b| a.session_key.cmp(&b.session_key));
        out
    }

    /// One self-contained checkpoint per store shard in `which` (same order): its proxies,
    /// the sticky sessions bound to them, and every token high-water mark this process knows
    /// (a few numbers, so any one part bounds the tokens issued before it). Parts join with
    /// [`Checkpoint::merge`].
    pub fn checkpoint_shards(&self, which: &[usize]) -> Vec<Checkpoint> {
        let now = self.now();
        let mut hwm = BTreeMap::new();
        {
            let restore = self.inner.restore.read().unwrap_or_else(|e| e.into_inner());
            hwm.extend(restore.hwm.iter().map(|(k, v)| (*k, *v)));
        }
        let mut parts: Vec<Checkpoint> = Vec::with_capacity(which.len());
        let mut position = HashMap::new();
        for (pos, &index) in which.iter().enumerate() {
            position.insert(index, pos);
            let mut shard = lock(&self.inner.shards[index].0);
            // Expiries that are due start their rests before they are recorded.
            shard.settle(now);
            let mut cp = Checkpoint {
                version: Checkpoint::VERSION,
                saved_at_ms: now,
                token_hwm: hwm.clone(),
                ..Checkpoint::default()
            };
            // The sequence itself, not just the last token issued: it starts at the clock, so a
            // checkpoint taken before any lease still bounds what came before it.
            let mark = cp.token_hwm.entry(shard.id).or_insert(0);
            *mark = (*mark).max((shard.seq << SHARD_BITS) | shard.id as u64);
            cp.proxies.extend(
                shard
                    .slots
                    .iter()
                    .filter_map(|slot| slot.proxy.as_ref())
                    .filter_map(|p| proxy_checkpoint(p, now)),
            );
            cp.proxies.sort_by(|a, b| a.key.cmp(&b.key));
            parts.push(cp);
        }
        for sessions in self.inner.sessions.iter() {
            for (k, b) in lock(&sessions.0).iter() {
                if b.expires_at <= now {
                    continue;
                }
                // A binding lives with its proxy's shard: binding it there dirtied that shard.
                if let Some(&pos) = position.get(&self.shard_index(&b.key)) {
                    parts[pos].sessions.push(SessionCheckpoint {
                        session_key: k.to_string(),
                        proxy: b.key.clone(),
                        expires_at_ms: b.expires_at,
                    });
                }
            }
        }
        for cp in &mut parts {
            cp.sessions.sort_by(|a, b| a.session_key.cmp(&b.session_key));
        }
        parts
    }

    /// Loads a checkpoint: call once at start, before serving (upserts may come before or
    /// after). Proxies it names that the controller has not configured (yet) are kept, closed,
    /// for [`LeaseStoreConfig::restore_grace`] so their leases can be renewed and released.
    pub fn restore(&self, cp: &Checkpoint) {
        let now = self.now();
        let grace = self.inner.config.restore_grace.as_millis() as u64;
        let max_seq = cp.token_hwm.values().map(|t| t >> SHARD_BITS).max().unwrap_or(0);
        let floor = (now * SEQ_PER_MS).max(max_seq + RESTORE_SEQ_RESERVE);
        {
            let mut restore = self.inner.restore.write().unwrap_or_else(|e| e.into_inner());
            restore.hwm = cp.token_hwm.iter().map(|(k, v)| (*k, *v)).collect();
            restore.seq_floor = restore.seq_floor.max(floor);
            restore.unconfirmed_until = now + self.inner.config.unconfirmed_grace.as_millis() as u64;
        }
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            shard.seq = shard.seq.max(floor);
        }
        for pc in &cp.proxies {
            let mut shard = self.shard_for(&pc.key);
            let slot = match shard.by_key.get(&pc.key) {
                Some(slot) => *slot,
                None => {
                    let slot = shard.allocate(pc.key.clone());
                    shard.proxy_mut(slot).parked_until = now + grace;
                    slot
                }
            };
            let generation = shard.slots[slot as usize].generation;
            let p = shard.proxy_mut(slot);
            p.admission = match pc.admission {
                // Open before the restart is not open now: the proxy may have died meanwhile.
                // The controller opens it again once this process has seen it pass a probe.
                CheckpointAdmission::Open => AdmissionState::Closed,
                CheckpointAdmission::Closed => AdmissionState::Closed,
                CheckpointAdmission::Draining => AdmissionState::Draining,
            };
            p.revoked_below = p.revoked_below.max(pc.revoked_below);
            for ban in pc.bans.iter().filter(|b| b.until_ms > now) {
                p.bans.push((ban.domain.as_str().into(), ban.until_ms));
            }
            let mut added = 0;
            for l in pc.leases.iter().filter(|l| l.expires_at_ms > now) {
                if p.leases.iter().any(|have| have.first_token == l.first_token) {
                    continue;
                }
                p.leases.push(LeaseRecord {
                    first_token: l.first_token,
                    token: l.token,
                    acquired_at: l.acquired_at_ms,
                    expires_at: l.expires_at_ms,
                    ttl_ms: l.ttl_ms.max(1),
                    holder: SmallStr::new(&l.holder),
                    target_domain: l.target_domain.as_deref().map(Into::into),
                    session_key: l.session_key.as_deref().map(Into::into),
                    restored: true,
                });
                added += 1;
            }
            let cooling = pc.cooldown_until_ms.filter(|until| *until > now);
            if let Some(until) = cooling {
                p.cooling_until = until;
                shard.cooling.push(Reverse((until, slot, generation)));
            }
            shard.active += added;
            shard.dirty = true;
            if let Some(next) = shard.proxy(slot).leases.iter().map(|l| l.expires_at).min() {
                shard.schedule_expiry(slot, next);
            }
            shard.relink(slot, now, false);
        }
        for sc in cp.sessions.iter().filter(|s| s.expires_at_ms > now) {
            let mut sessions = lock(&self.inner.sessions[self.session_shard(&sc.session_key)].0);
            sessions.entry(sc.session_key.as_str().into()).or_insert(Binding {
                key: sc.proxy.clone(),
                expires_at: sc.expires_at_ms,
            });
        }
    }
}

/// One proxy's durable state, or `None` if nothing about it is worth keeping.
fn proxy_checkpoint(p: &ProxyState, now: u64) -> Option<ProxyCheckpoint> {
    let leases: Vec<_> = p
        .leases
        .iter()
        .filter(|l| l.expires_at > now)
        .map(|l| LeaseCheckpoint {
            first_token: l.first_token,
            token: l.token,
            holder: l.holder.as_str().to_owned(),
            acquired_at_ms: l.acquired_at,
            expires_at_ms: l.expires_at,
            ttl_ms: l.ttl_ms,
            target_domain: l.target_domain.as_deref().map(str::to_owned),
            session_key: l.session_key.as_deref().map(str::to_owned),
        })
        .collect();
    let bans: Vec<_> = p
        .bans
        .iter()
        .filter(|(_, until)| *until > now)
        .map(|(d, until)| BanCheckpoint {
            domain: d.to_string(),
            until_ms: *until,
        })
        .collect();
    let admission = match p.admission {
        AdmissionState::Open => CheckpointAdmission::Open,
        AdmissionState::Closed => CheckpointAdmission::Closed,
        AdmissionState::Draining => CheckpointAdmission::Draining,
    };
    let cooling = (p.cooling_until > now).then_some(p.cooling_until);
    if leases.is_empty()
        && bans.is_empty()
        && cooling.is_none()
        && p.revoked_below == 0
        && admission == CheckpointAdmission::Closed
    {
        return None;
    }
    Some(ProxyCheckpoint {
        key: p.key.clone(),
        admission,
        cooldown_until_ms: cooling,
        revoked_below: p.revoked_below,
        bans,
        leases,
    })
}
