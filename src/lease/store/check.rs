//! Checking a lease without changing it: the lease a presented ID names is live and the
//! presented fencing token is its current one, fenced as a renewal is (what a crawler's
//! outcome report needs: `POST /v1/leases/{id}/outcomes`).

use super::{LeaseStore, shard::Shard};
use crate::lease::{Checked, LeaseError, LeaseId, token::PresentedId};

impl LeaseStore {
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
