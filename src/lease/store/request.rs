//! Acquires by request ID: an acquire that names one gets, while the lease that ID (with the
//! same holder) was granted is active, that lease again instead of another, so a crawler whose
//! acquire got no answer can send it again without taking a second slot.
//!
//! An entry is *pending* from the grant until the caller says the lease is durable
//! ([`LeaseStore::confirm_request`]): a repeat meanwhile is refused
//! ([`LeaseError::RequestInProgress`]) rather than answered with a lease a crash could still
//! take back. Entries are checked against the store when used and pruned when a shard's map
//! has doubled since its last prune, so an ended lease's entry never answers and does not
//! stay for long. Lock order: a request shard, then session and store shards (never the
//! other way round).

use std::{collections::HashMap, hash::BuildHasher};

use super::LeaseStore;
use crate::{
    api::ProxyKey,
    lease::{AcquireRequest, Granted, Lease, LeaseError, LeaseHint, LeaseId},
    sync::lock,
};

/// Request shards (by a hash of holder and request ID).
pub(super) const SHARDS: usize = 16;
/// Entries a shard holds before its first prune.
const MIN_PRUNE_AT: usize = 64;

/// (holder, request ID).
type RequestKey = (Box<str>, Box<str>);

/// One request shard: (holder, request ID) → the lease it was granted.
#[derive(Default)]
pub(super) struct Requests {
    granted: HashMap<RequestKey, Entry>,
    /// Size at which the next prune runs.
    prune_at: usize,
}

struct Entry {
    id: LeaseId,
    /// The caller made the grant durable: repeats are answered.
    confirmed: bool,
}

impl LeaseStore {
    /// Runs `grant` for `req` unless its request ID already has an active lease (see the
    /// module docs).
    pub(super) fn acquire_once(
        &self,
        req: &AcquireRequest<'_>,
        request_id: &str,
        now: u64,
        grant: impl FnOnce() -> Result<Lease, LeaseError>,
    ) -> Result<Granted, LeaseError> {
        self.with_request(req.holder, request_id, |requests, key| {
            if let Some(entry) = requests.granted.get(key) {
                match self.repeat(&entry.id, now) {
                    Ok(granted) if entry.confirmed => return Ok(granted),
                    Ok(_) => return Err(LeaseError::RequestInProgress),
                    // The lease has ended: the request ID may be granted anew.
                    Err(LeaseError::NotFound) => {
                        requests.granted.remove(key);
                    }
                    Err(other) => return Err(other),
                }
            }
            let lease = grant()?;
            requests.granted.insert(
                key.clone(),
                Entry {
                    id: lease.id.clone(),
                    confirmed: false,
                },
            );
            if requests.granted.len() >= requests.prune_at.max(MIN_PRUNE_AT) {
                requests
                    .granted
                    .retain(|_, entry| self.with_lease(&entry.id, now, |_, _, _| Ok(())).is_ok());
                requests.prune_at = requests.granted.len() * 2;
            }
            Ok(Granted {
                lease,
                repeat_of: None,
            })
        })
    }

    /// The lease granted for `holder`'s `request_id` is durable: repeats get it from now on.
    pub fn confirm_request(&self, holder: &str, request_id: &str) {
        self.with_request(holder, request_id, |requests, key| {
            if let Some(entry) = requests.granted.get_mut(key) {
                entry.confirmed = true;
            }
        });
    }

    /// The grant for `holder`'s `request_id` was undone (it could not be made durable).
    pub fn forget_request(&self, holder: &str, request_id: &str) {
        self.with_request(holder, request_id, |requests, key| {
            requests.granted.remove(key);
        });
    }

    /// A restored lease granted for `holder`'s `request_id` (durable: it is in a checkpoint
    /// or the journal).
    pub(super) fn remember_request(&self, holder: &str, request_id: &str, key: ProxyKey, first_token: u64) {
        let id = LeaseId {
            key,
            first_token,
            hint: LeaseHint::default(),
        };
        self.with_request(holder, request_id, |requests, key| {
            requests
                .granted
                .insert(key.clone(), Entry { id, confirmed: true });
        });
    }

    /// Entries in the request index (for tests of its pruning).
    #[cfg(test)]
    pub(crate) fn request_index_len(&self) -> usize {
        self.inner.requests.iter().map(|r| lock(&r.0).granted.len()).sum()
    }

    /// Runs `f` on the request shard of `holder`'s `request_id`, locked.
    fn with_request<R>(
        &self,
        holder: &str,
        request_id: &str,
        f: impl FnOnce(&mut Requests, &RequestKey) -> R,
    ) -> R {
        let key: RequestKey = (holder.into(), request_id.into());
        let shard = (self.inner.hasher.hash_one(&key) % SHARDS as u64) as usize;
        f(&mut lock(&self.inner.requests[shard].0), &key)
    }

    /// Lease `id` as it stands now, with the claim it was granted with.
    fn repeat(&self, id: &LeaseId, now: u64) -> Result<Granted, LeaseError> {
        self.with_lease(id, now, |shard, slot, idx| {
            let p = shard.proxy(slot);
            // Restored after a restart, its proxy not configured again yet: the lease stands,
            // but cannot be described; the caller asks again in a moment.
            let proxy = p.info.clone().ok_or(LeaseError::RequestInProgress)?;
            let rec = &p.leases[idx];
            // Where it is now: the hint the grant signed, unless a restart moved it.
            let claim = rec.claim(&p.key, shard.hint(slot));
            Ok(Granted {
                lease: Lease {
                    id: claim.id.clone(),
                    fencing_token: rec.token,
                    acquired_at_ms: rec.acquired_at,
                    expires_at_ms: rec.expires_at,
                    proxy,
                },
                repeat_of: Some(claim),
            })
        })
    }
}
