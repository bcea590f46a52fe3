//! Durability of the store: checkpoints (whole or per shard), restore at start, and the
//! reinstatement of leases a restart lost, from their holders' signed claims.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, HashMap},
};

use super::{
    Binding, LeaseStore, MAX_SHARDS, RESTORE_SEQ_RESERVE, SEQ_PER_MS, SHARD_BITS,
    proxy::{AdmissionState, LeaseRecord, ProxyState},
};
use crate::{
    lease::{
        LeaseClaim, LeaseError,
        checkpoint::{
            BanCheckpoint, Checkpoint, CheckpointAdmission, CheckpointDelta, LeaseCheckpoint,
            ProxyCheckpoint, SessionCheckpoint,
        },
    },
    sync::{lock, read, write},
};

/// What the last restore said about tokens issued before this process.
#[derive(Debug, Default)]
pub(super) struct RestoreInfo {
    /// Highest token per shard number that the checkpoint knew of.
    pub(super) hwm: HashMap<u16, u64>,
    /// Sequence numbers at or below this were issued before this process started.
    pub(super) seq_floor: u64,
    /// Restored leases nobody confirmed stop holding up drains at this time (ms).
    pub(super) unconfirmed_until: u64,
}

impl LeaseStore {
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
            let restore = read(&self.inner.restore);
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
            holder: smol_str::SmolStr::new(&claim.holder),
            target_domain: claim.target_domain.as_deref().map(Into::into),
            session_key: claim.session_key.as_deref().map(Into::into),
            request_id: None,
            restored: false,
            issued_id: None,
        });
        shard.reinstated.insert(first, claim.expires_at_ms);
        shard.observe_token(token);
        shard.active += 1;
        shard.mark(slot);
        shard.schedule_expiry(slot, claim.expires_at_ms);
        shard.relink(slot, now, false);
        Ok(())
    }

    /// Whether anything changed since the last call (and clears the marks, and the changes a
    /// delta checkpoint would have taken: the caller writes everything).
    pub fn take_dirty(&self) -> bool {
        let mut dirty = false;
        for shard in self.inner.shards.iter() {
            dirty |= lock(&shard.0).clear_changes();
        }
        for sessions in self.inner.sessions.iter() {
            lock(&sessions.0).clear_changes();
        }
        dirty
    }

    /// Whether anything changed since the last checkpoint took the changes (clears nothing).
    /// Settles every shard first, so expiries that are due count as changes whether or not the
    /// reaper has run since.
    pub fn has_changes(&self) -> bool {
        let now = self.now();
        let mut changed = false;
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            shard.settle(now);
            changed |= shard.dirty;
        }
        changed
    }

    /// The store shards changed since the last call (and clears their marks): what a sharded
    /// checkpoint ([`Self::checkpoint_shards`]) writes.
    pub fn take_dirty_shards(&self) -> Vec<usize> {
        let mut dirty = Vec::new();
        for (i, shard) in self.inner.shards.iter().enumerate() {
            if lock(&shard.0).clear_changes() {
                dirty.push(i);
            }
        }
        for sessions in self.inner.sessions.iter() {
            lock(&sessions.0).clear_changes();
        }
        dirty
    }

    /// What changed since the last checkpoint took the changes (and takes them): the current
    /// durable state of each proxy changed since (or its removal), the sticky-session bindings
    /// made or extended since, and the token high-water marks. Reads only what changed (each
    /// shard keeps a list of its changed slots), so its cost does not grow with the proxies
    /// that did not change. Applied in order onto the checkpoint it follows
    /// ([`Checkpoint::apply_deltas`]), the deltas give what [`Self::checkpoint`] would have.
    pub fn checkpoint_delta(&self) -> CheckpointDelta {
        let now = self.now();
        let mut out = CheckpointDelta {
            saved_at_ms: now,
            ..CheckpointDelta::default()
        };
        out.token_hwm
            .extend(read(&self.inner.restore).hwm.iter().map(|(k, v)| (*k, *v)));
        for shard in self.inner.shards.iter() {
            let mut shard = lock(&shard.0);
            let mark = out.token_hwm.entry(shard.id).or_insert(0);
            *mark = (*mark).max((shard.seq << SHARD_BITS) | shard.id as u64);
            // Expiries that are due start their rests (and mark their proxies) first, in every
            // shard (a heap peek where none is due).
            shard.settle(now);
            if !std::mem::take(&mut shard.dirty) {
                continue;
            }
            // Removals first: a key removed and added again since is written after as it is now.
            out.removed.append(&mut shard.removed);
            for slot in std::mem::take(&mut shard.changed) {
                let Some(p) = shard.slots[slot as usize].proxy.as_mut() else {
                    continue; // removed since (in `removed`), slot not reused
                };
                if !std::mem::take(&mut p.changed) {
                    continue; // listed twice (emptied and reused), written at its first entry
                }
                match proxy_checkpoint(p, now) {
                    Some(pc) => out.proxies.push(pc),
                    // Nothing worth keeping any more: whatever an earlier checkpoint kept goes.
                    None => out.removed.push(p.key.clone()),
                }
            }
        }
        for sessions in self.inner.sessions.iter() {
            let mut sessions = lock(&sessions.0);
            let sessions = &mut *sessions;
            for session in std::mem::take(&mut sessions.changed) {
                let Some(b) = sessions.map.get_mut(&session) else {
                    continue; // lapsed and reaped: restore drops the old binding as lapsed too
                };
                if std::mem::take(&mut b.changed) && b.expires_at > now {
                    out.sessions.push(SessionCheckpoint {
                        session_key: session.into(),
                        proxy: b.key.clone(),
                        expires_at_ms: b.expires_at,
                    });
                }
            }
        }
        out
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
            let restore = read(&self.inner.restore);
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
            for (k, b) in lock(&sessions.0).map.iter() {
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
    /// for [`crate::lease::LeaseStoreConfig::restore_grace`] so their leases can be renewed and released.
    pub fn restore(&self, cp: &Checkpoint) {
        let now = self.now();
        let grace = self.inner.config.restore_grace.as_millis() as u64;
        let max_seq = cp.token_hwm.values().map(|t| t >> SHARD_BITS).max().unwrap_or(0);
        let floor = (now * SEQ_PER_MS).max(max_seq + RESTORE_SEQ_RESERVE);
        {
            let mut restore = write(&self.inner.restore);
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
                    holder: smol_str::SmolStr::new(&l.holder),
                    target_domain: l.target_domain.as_deref().map(Into::into),
                    session_key: l.session_key.as_deref().map(Into::into),
                    request_id: l.request_id.as_deref().map(Into::into),
                    restored: true,
                    issued_id: None,
                });
                added += 1;
            }
            let cooling = pc.cooldown_until_ms.filter(|until| *until > now);
            if let Some(until) = cooling {
                p.cooling_until = until;
                shard.cooling.push(Reverse((until, slot, generation)));
            }
            shard.active += added;
            shard.mark(slot);
            if let Some(next) = shard.proxy(slot).leases.iter().map(|l| l.expires_at).min() {
                shard.schedule_expiry(slot, next);
            }
            shard.relink(slot, now, false);
        }
        for sc in cp.sessions.iter().filter(|s| s.expires_at_ms > now) {
            let mut sessions = lock(&self.inner.sessions[self.session_shard(&sc.session_key)].0);
            sessions
                .map
                .entry(sc.session_key.as_str().into())
                .or_insert(Binding {
                    key: sc.proxy.clone(),
                    expires_at: sc.expires_at_ms,
                    changed: false,
                });
        }
        // After the shard locks are released: request shards come first in the lock order.
        for pc in &cp.proxies {
            for l in pc.leases.iter().filter(|l| l.expires_at_ms > now) {
                if let Some(request_id) = &l.request_id {
                    self.remember_request(&l.holder, request_id, pc.key.clone(), l.first_token);
                }
            }
        }
    }
}

/// One proxy's durable state, or `None` if nothing about it is worth keeping.
pub(super) fn proxy_checkpoint(p: &ProxyState, now: u64) -> Option<ProxyCheckpoint> {
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
            request_id: l.request_id.as_deref().map(str::to_owned),
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
