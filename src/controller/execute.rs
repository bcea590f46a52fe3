//! **execute** (client required): one executor per effect kind. Each carries out its effect
//! idempotently, updates the [`Record`] the status is written from, and returns the events it
//! observed (a create that failed raises `create_failed`): failures are table events, decided
//! next, never dropped transitions. Which executor raises which event is declared in the table's
//! `raised_by`; `tests/machine_properties.rs` checks the executors raise nothing else.

use tracing::debug;

use super::{
    credentials::CredentialsBook,
    error::ReconcileError,
    observe::{Subject, short},
    plan::Planned,
    status::{DeleteProgress, Record},
};
use crate::{
    effects::ProxyBackend,
    health::{HealthControl, HealthTarget, Verdict as HealthVerdict},
    lease::{LeaseControl, LeaseTarget},
    machine::{AuditEntry, Event, Phase},
    provider::{Credentials, CredentialsUpdate, InstanceRequest, ProviderError},
};

/// An event raised by an executor (or derived), with what caused it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Occurrence {
    /// The event.
    pub event: Event,
    /// The cause, if more than the event's name says (an error text; never secret content).
    pub cause: Option<String>,
}

impl Occurrence {
    fn new(event: Event, cause: impl Into<String>) -> Self {
        Occurrence {
            event,
            cause: Some(cause.into()),
        }
    }
}

/// What the reconcile's own writes changed on the Proxy object.
#[derive(Debug)]
pub(crate) struct ObjectWrites {
    /// The operator's finalizer is on the object.
    pub finalizer: bool,
    /// The object's resourceVersion after our last write, if it moved.
    pub resource_version: Option<String>,
    /// Writes made to the object (finalizer patches), for the write budget.
    pub writes: usize,
}

/// The reconciler's write side, borrowed for one reconcile: one function per effect, all acting
/// on the same [`Subject`].
pub(crate) struct Executors<'a, B> {
    pub backend: &'a B,
    pub leases: &'a dyn LeaseControl,
    pub health: &'a dyn HealthControl,
    pub credentials: &'a CredentialsBook,
    pub subject: Subject<'a>,
}

