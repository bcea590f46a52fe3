//! One shard of the store: a slab of proxies, their intrusive LRU lists, and the heaps of
//! expiry and cooldown times that [`Shard::settle`] brings up to date.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use super::{
    COMBINATION_BASE, NIL, SEQ_PER_MS, SHARD_BITS,
    proxy::{AdmissionState, LeaseRecord, ProxyState},
};
use crate::{
    api::ProxyKey,
    lease::{AcquireRequest, ExpiredLease, Lease, LeaseHint, LeaseId},
};

/// Expired leases a shard keeps for [`super::LeaseStore::take_expired`] between two takes
/// (once a second); beyond that, in a mass expiry, the rest go uncounted rather than grow it.
pub(super) const MAX_EXPIRED_KEPT: usize = 4096;
/// A proxy's membership in one LRU list.
#[derive(Clone, Copy, Debug)]
pub(super) struct Link {
    pub(super) list: u32,
    pub(super) prev: u32,
    pub(super) next: u32,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct ListHead {
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: u32,
}

impl ListHead {
    pub(super) const EMPTY: ListHead = ListHead {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

pub(super) struct Slot {
    pub(super) generation: u32,
    pub(super) proxy: Option<ProxyState>,
}

pub(super) struct Shard {
    pub(super) id: u16,
    pub(super) slots: Vec<Slot>,
    /// LRU links per slot, parallel to `slots`; list 0 holds every eligible proxy, list `p + 1`
    /// those with attribute pair `p`.
    pub(super) links: Vec<Vec<Link>>,
    pub(super) free: Vec<u32>,
    pub(super) by_key: HashMap<ProxyKey, u32>,
    pub(super) lists: Vec<ListHead>,
    /// Lists of the indexed combinations, list id `COMBINATION_BASE + i` at index `i`.
    pub(super) combination_lists: Vec<ListHead>,
    /// The indexed combinations' sorted pair ids, in list-id order.
    pub(super) combinations: Vec<Box<[u32]>>,
    pub(super) cooling: BinaryHeap<Reverse<(u64, u32, u32)>>,
    /// When proxies' earliest leases expire: (time, slot, generation), one live entry per
    /// proxy with leases (its `check_at`); stale ones are skipped when popped.
    pub(super) expiring: BinaryHeap<Reverse<(u64, u32, u32)>>,
    pub(super) seq: u64,
    pub(super) active: usize,
    pub(super) dirty: bool,
    /// Slots whose proxies changed since the last checkpoint took them (each once: its
    /// `changed` flag), so a delta checkpoint reads only those ([`Shard::mark`]).
    pub(super) changed: Vec<u32>,
    /// Proxies removed since the last checkpoint took them.
    pub(super) removed: Vec<ProxyKey>,
    /// Leases that ended at their expiry since [`super::LeaseStore::take_expired`] last took
    /// them, at most [`MAX_EXPIRED_KEPT`].
    pub(super) expired: Vec<ExpiredLease>,
    /// First tokens of leases taken back from claims, until their claimed expiry: a claim is
    /// honoured once.
    pub(super) reinstated: HashMap<u64, u64>,
    /// How many proxies the shard holds (`by_key`'s length), readable without its lock: an
    /// acquire skips a shard with none (a small pool leaves most of the 16 shards empty, and
    /// locking and settling each cost about 80 instructions). Written under the lock whenever
    /// `by_key` changes.
    pub(super) proxies: Arc<AtomicUsize>,
    /// Told the key of a draining proxy whose last lease just ended
    /// ([`super::LeaseStore::on_drained`]).
    pub(super) on_drained: Option<DrainedHook>,
}

/// Told the key of a draining proxy whose last lease ended (released or expired), under its
/// shard's lock: it must only hand the key on (e.g. a channel's `try_send`).
pub type DrainedHook = Arc<dyn Fn(&ProxyKey) + Send + Sync>;

/// Pops the entries of an expiry or cooldown heap that are due at `now`, skipping stale ones
/// (the slot was reused or emptied since): each as (due time, slot, its proxy).
#[inline]
fn pop_due<'a>(
    heap: &mut BinaryHeap<Reverse<(u64, u32, u32)>>,
    slots: &'a mut [Slot],
    now: u64,
) -> Option<(u64, u32, &'a mut ProxyState)> {
    while let Some(&Reverse((at, slot, generation))) = heap.peek() {
        if at > now {
            return None;
        }
        heap.pop();
        let s = &slots[slot as usize];
        if s.generation == generation && s.proxy.is_some() {
            let p = slots[slot as usize].proxy.as_mut()?;
            return Some((at, slot, p));
        }
    }
    None
}

#[inline]
pub(super) fn link_of(links: &mut [Link], list: u32) -> &mut Link {
    links
        .iter_mut()
        .find(|l| l.list == list)
        .expect("a proxy in a list has a link for that list")
}

impl Shard {
    pub(super) fn new(id: u16) -> Self {
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
            changed: Vec::new(),
            removed: Vec::new(),
            expired: Vec::new(),
            reinstated: HashMap::new(),
            proxies: Arc::default(),
            on_drained: None,
        }
    }

