//! Leader election with a `coordination.k8s.io/v1` Lease, so that two replicas never both act.
//!
//! The holder renews the Lease every `retry_period`; a candidate takes it over only once it has
//! not been renewed for `lease_duration`. Every write carries the resourceVersion it was based on,
//! so two candidates racing for an expired Lease cannot both win: one gets a conflict. A leader
//! that cannot renew within `renew_deadline` steps down (and the process stops acting) before
//! another replica may take over, since `renew_deadline < lease_duration`.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, api::PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

/// Who leads, as this replica knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Leadership {
    /// Not known yet (no successful read of the Lease).
    Unknown,
    /// This replica leads.
    Leader,
    /// Another replica leads.
    Follower {
        /// Its identity.
        holder: String,
    },
}

/// Timing of the election.
#[derive(Clone, Copy, Debug)]
pub struct LeaderTimings {
    /// How long a Lease is valid after its last renewal.
    pub lease_duration: Duration,
    /// How long a leader keeps acting without a successful renewal.
    pub renew_deadline: Duration,
    /// How often to renew or retry.
    pub retry_period: Duration,
}

impl Default for LeaderTimings {
    fn default() -> Self {
        Self {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// A candidate for the Lease `name` in `api`'s namespace.
pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timings: LeaderTimings,
}

impl LeaderElector {
    /// A candidate named `identity` (the pod name).
    pub fn new(api: Api<Lease>, name: &str, identity: &str, timings: LeaderTimings) -> Self {
        Self {
            api,
            name: name.to_owned(),
            identity: identity.to_owned(),
            timings,
        }
    }

    /// Runs the election until `shutdown` resolves, publishing the leadership on `state`. On
    /// shutdown a leader releases the Lease so a successor need not wait for it to expire.
    pub async fn run(
        self,
        state: watch::Sender<Leadership>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut last_renewal: Option<tokio::time::Instant> = None;
        loop {
            let now = tokio::time::Instant::now();
            match self.try_acquire_or_renew().await {
                Ok(leadership) => {
                    if leadership == Leadership::Leader {
                        last_renewal = Some(now);
                    }
                    if *state.borrow() != leadership {
                        info!(identity = %self.identity, ?leadership, "leadership changed");
                    }
                    state.send_replace(leadership);
                }
                Err(err) => {
                    warn!(identity = %self.identity, error = %err, "leader election round failed");
                    let expired =
                        last_renewal.is_none_or(|t| now.duration_since(t) > self.timings.renew_deadline);
                    if *state.borrow() == Leadership::Leader && expired {
                        warn!(identity = %self.identity, "could not renew the lease in time: stepping down");
                        state.send_replace(Leadership::Unknown);
                    }
                }
            }
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tokio::time::sleep(self.timings.retry_period) => {}
            }
        }
        if *state.borrow() == Leadership::Leader {
            if let Err(err) = self.release().await {
                warn!(error = %err, "releasing the lease failed; it will expire");
            }
            state.send_replace(Leadership::Unknown);
        }
    }

    /// One round: create, renew, or take over an expired Lease.
    pub async fn try_acquire_or_renew(&self) -> Result<Leadership, kube::Error> {
        let now = Timestamp::now();
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec(now, 0, now)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Leadership::Leader),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(Leadership::Unknown),
                Err(err) => Err(err),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let transitions = spec.lease_transitions.unwrap_or(0);
        let renewed = spec.renew_time.as_ref().map(|t| t.0).unwrap_or_default();
        let duration = spec
            .lease_duration_seconds
            .map(|s| jiff::SignedDuration::from_secs(i64::from(s)))
            .unwrap_or_default();
        let (acquired, transitions) = if holder == self.identity {
            (spec.acquire_time.map(|t| t.0).unwrap_or(now), transitions)
        } else if holder.is_empty() || renewed + duration < now {
            (now, transitions + 1)
        } else {
            return Ok(Leadership::Follower { holder });
        };
        lease.spec = Some(self.spec(acquired, transitions, now));
        // `replace` sends the resourceVersion we read: a racing candidate gets a conflict.
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(Leadership::Leader),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Leadership::Unknown),
            Err(err) => Err(err),
        }
    }

    async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        if lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(&self.identity) {
            return Ok(());
        }
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = None;
        }
        self.api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    }

    fn spec(&self, acquired: Timestamp, transitions: i32, now: Timestamp) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.timings.lease_duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }
}