impl<B: ProxyBackend> Executors<'_, B> {
    /// Carries out one planned effect; returns the events it raised.
    pub async fn execute(
        &self,
        effect: &Planned,
        record: &mut Record,
        object: &mut ObjectWrites,
        entry: &AuditEntry,
    ) -> Result<Vec<Occurrence>, ReconcileError> {
        let key = self.subject.key;
        Ok(match effect {
            Planned::AddFinalizer => {
                self.add_finalizer(object).await?;
                Vec::new()
            }
            Planned::RemoveFinalizer => {
                self.remove_finalizer(object).await?;
                Vec::new()
            }
            // The attempt a retry time waited for runs now: the time is spent (a failure
            // schedules the next one; the failures stay counted until a success clears them).
            // A spent time left in the status would keep `nextAttemptTime` in the past for as
            // long as the state lasts, and say a retry is pending when none is.
            Planned::CreateInstance => {
                record.next_attempt = None;
                self.create_instance(record).await
            }
            Planned::DeleteInstance => {
                record.next_attempt = None;
                self.delete_instance(record).await
            }
            // Registered now; admission opens only once the status that puts the proxy in
            // rotation is stored ([`Self::admit_if_stored_healthy`]), so a crash before that
            // write never leaves leases on an instance the store calls `provisioning`.
            Planned::EnableLeases => {
                if let Some(target) = self.lease_target(record, self.running_credentials()) {
                    self.leases.upsert(target);
                }
                Vec::new()
            }
            Planned::DisableLeases => {
                self.leases.set_admission(key, false);
                Vec::new()
            }
            Planned::DrainLeases => {
                // Whether the drain is complete is a fact (`leases_active`) the next round reads.
                self.leases.drain(key);
                Vec::new()
            }
            Planned::RevokeLeases => {
                let revoked = self.leases.revoke_all(key);
                if revoked > 0 {
                    debug!(proxy = %key, revoked, "revoked leases");
                }
                Vec::new()
            }
            Planned::SetConditions(conditions) => {
                conditions.apply_to(record);
                Vec::new()
            }
            Planned::ReportSpec(report) => {
                report.apply_to(record);
                Vec::new()
            }
            Planned::RecordEvent { message, .. } => {
                // The log keeps the trail in both modes (cluster Events expire).
                tracing::info!(
                    proxy = %key,
                    transition = %entry.arrow(),
                    reason = %entry.reason,
                    detail = %message,
                    "transition"
                );
                if let Err(err) = self.backend.record(self.subject.proxy, entry, message).await {
                    // The audit trail in the cluster is best effort: the status is authoritative.
                    tracing::warn!(proxy = %key, error = %err, "recording an event failed");
                }
                Vec::new()
            }
            Planned::ScheduleRetry {
                attempts,
                next_attempt,
            } => {
                record.retry_attempts = *attempts;
                record.next_attempt = Some(*next_attempt);
                Vec::new()
            }
            Planned::ScheduleCheck { next_check } => {
                record.next_attempt = Some(*next_check);
                Vec::new()
            }
            Planned::ClearRetry => {
                record.retry_attempts = 0;
                record.next_attempt = None;
                Vec::new()
            }
            Planned::UpdateCredentials => {
                record.next_attempt = None;
                self.update_credentials().await
            }
            Planned::NoteRecycle => {
                record.last_recycle = super::observe::recycle_request(self.subject.proxy).map(str::to_owned);
                Vec::new()
            }
        })
    }

    async fn add_finalizer(&self, object: &mut ObjectWrites) -> Result<(), ReconcileError> {
        if !object.finalizer {
            if let Some(version) = self.backend.add_finalizer(self.subject.proxy).await? {
                object.resource_version = Some(version);
            }
            object.finalizer = true;
            object.writes += 1;
        }
        Ok(())
    }

    async fn remove_finalizer(&self, object: &mut ObjectWrites) -> Result<(), ReconcileError> {
        let key = self.subject.key;
        self.leases.remove(key);
        self.health.remove(key);
        self.credentials.forget(key);
        if object.finalizer {
            self.backend.remove_finalizer(self.subject.proxy).await?;
            object.finalizer = false;
            object.writes += 1;
        }
        Ok(())
    }

    async fn create_instance(&self, record: &mut Record) -> Vec<Occurrence> {
        let cx = &self.subject;
        let (provider, resolved) = match (cx.provider, cx.resolved) {
            (Some(provider), Ok(resolved)) => (provider, resolved),
            (_, Err(problem)) => {
                return vec![Occurrence::new(
                    Event::CreateRejected,
                    format!("the spec cannot be realised: {}", problem.text()),
                )];
            }
            (None, Ok(_)) => {
                return vec![Occurrence::new(
                    Event::CreateRejected,
                    format!("provider {:?} is not configured", cx.provider_name),
                )];
            }
        };
        let Ok(port) = u16::try_from(cx.proxy.spec.port) else {
            return vec![Occurrence::new(
                Event::CreateRejected,
                format!("port {} is out of range", cx.proxy.spec.port),
            )];
        };
        let request = InstanceRequest {
            name: cx.instance.to_owned(),
            owner: cx.owner.clone(),
            spec_hash: resolved.hash.clone(),
            placement: cx.proxy.spec.placement.clone(),
            port,
            user_data: resolved.user_data.clone(),
            credentials: resolved.credentials.clone(),
        };
        // Whether the instance is there already (an interrupted earlier create, a crash before
        // the status write): the create then adopts it, and the trail must say so rather than
        // read like a second create. A failed lookup says nothing; the create decides.
        let existed = provider.get(cx.instance).await.is_ok();
        match provider.create(&request).await {
            // An instance that already existed (an interrupted earlier create) is ours only if it
            // was built from this spec; an old one is never adopted as current.
            Ok(instance)
                if instance
                    .spec_hash
                    .as_ref()
                    .is_some_and(|stamped| *stamped != resolved.hash) =>
            {
                record.point_at(&instance, None);
                vec![Occurrence::new(
                    Event::InstanceStale,
                    format!(
                        "instance {} was built from spec hash {}, the spec needs {}",
                        instance.id,
                        short(instance.spec_hash.as_deref().unwrap_or_default()),
                        short(&resolved.hash)
                    ),
                )]
            }
            Ok(instance) => {
                self.credentials.set_running(cx.key, resolved.credentials.clone());
                // What it was built from (an older encoding of the same spec stays as stamped).
                record.point_at(&instance, Some(&resolved.hash));
                // Provisioned=True is reported once this instance is seen running.
                record.instance_running = false;
                let built_from = short(record.spec_hash.as_deref().unwrap_or(&resolved.hash)).to_owned();
                vec![Occurrence::new(
                    Event::InstanceCreated,
                    if existed {
                        format!(
                            "found the existing instance {} (built from spec hash {built_from}): adopted, none created",
                            instance.id
                        )
                    } else {
                        format!("instance {} (spec hash {built_from})", instance.id)
                    },
                )]
            }
            Err(err @ ProviderError::Unavailable(_)) => {
                vec![Occurrence::new(Event::ProviderUnavailable, err.to_string())]
            }
            Err(err @ (ProviderError::Misconfigured(_) | ProviderError::Rejected(_))) => {
                vec![Occurrence::new(Event::CreateRejected, err.to_string())]
            }
            Err(err @ (ProviderError::Backend(_) | ProviderError::NotFound(_))) => {
                vec![Occurrence::new(Event::CreateFailed, err.to_string())]
            }
        }
    }

    /// Gives the running instance the Secret's credentials; see [`crate::provider::Provider::update_credentials`].
    async fn update_credentials(&self) -> Vec<Occurrence> {
        let cx = &self.subject;
        let (Some(provider), Ok(resolved)) = (cx.provider, cx.resolved) else {
            // Raised only with a valid spec (`spec_valid` is one of its facts).
            return Vec::new();
        };
        let desired = resolved.credentials.clone();
        let known = self.credentials.known(cx.key);
        // Unknown only at the first look since this process started, when the provider found
        // the instance on other credentials, or could not tell.
        let found_different = !known && self.credentials.was_found_different(cx.key);
        match provider.update_credentials(cx.instance, desired.as_ref()).await {
            Ok(CredentialsUpdate::Applied) => {
                self.credentials.set_running(cx.key, desired);
                let cause = if known {
                    "the instance accepts the new credentials"
                } else if found_different {
                    "the instance ran other credentials than the Secret's (changed while the operator was down); it accepts the Secret's now"
                } else {
                    "the instance accepts the Secret's credentials, given again since the operator started (the provider could not tell which it accepted)"
                };
                vec![Occurrence::new(Event::CredentialsUpdated, cause)]
            }
            // After a restart a provider that could not tell what the instance runs is assumed
            // to run the Secret's: replacing every such instance on every start would be worse.
            Ok(CredentialsUpdate::Unsupported) if !known && !found_different => {
                self.credentials.set_running(cx.key, desired);
                Vec::new()
            }
            // Only a new instance can carry them: `spec_changed` now holds, and the
            // replacement goes through the pool's budget like a spec change.
            Ok(CredentialsUpdate::Unsupported) => {
                self.credentials.replace_for(cx.key, desired);
                Vec::new()
            }
            Err(err) => {
                self.credentials.update_failed(cx.key, desired);
                vec![Occurrence::new(Event::CredentialsUpdateFailed, err.to_string())]
            }
        }
    }

    async fn delete_instance(&self, record: &mut Record) -> Vec<Occurrence> {
        let cx = &self.subject;
        let Some(provider) = cx.provider else {
            // An attempt all the same: what follows is a retry, not a first delete.
            record.delete_progress = record.delete_progress.max_with(DeleteProgress::Attempted);
            return vec![Occurrence::new(
                Event::DeleteFailed,
                format!(
                    "provider {:?} is not configured, so its instance {} may still exist; configure the \
                     provider again, or delete the instance by hand and remove the finalizer {}",
                    cx.provider_name,
                    cx.instance,
                    super::status::FINALIZER
                ),
            )];
        };
        self.health.remove(cx.key);
        if let Err(err) = provider.delete(cx.instance).await {
            record.delete_progress = record.delete_progress.max_with(DeleteProgress::Attempted);
            return vec![Occurrence::new(Event::DeleteFailed, err.to_string())];
        }
        record.delete_progress = DeleteProgress::Accepted;
        // Only a truthful NotFound says it is gone; an instance still there is terminating.
        match provider.get(cx.instance).await {
            Err(ProviderError::NotFound(_)) => {
                record.forget_instance();
                self.credentials.forget(cx.key);
                let next = match (record.state.phase(), cx.resolved) {
                    (Phase::Replacing, Ok(resolved)) => {
                        format!("; the new one is built from spec hash {}", short(&resolved.hash))
                    }
                    _ => String::new(),
                };
                vec![Occurrence::new(
                    Event::InstanceMissing,
                    format!("deleted: the provider reports NotFound{next}"),
                )]
            }
            Ok(instance) => vec![Occurrence::new(
                Event::DeletePending,
                format!(
                    "instance {} is still there after the delete (terminating)",
                    instance.id
                ),
            )],
            Err(err) => vec![Occurrence::new(
                Event::DeletePending,
                format!("the delete was accepted, but looking it up failed: {err}"),
            )],
        }
    }

    /// What leases and probes of the Proxy use: the credentials its instance accepts.
    fn running_credentials(&self) -> Option<Credentials> {
        let desired = self
            .subject
            .resolved
            .as_ref()
            .ok()
            .and_then(|r| r.credentials.as_ref());
        self.credentials.running_or(self.subject.key, desired)
    }

    /// What the lease store needs for this proxy, once it has an endpoint.
    fn lease_target(&self, record: &Record, credentials: Option<Credentials>) -> Option<LeaseTarget> {
        Some(LeaseTarget {
            key: self.subject.key.clone(),
            endpoint: record.endpoint.clone()?,
            attributes: self.subject.proxy.spec.attributes.clone(),
            policy: self.subject.proxy.spec.lease.clone(),
            credentials,
        })
    }

    /// Opens admission once the status that puts the proxy in rotation is stored (called after
    /// the status write, or when none was needed): admission never runs ahead of what the
    /// store says, whatever a crash interrupts.
    pub fn admit_if_stored_healthy(&self, record: &Record) {
        if record.endpoint.is_some() && self.leasable(record) {
            self.leases.set_admission(self.subject.key, true);
        }
    }

    /// Whether the proxy may take new leases: `healthy`, and *this process* has seen it pass a
    /// probe (after a restart the persisted `healthy` may describe an instance that died
    /// meanwhile).
    fn leasable(&self, record: &Record) -> bool {
        record.state.phase() == Phase::Healthy
            && self.health.verdict(self.subject.key) == HealthVerdict::Passing
    }

    /// Health probing and lease registration are in-memory: after a restart (or a spec edit of
    /// attributes, limits or health settings) they are brought in line with the persisted state
    /// here. This is upkeep of the executors' own state, not a transition: it never changes the
    /// phase or the status.
    pub fn sync_targets(&self, record: &Record) {
        let key = self.subject.key;
        let phase = record.state.phase();
        let live = matches!(phase, Phase::Provisioning | Phase::Healthy | Phase::Degraded);
        match (live, &record.endpoint) {
            (true, Some(endpoint)) => {
                // Probes and leases use what the instance accepts, not what the Secret says.
                let credentials = self.running_credentials();
                self.health.upsert(HealthTarget::from_check(
                    key.clone(),
                    endpoint.clone(),
                    &self.subject.proxy.spec.health,
                    credentials.clone(),
                ));
                if let Some(target) = self.lease_target(record, credentials) {
                    self.leases.upsert(target);
                }
                // Closing is at once; opening waits for the status write.
                if !self.leasable(record) {
                    self.leases.set_admission(key, false);
                }
            }
            _ if phase == Phase::Pending => {
                self.health.remove(key);
                self.leases.set_admission(key, false);
            }
            _ => {}
        }
    }
}