    /// Tells the drained hook if `slot`'s proxy is draining and its last lease has just ended.
    pub(super) fn tell_if_drained(&self, slot: u32) {
        let p = self.proxy(slot);
        if p.leases.is_empty()
            && p.admission == AdmissionState::Draining
            && let Some(hook) = &self.on_drained
        {
            hook(&p.key);
        }
    }

    /// Notes that `slot`'s durable state changed: the shard is dirty and the next delta
    /// checkpoint writes this proxy.
    #[inline]
    pub(super) fn mark(&mut self, slot: u32) {
        self.dirty = true;
        let p = self.proxy_mut(slot);
        if !p.changed {
            p.changed = true;
            self.changed.push(slot);
        }
    }

    /// Forgets the changes noted since the last checkpoint (one that wrote everything took
    /// them); returns whether there were any.
    pub(super) fn clear_changes(&mut self) -> bool {
        for slot in std::mem::take(&mut self.changed) {
            if let Some(p) = self.slots[slot as usize].proxy.as_mut() {
                p.changed = false;
            }
        }
        self.removed.clear();
        std::mem::take(&mut self.dirty)
    }

    #[inline]
    pub(super) fn proxy(&self, slot: u32) -> &ProxyState {
        self.slots[slot as usize]
            .proxy
            .as_ref()
            .expect("slots reached through lists or the key map are occupied")
    }

    #[inline]
    pub(super) fn proxy_mut(&mut self, slot: u32) -> &mut ProxyState {
        self.slots[slot as usize]
            .proxy
            .as_mut()
            .expect("slots reached through lists or the key map are occupied")
    }

    #[inline]
    pub(super) fn next_token(&mut self, now: u64) -> u64 {
        self.seq = (self.seq + 1).max(now * SEQ_PER_MS);
        (self.seq << SHARD_BITS) | self.id as u64
    }

    pub(super) fn observe_token(&mut self, token: u64) {
        self.seq = self.seq.max(token >> SHARD_BITS);
    }

    pub(super) fn allocate(&mut self, key: ProxyKey) -> u32 {
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
        self.proxies.store(self.by_key.len(), Ordering::Relaxed);
        self.set_pairs(slot, Vec::new());
        slot
    }

    #[inline]
    pub(super) fn head(&self, list: u32) -> &ListHead {
        match list.checked_sub(COMBINATION_BASE) {
            Some(i) => &self.combination_lists[i as usize],
            None => &self.lists[list as usize],
        }
    }

    #[inline]
    pub(super) fn head_mut(&mut self, list: u32) -> &mut ListHead {
        match list.checked_sub(COMBINATION_BASE) {
            Some(i) => &mut self.combination_lists[i as usize],
            None => &mut self.lists[list as usize],
        }
    }

