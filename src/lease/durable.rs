//! The lease operations as crawlers see them: a change to the store that, when a journal is
//! set, is durable before it is answered.
//!
//! Each operation asks the store for the change ([`LeaseStore`] returns what it changed: the
//! lease granted, the token and expiry renewed, the ban and cooldown a release started),
//! journals that change and awaits its commit; a grant that cannot be made durable is undone
//! (nobody was told its token), a confirmed one marks its request ID answered and is signed
//! into its lease ID. A renew or release presents that ID: the store compares it with the one
//! it kept ([`super::token::IssuedId`]), and only an ID it kept none for is verified in full;
//! a lease the store does not know (one the last checkpoint missed) is then taken back from
//! its signed claim. The discovery API parses a request, calls one of these and answers; it
//! neither signs, journals nor undoes.

use std::time::Duration;

use super::{
    AcquireRequest, Checked, Granted, Lease, LeaseClaim, LeaseError, LeaseStore, Outcome, Released, Renewed,
    journal::{Journal, JournalError, Record},
    token::LeaseSigner,
};

/// A lease operation failed: refused by the store, or not made durable.
#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    /// The store refused it (nothing changed).
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// The change could not be made durable; an acquire was undone, a renew or release stands
    /// in memory and is journalled again by the next checkpoint.
    #[error("the lease operation could not be made durable: {0}")]
    Journal(JournalError),
}

/// A lease granted (or answered again for its request ID).
#[derive(Debug)]
pub struct Acquired {
    /// The lease.
    pub lease: Lease,
    /// What its ID says, as granted.
    pub claim: LeaseClaim,
    /// Its ID, signed.
    pub lease_id: String,
    /// An earlier acquire with the same request ID granted it (and made it durable).
    pub repeated: bool,
}

/// The store, the key its lease IDs are signed with and, in standalone mode, the journal that
/// makes its changes durable.
#[derive(Clone, Copy)]
pub struct DurableLeases<'a> {
    store: &'a LeaseStore,
    signer: &'a LeaseSigner,
    journal: Option<&'a Journal>,
}

impl<'a> DurableLeases<'a> {
    /// Operations on `store` with IDs signed by `signer`, journalled to `journal` when there is
    /// one.
    pub fn new(store: &'a LeaseStore, signer: &'a LeaseSigner, journal: Option<&'a Journal>) -> Self {
        Self {
            store,
            signer,
            journal,
        }
    }

    /// Why the journal cannot make operations durable now, if it cannot: callers refuse
    /// before changing anything.
    pub fn failing(&self) -> Option<JournalError> {
        self.journal?.failing().map(JournalError::Failing)
    }

    /// Grants a lease for `request`, durable before it returns.
    pub async fn acquire(&self, request: &AcquireRequest<'_>, now: u64) -> Result<Acquired, DurableError> {
        let Granted { lease, repeat_of } = self.store.acquire_granted_at(request, now)?;
        if let Some(claim) = repeat_of {
            return Ok(self.issue(lease, claim, true));
        }
        let claim = lease.claim(request.holder, request.target_domain, request.session_key);
        let idle = self.store.config().session_idle_ttl;
        let committed = self
            .commit(|| Record::acquired(&lease, &claim, request.request_id, idle))
            .await;
        if let Err(error) = committed {
            // Not durable, so not granted: free the slot (nobody was told its token).
            let _ = self
                .store
                .release_at(&lease.id, lease.fencing_token, Outcome::Error, None, now);
            if let Some(request_id) = request.request_id {
                self.store.forget_request(request.holder, request_id);
            }
            return Err(error);
        }
        if let Some(request_id) = request.request_id {
            self.store.confirm_request(request.holder, request_id);
        }
        Ok(self.issue(lease, claim, false))
    }

    /// Signs `claim` into the lease's ID and keeps the ID as the store's verdict on it.
    fn issue(&self, lease: Lease, claim: LeaseClaim, repeated: bool) -> Acquired {
        let lease_id = self.signer.sign(&claim);
        self.store.keep_issued_id(&lease.id, &lease_id);
        Acquired {
            lease,
            claim,
            lease_id,
            repeated,
        }
    }