    /// Appends `slot` to the tail of the list its link at `pos` names.
    pub(super) fn append(&mut self, slot: u32, pos: usize) {
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

    pub(super) fn link_tail(&mut self, slot: u32) {
        for pos in 0..self.links[slot as usize].len() {
            self.append(slot, pos);
        }
        self.proxy_mut(slot).linked = true;
    }

    pub(super) fn unlink(&mut self, slot: u32) {
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
    pub(super) fn relink(&mut self, slot: u32, now: u64, used: bool) {
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
    pub(super) fn start_cooldown(&mut self, slot: u32, from: u64, now: u64) {
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
    pub(super) fn schedule_expiry(&mut self, slot: u32, expires_at: u64) {
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
    #[inline]
    pub(super) fn settle(&mut self, now: u64) -> usize {
        let mut expired = 0;
        while let Some((at, slot, p)) = pop_due(&mut self.expiring, &mut self.slots, now) {
            if p.check_at != at {
                continue;
            }
            p.check_at = 0;
            expired += self.expire_leases(slot, now);
        }
        self.promote_cooled(now);
        expired
    }

    /// Puts proxies whose cooldown ended back into the lists.
    pub(super) fn promote_cooled(&mut self, now: u64) {
        while let Some((until, slot, p)) = pop_due(&mut self.cooling, &mut self.slots, now) {
            if p.cooling_until == until {
                p.cooling_until = 0;
                self.relink(slot, now, false);
            }
        }
    }

    pub(super) fn grant(
        &mut self,
        slot: u32,
        req: &AcquireRequest<'_>,
        domain: Option<&str>,
        ttl_ms: u64,
        now: u64,
    ) -> Lease {
        let token = self.next_token(now);
        let hint = self.hint(slot);
        let p = self.proxy_mut(slot);
        let ttl_ms = ttl_ms.min(p.max_ttl_ms);
        let expires_at = now + ttl_ms;
        p.leases.push(LeaseRecord {
            first_token: token,
            token,
            acquired_at: now,
            expires_at,
            ttl_ms,
            holder: smol_str::SmolStr::new(req.holder),
            target_domain: domain.map(Into::into),
            session_key: req.session_key.map(Into::into),
            request_id: req.request_id.map(Into::into),
            restored: false,
            issued_id: None,
        });
        let proxy = p
            .info
            .clone()
            .expect("only configured proxies are eligible for a grant");
        let key = p.key.clone();
        self.active += 1;
        self.mark(slot);
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

    /// Where a lease of `slot`'s proxy is kept now (what its lease ID carries).
    pub(super) fn hint(&self, slot: u32) -> LeaseHint {
        LeaseHint {
            shard: self.id,
            slot,
            generation: self.slots[slot as usize].generation,
        }
    }

    pub(super) fn slot_by_hint(&self, id: &LeaseId) -> Option<u32> {
        let s = self.slots.get(id.hint.slot as usize)?;
        let p = s.proxy.as_ref()?;
        (s.generation == id.hint.generation && p.key == id.key).then_some(id.hint.slot)
    }

    /// Removes expired leases of one proxy; each rests the proxy from its `expires_at`, like a
    /// release at that instant. Schedules the next expiry of those left.
    pub(super) fn expire_leases(&mut self, slot: u32, now: u64) -> usize {
        let room = MAX_EXPIRED_KEPT.saturating_sub(self.expired.len());
        let mut ended = Vec::new();
        let p = self.proxy_mut(slot);
        let before = p.leases.len();
        let mut last_end = 0;
        p.leases.retain(|l| {
            let live = l.expires_at > now;
            if !live {
                last_end = last_end.max(l.expires_at);
                // A lease restored from a checkpoint was granted before this process started,
                // which usage does not count from.
                if !l.restored && ended.len() < room {
                    ended.push(ExpiredLease {
                        holder: l.holder.as_str().to_owned(),
                        held_ms: l.expires_at.saturating_sub(l.acquired_at),
                    });
                }
            }
            live
        });
        let expired = before - p.leases.len();
        let next = p.leases.iter().map(|l| l.expires_at).min();
        self.expired.append(&mut ended);
        if expired > 0 {
            self.active -= expired;
            self.mark(slot);
            self.start_cooldown(slot, last_end, now);
            self.relink(slot, now, false);
            self.tell_if_drained(slot);
        }
        if let Some(next) = next {
            self.schedule_expiry(slot, next);
        }
        expired
    }

    pub(super) fn remove_slot(&mut self, slot: u32) {
        if self.proxy(slot).linked {
            self.unlink(slot);
        }
        let s = &mut self.slots[slot as usize];
        if let Some(p) = s.proxy.take() {
            self.active -= p.leases.len();
            self.by_key.remove(&p.key);
            self.proxies.store(self.by_key.len(), Ordering::Relaxed);
            self.removed.push(p.key);
        }
        s.generation = s.generation.wrapping_add(1);
        self.free.push(slot);
        self.dirty = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an acquire reads without the lock follows the shard's proxies as they come and go.
    #[test]
    fn the_proxy_count_read_without_the_lock_follows_the_shard() {
        let mut shard = Shard::new(0);
        let count = shard.proxies.clone();
        let a = shard.allocate(ProxyKey::new("ns", "a"));
        let b = shard.allocate(ProxyKey::new("ns", "b"));
        assert_eq!(count.load(Ordering::Relaxed), 2);
        shard.remove_slot(a);
        assert_eq!(count.load(Ordering::Relaxed), 1);
        shard.remove_slot(b);
        assert_eq!(count.load(Ordering::Relaxed), 0);
        shard.allocate(ProxyKey::new("ns", "a"));
        assert_eq!(count.load(Ordering::Relaxed), 1);
    }
}