    /// Extends the lease the ID `id` names from `now` and issues a new token.
    pub async fn renew(
        &self,
        id: &str,
        token: u64,
        ttl: Option<Duration>,
        now: u64,
    ) -> Result<Renewed, DurableError> {
        let kept = self
            .signer
            .presented(id)
            .and_then(|presented| self.store.renew_presented_at(&presented, token, ttl, now));
        let (renewed, lease) = match kept {
            Some(result) => result?,
            None => {
                let claim = self.verify(id)?;
                let renewed = self.with_claim(&claim, token, now, |store| {
                    store.renew_at(&claim.id, token, ttl, now)
                })?;
                // Verified in full once: later calls with this ID compare it with the kept one.
                self.store.keep_issued_id(&claim.id, id);
                (renewed, claim.id)
            }
        };
        self.commit(|| Record::Renew {
            key: lease.key,
            first_token: lease.first_token,
            token: renewed.fencing_token,
            expires_at_ms: renewed.expires_at_ms,
        })
        .await?;
        Ok(renewed)
    }

    /// Ends the lease the ID `id` names with `outcome`; a ban applies to `target_domain`, else
    /// to the lease's own, and rests the proxy for the domain for `ban_for` (`None`: the store's
    /// ban cooldown; see [`LeaseStore::release_banning_at`]). Returns the ban and cooldown it
    /// started.
    pub async fn release(
        &self,
        id: &str,
        token: u64,
        outcome: Outcome,
        target_domain: Option<&str>,
        ban_for: Option<std::time::Duration>,
        now: u64,
    ) -> Result<Released, DurableError> {
        let kept = self.signer.presented(id).and_then(|presented| {
            self.store
                .release_presented_at(&presented, token, outcome, target_domain, ban_for, now)
        });
        let (released, lease) = match kept {
            Some(result) => result?,
            None => {
                let claim = self.verify(id)?;
                let released = self.with_claim(&claim, token, now, |store| {
                    store.release_banning_at(&claim.id, token, outcome, target_domain, ban_for, now)
                })?;
                (released, claim.id)
            }
        };
        self.commit(|| Record::Release {
            key: lease.key,
            first_token: lease.first_token,
            cooldown_until_ms: released.cooldown_until_ms,
            ban: released.ban.clone(),
        })
        .await?;
        Ok(released)
    }

    /// The lease the ID `id` names, if it is live and `token` is its current token; nothing
    /// changes and nothing is journalled. A lease the store lost (one the last checkpoint
    /// missed) is not taken back here: it is not found until a renewal takes it back.
    pub fn check(&self, id: &str, token: u64, now: u64) -> Result<Checked, LeaseError> {
        let kept = (self.signer.presented(id))
            .and_then(|presented| self.store.check_presented_at(&presented, token, now));
        match kept {
            Some(result) => result,
            None => self.store.check_at(&self.verify(id)?.id, token, now),
        }
    }

    /// What the lease ID `id` says, if this key signed it; an ID it did not sign is simply
    /// unknown.
    fn verify(&self, id: &str) -> Result<LeaseClaim, LeaseError> {
        self.signer.verify(id).map_err(|_| LeaseError::NotFound)
    }

    /// Runs `op`; if the store has no record of the lease, takes it back from its signed
    /// claim (a lease the last checkpoint missed) and runs `op` again.
    fn with_claim<T>(
        &self,
        claim: &LeaseClaim,
        token: u64,
        now: u64,
        op: impl Fn(&LeaseStore) -> Result<T, LeaseError>,
    ) -> Result<T, LeaseError> {
        match op(self.store) {
            Err(LeaseError::NotFound) => {
                self.store.reinstate_at(claim, token, now)?;
                if let Some(journal) = self.journal {
                    // The operation's own record follows: its commit makes this one durable too.
                    drop(journal.append(&Record::reinstated(claim, token)));
                }
                tracing::info!(proxy = %claim.id.key, "lease reinstated from its signed ID");
                op(self.store)
            }
            other => other,
        }
    }

    /// Appends `record` to the journal, if any, and waits until it is durable.
    async fn commit(&self, record: impl FnOnce() -> Record) -> Result<(), DurableError> {
        match self.journal {
            Some(journal) => journal
                .append(&record())
                .wait()
                .await
                .map_err(DurableError::Journal),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        api::LeasePolicy,
        lease::{
            Admission, Clock, LeaseStoreConfig, LeaseTarget, ProxyKey, Selector,
            checkpoint::BanCheckpoint,
            journal::{JournalConfig, JournalMetrics, SEGMENT_PREFIX, recover},
        },
        provider::Endpoint,
    };

    const T0: u64 = 1_780_000_000_000;

    /// A store with one open proxy `crawl/a` that rests `cooldown` seconds after a release.
    fn store(cooldown: i32) -> LeaseStore {
        let store = LeaseStore::new(LeaseStoreConfig {
            shards: 1,
            ban_cooldown: Duration::from_secs(600),
            session_idle_ttl: Duration::from_secs(60),
            restore_grace: Duration::from_secs(60),
            unconfirmed_grace: Duration::from_secs(30),
            clock: Clock::manual(T0),
        });
        let key = ProxyKey::new("crawl", "a");
        store.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 3128,
            },
            attributes: Default::default(),
            policy: LeasePolicy {
                max_concurrent: 1,
                cooldown_seconds: cooldown,
                max_ttl_seconds: 600,
            },
            credentials: None,
        });
        store.set_admission(&key, Admission::Open).unwrap();
        store
    }

    fn signer() -> LeaseSigner {
        LeaseSigner::new(&LeaseSigner::generate_secret()).unwrap()
    }

    fn journal(dir: &std::path::Path) -> Journal {
        Journal::start(JournalConfig::new(dir), 1, JournalMetrics::default()).unwrap()
    }

    /// The ban and cooldown in the journal are the ones the store started (the domain as the
    /// store keeps it: the lease's own, lowercase, without its final dot).
    #[tokio::test]
    async fn a_release_journals_the_ban_and_cooldown_the_store_started() {
        let dir = tempfile::tempdir().unwrap();
        let journal = journal(dir.path());
        let store = store(5);
        let signer = signer();
        let leases = DurableLeases::new(&store, &signer, Some(&journal));
        let all = store.compile(&Selector::default());
        let request = AcquireRequest {
            selector: &all,
            holder: "c1",
            ttl: Duration::from_secs(60),
            target_domain: Some("Shop.Example."),
            session_key: None,
            request_id: None,
        };
        let acquired = leases.acquire(&request, T0).await.unwrap();
        assert!(!acquired.repeated);
        leases
            .release(
                &acquired.lease_id,
                acquired.lease.fencing_token,
                Outcome::Banned,
                None,
                None,
                T0 + 1_000,
            )
            .await
            .unwrap();
        journal.close();
        let recovered = recover(dir.path(), None).unwrap().checkpoint;
        let proxy = &recovered.proxies[0];
        assert!(proxy.leases.is_empty());
        assert_eq!(
            proxy.bans,
            vec![BanCheckpoint {
                domain: "shop.example".to_owned(),
                until_ms: T0 + 1_000 + 600_000,
            }]
        );
        assert_eq!(proxy.cooldown_until_ms, Some(T0 + 1_000 + 5_000));
    }

    /// An acquire the journal cannot make durable is undone: its slot is free again and its
    /// request ID forgotten, so asking again is a new grant, not an answer about a lease
    /// nobody was told of.
    #[tokio::test]
    async fn an_acquire_that_cannot_be_made_durable_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let journal = journal(dir.path());
        let through = journal.rotate().await.unwrap();
        // The next segment is a full disk.
        std::os::unix::fs::symlink(
            "/dev/full",
            dir.path().join(format!("{SEGMENT_PREFIX}{:020}", through + 1)),
        )
        .unwrap();
        let store = store(0);
        let all = store.compile(&Selector::default());
        let request = AcquireRequest {
            selector: &all,
            holder: "c1",
            ttl: Duration::from_secs(60),
            target_domain: None,
            session_key: None,
            request_id: Some("req-1"),
        };
        let signer = signer();
        let refused = DurableLeases::new(&store, &signer, Some(&journal))
            .acquire(&request, T0)
            .await
            .unwrap_err();
        assert!(matches!(refused, DurableError::Journal(_)), "{refused}");
        assert_eq!(store.active_leases(&ProxyKey::new("crawl", "a")), 0);
        let again = DurableLeases::new(&store, &signer, None)
            .acquire(&request, T0)
            .await
            .unwrap();
        assert!(!again.repeated, "the undone grant was answered again");
        journal.close();
    }
}
