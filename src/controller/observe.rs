//! **resolve** and **observe**: every read of one reconcile, and the table's facts that follow.
//!
//! [`Observer::resolve`] reads the Secrets the spec references and hashes the spec, once per
//! reconcile; [`Observer::observe`] gathers, every round, what the world says (the provider's
//! `get`, its availability, the health verdict, the leases, the credentials book, the pool's
//! budgets) into an [`Observation`]. All the reconcile's reads are here; [`facts`] then turns an
//! observation, the record written so far and the clock into the table's [`Facts`] (no client
//! required), and [`cause_of`] says what caused a derived event. Level-triggered: facts come from
//! comparing the world with the record, never from what woke the reconciler.

use jiff::Timestamp;
use tracing::debug;

use super::{
    availability::ProviderAvailability,
    credentials::CredentialsBook,
    error::ReconcileError,
    pool::{Budgets, PoolFacts, Pools},
    spec_hash::{self, Comparison},
    status::{DeleteProgress, Record},
};
use crate::{
    api::{Proxy, ProxyKey, RECYCLE_ANNOTATION},
    effects::{ProxyBackend, SecretError},
    health::{HealthControl, Verdict as HealthVerdict},
    lease::LeaseControl,
    machine::{Event, Fact, Facts, Phase, Timers, reason},
    provider::{
        Credentials, CredentialsCheck, Instance, InstanceState, Owner, ProviderError, SharedProvider,
        UnknownProvider, UserData,
    },
};

/// What the spec resolves to: its hash and the Secrets' content.
pub(crate) struct Resolved {
    pub hash: String,
    pub user_data: Option<UserData>,
    pub credentials: Option<Credentials>,
}

/// The reconciler's read side, borrowed for one reconcile.
pub(crate) struct Observer<'a, B> {
    pub backend: &'a B,
    pub availability: &'a ProviderAvailability,
    pub health: &'a dyn HealthControl,
    pub leases: &'a dyn LeaseControl,
    pub credentials: &'a CredentialsBook,
    pub pools: &'a Pools,
    pub timers: &'a Timers,
    pub budgets: &'a Budgets,
}

/// The Proxy one reconcile is about, and what its spec resolved to: what observers and
/// executors both read.
pub(crate) struct Subject<'a> {
    pub proxy: &'a Proxy,
    pub key: &'a ProxyKey,
    /// The provider's name of its instance.
    pub instance: &'a str,
    pub owner: &'a Owner,
    pub provider_name: &'a str,
    pub provider: Option<&'a SharedProvider>,
    pub resolved: &'a Result<Resolved, SpecProblem>,
}

impl<B: ProxyBackend> Observer<'_, B> {
    /// Reads the Secrets the spec references and computes the spec hash. A spec the user must
    /// fix is `Ok(Err(problem))`; a read that may work next time is an error.
    pub async fn resolve(
        &self,
        proxy: &Proxy,
        key: &ProxyKey,
        provider: Result<&SharedProvider, &UnknownProvider>,
    ) -> Result<Result<Resolved, SpecProblem>, ReconcileError> {
        if let Err(unknown) = provider {
            return Ok(Err(SpecProblem {
                reason: "UnknownProvider",
                message: unknown.to_string(),
            }));
        }
        let user_data = match &proxy.spec.cloud_init {
            None => None,
            Some(cloud_init) => {
                let read = self
                    .backend
                    .cloud_init(key.namespace(), &cloud_init.secret_ref)
                    .await;
                match secret_value(read, "CloudInitSecretUnusable")? {
                    Ok(data) => Some(data),
                    Err(problem) => return Ok(Err(problem)),
                }
            }
        };
        let credentials = match &proxy.spec.auth {
            None => None,
            Some(auth) => {
                let read = self
                    .backend
                    .credentials(key.namespace(), &auth.secret_ref.name)
                    .await;
                match secret_value(read, "CredentialsSecretUnusable")? {
                    Ok(credentials) => Some(credentials),
                    Err(problem) => return Ok(Err(problem)),
                }
            }
        };
        let hash = spec_hash::for_spec(&proxy.spec, user_data.as_ref().map(|d| d.0.as_str()));
        Ok(Ok(Resolved {
            hash,
            user_data,
            credentials,
        }))
    }

    /// A Secret rotated again after a failed credentials update is a new request, like a spec
    /// edit.
    pub fn rotated_since_failure(&self, subject: &Subject<'_>) -> bool {
        subject.resolved.as_ref().is_ok_and(|r| {
            self.credentials
                .rotated_since_failure(subject.key, r.credentials.as_ref())
        })
    }

    /// One look at the world for `subject`, as `record` stands.
    pub async fn observe(
        &self,
        subject: &Subject<'_>,
        record: &Record,
        spec_edited: bool,
        finalizer_present: bool,
        now: Timestamp,
    ) -> Observation {
        let Subject {
            proxy, key, resolved, ..
        } = subject;
        let mut provider_down = subject
            .provider
            .and_then(|_| self.availability.down_reason(subject.provider_name));
        let instance = match subject.provider {
            Some(provider) if needs_instance(record.state.phase()) => {
                look_up(provider, subject.instance, key, &mut provider_down).await
            }
            _ => InstanceObservation::NotChecked,
        };
        // Compared only against a spec that resolves: an unreadable Secret says nothing about
        // which credentials are wanted.
        let in_place = subject.provider.is_some_and(|p| p.updates_credentials_in_place());
        if let (Some(provider), InstanceObservation::Present(_), Ok(resolved)) =
            (subject.provider, &instance, resolved)
        {
            self.learn_running_credentials(provider, subject, resolved.credentials.as_ref())
                .await;
        }
        let (credentials_changed, credentials_need_replacement) = match resolved {
            Ok(resolved) => self
                .credentials
                .compare(key, resolved.credentials.as_ref(), in_place),
            Err(_) => (false, false),
        };
        let spec_changed = match (resolved, applied_hash(&instance, record)) {
            (Ok(resolved), Some(applied)) => {
                let user_data = resolved.user_data.as_ref().map(|d| d.0.as_str());
                match spec_hash::compare(applied, &proxy.spec, user_data) {
                    Comparison::Same => false,
                    Comparison::Changed => true,
                    // Written by a newer operator (a downgrade), or not a hash: replacing every
                    // instance on that guess would be worse than keeping them.
                    Comparison::Unknown => {
                        debug!(proxy = %key, applied, "spec hash of an unknown encoding: not treated as a change");
                        false
                    }
                }
            }
            _ => false,
        };
        // An instance that cannot take new credentials in place is replaced like a changed spec.
        let spec_changed = spec_changed || (credentials_need_replacement && resolved.is_ok());
        // The budgets matter (and a replacement slot is reserved) only where a replacement is
        // about to be decided: a changed spec, or a degraded proxy whose timer ran out (the
        // facts `spec_changed` and `timer_expired` the table reads).
        let recycle_requested = recycle_request(proxy)
            .filter(|request| record.last_recycle.as_deref() != Some(*request))
            .map(str::to_owned);
        let phase = record.state.phase();
        let replacing_soon = spec_changed
            || recycle_requested.is_some()
            || (phase == Phase::Degraded && self.timers.expired(&record.state, now));
        Observation {
            deletion_requested: proxy.metadata.deletion_timestamp.is_some(),
            finalizer_present,
            spec_edited,
            desired_hash: resolved.as_ref().map(|r| r.hash.clone()).map_err(Clone::clone),
            spec_changed,
            credentials_changed,
            provider_down,
            instance,
            health: self.health.verdict(key),
            health_error: self.health.last_error(key),
            active_leases: self.leases.active(key),
            pool: self
                .pools
                .facts(key, subject.provider_name, phase, self.budgets, replacing_soon),
            recycle_requested,
        }
    }

    /// After a restart this process does not know what a running instance was given: it asks
    /// the provider, so that credentials are given (or the instance replaced), and the trail
    /// says so, only if they changed meanwhile.
    async fn learn_running_credentials(
        &self,
        provider: &SharedProvider,
        subject: &Subject<'_>,
        desired: Option<&Credentials>,
    ) {
        if self.credentials.known(subject.key) {
            return;
        }
        match provider.check_credentials(subject.instance, desired).await {
            Ok(CredentialsCheck::Accepts) => self.credentials.set_running(subject.key, desired.cloned()),
            Ok(CredentialsCheck::Differs) => self.credentials.found_different(subject.key),
            Ok(CredentialsCheck::CannotTell) => {}
            Err(err) => {
                debug!(proxy = %subject.key, error = %err, "checking which credentials the instance accepts failed: as if the provider could not tell");
            }
        }
    }
}

async fn look_up(
    provider: &SharedProvider,
    instance: &str,
    key: &ProxyKey,
    provider_down: &mut Option<String>,
) -> InstanceObservation {
    match provider.get(instance).await {
        Ok(found) => InstanceObservation::Present(Box::new(found)),
        Err(ProviderError::NotFound(_)) => InstanceObservation::Missing,
        Err(ProviderError::Unavailable(reason)) => {
            provider_down.get_or_insert(reason);
            InstanceObservation::Unknown
        }
        Err(other) => {
            debug!(proxy = %key, error = %other, "instance lookup failed");
            InstanceObservation::Unknown
        }
    }
}

/// A referenced Secret's value. A Secret the user must fix becomes a [`SpecProblem`] with
/// `reason`; anything else stays an error, retried with back-off.
fn secret_value<T>(
    read: Result<T, SecretError>,
    reason: &'static str,
) -> Result<Result<T, SpecProblem>, ReconcileError> {
    match read {
        Ok(value) => Ok(Ok(value)),
        Err(SecretError::NotUsable(message)) => Ok(Err(SpecProblem { reason, message })),
        Err(transient) => Err(ReconcileError::Secret(transient)),
    }
}

/// A user error that keeps the Proxy from being realised (the user must change something).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecProblem {
    /// Bounded CamelCase category (`UnknownProvider`, `CloudInitSecretUnusable`, ...).
    pub reason: &'static str,
    /// What to fix. Never contains secret content.
    pub message: String,
}

impl SpecProblem {
    /// The text `SpecValid=False` carries.
    pub fn text(&self) -> String {
        format!("{}: {}", self.reason, self.message)
    }
}

/// What the provider says about the Proxy's instance.
#[derive(Clone, Debug, PartialEq)]
pub enum InstanceObservation {
    /// Not looked up (no instance is expected in this phase, or the provider is unknown).
    NotChecked,
    /// NotFound: it certainly does not exist.
    Missing,
    /// It exists.
    Present(Box<Instance>),
    /// The lookup failed; nothing can be concluded.
    Unknown,
}

/// One look at the world for one Proxy.
#[derive(Clone, Debug)]
pub struct Observation {
    /// The Proxy has a deletionTimestamp.
    pub deletion_requested: bool,
    /// The operator's finalizer is on the Proxy.
    pub finalizer_present: bool,
    /// `metadata.generation` differs from `status.observedGeneration` (the user edited the
    /// spec), or the credentials Secret was rotated again after an update failed: a new request
    /// that may be tried before the old one's backoff passes.
    pub spec_edited: bool,
    /// The desired spec hash, or why the spec cannot be realised.
    pub desired_hash: Result<String, SpecProblem>,
    /// The instance was built from another spec: its hash (the instance's own stamp, else the
    /// status's), compared under the encoding version it was written with, differs from the
    /// spec's ([`super::spec_hash::compare`]). An older encoding is never a change by itself.
    pub spec_changed: bool,
    /// The Secret's proxy credentials differ from the ones this process gave the instance (or,
    /// after a restart, a provider that updates in place found it on others, or could not tell;
    /// one that cannot update them raises `spec_changed` instead).
    pub credentials_changed: bool,
    /// Why the provider is unavailable, if it is.
    pub provider_down: Option<String>,
    /// The instance.
    pub instance: InstanceObservation,
    /// The health engine's verdict.
    pub health: HealthVerdict,
    /// Why its last probe failed, if it did.
    pub health_error: Option<String>,
    /// Leases held on the proxy.
    pub active_leases: usize,
    /// The pool's budget facts.
    pub pool: PoolFacts,
    /// The Proxy's recycle request (its annotation), if it is not the one last acted on.
    pub recycle_requested: Option<String>,
}

/// The Proxy's recycle request: its [`RECYCLE_ANNOTATION`] value, if set and not empty.
pub fn recycle_request(proxy: &Proxy) -> Option<&str> {
    (proxy.metadata.annotations.as_ref())
        .and_then(|annotations| annotations.get(RECYCLE_ANNOTATION))
        .map(String::as_str)
        .filter(|request| !request.is_empty())
}

/// The facts of `observation` for `record` at `now`.
pub fn facts(observation: &Observation, record: &Record, now: Timestamp, timers: &Timers) -> Facts {
    let o = observation;
    let (instance_present, instance_missing, instance_running) = match &o.instance {
        InstanceObservation::Present(instance) => (true, false, instance.state == InstanceState::Running),
        InstanceObservation::Missing => (false, true, false),
        InstanceObservation::NotChecked | InstanceObservation::Unknown => (false, false, false),
    };
    let spec_invalid_reported = match (&o.desired_hash, &record.spec_problem) {
        (Err(problem), Some(reported)) => *reported == problem.text(),
        (Ok(_), Some(_)) => true,
        (_, None) => false,
    };
    let retry_due = o.spec_edited || record.next_attempt.is_none_or(|at| now >= at);
    let mut facts = Facts::NONE;
    for (fact, holds) in [
        (Fact::DeletionRequested, o.deletion_requested),
        (Fact::FinalizerPresent, o.finalizer_present),
        (Fact::SpecValid, o.desired_hash.is_ok()),
        (Fact::SpecInvalidReported, spec_invalid_reported),
        (Fact::SpecChanged, o.spec_changed),
        (Fact::CredentialsChanged, o.credentials_changed),
        (Fact::ProviderDown, o.provider_down.is_some()),
        (
            Fact::ProviderDownReported,
            record.ready_reason == reason::PROVIDER_UNAVAILABLE,
        ),
        (Fact::InstancePresent, instance_present),
        (Fact::InstanceMissing, instance_missing),
        (Fact::InstanceRunning, instance_running),
        (Fact::RunningReported, record.instance_running),
        (Fact::HealthPassing, o.health == HealthVerdict::Passing),
        (Fact::HealthFailing, o.health == HealthVerdict::Failing),
        (Fact::LeasesActive, o.active_leases > 0),
        (Fact::RetryDue, retry_due),
        (
            Fact::DeleteAttempted,
            record.delete_progress != DeleteProgress::NotSent,
        ),
        (
            Fact::DeleteAccepted,
            record.delete_progress == DeleteProgress::Accepted,
        ),
        (Fact::TimerExpired, timers.expired(&record.state, now)),
        (Fact::ReplacementBudgetLeft, o.pool.replacement_budget_left),
        (Fact::RemediationAllowed, o.pool.remediation_allowed),
        (Fact::RecycleRequested, o.recycle_requested.is_some()),
    ] {
        facts.set(fact, holds);
    }
    facts
}

/// The hash what runs was built from: the instance's own stamp when the provider reports one,
/// else what the status recorded when it was created.
pub fn applied_hash<'a>(instance: &'a InstanceObservation, record: &'a Record) -> Option<&'a str> {
    match instance {
        InstanceObservation::Present(instance) => instance.spec_hash.as_deref(),
        _ => None,
    }
    .or(record.spec_hash.as_deref())
}

/// Phases in which the instance's existence decides events (elsewhere no instance is expected).
pub fn needs_instance(phase: Phase) -> bool {
    !matches!(phase, Phase::Pending | Phase::Deleted)
}

/// What caused a derived event, when more than its name says.
pub fn cause_of(event: Event, observation: &Observation, record: &Record, timers: &Timers) -> Option<String> {
    match event {
        Event::SpecInvalid => observation.desired_hash.as_ref().err().map(SpecProblem::text),
        Event::HealthFailed => observation
            .health_error
            .as_ref()
            .map(|error| format!("the failure threshold was crossed; the last probe: {error}")),
        Event::ProviderUnavailable => observation
            .provider_down
            .as_ref()
            .map(|reason| format!("provider unavailable: {reason}")),
        Event::TimerExpired => {
            let timer = record.state.phase().timer()?;
            Some(format!(
                "{} ({} s) ran out in {}",
                timer.as_str(),
                timers.duration(timer).as_secs(),
                record.state.phase()
            ))
        }
        // The row says the provider came back; what the operator knows is that nothing
        // reports it down any more (the monitor, this round's lookup), so it tries again.
        Event::ProviderAvailable => {
            Some("no check reports the provider down now (monitor, lookup): trying again".to_owned())
        }
        Event::InstanceMissing => {
            let id = record.provider_id.as_deref().unwrap_or("of this Proxy");
            Some(match (record.state.phase(), &observation.desired_hash) {
                (Phase::Replacing, Ok(desired)) => format!(
                    "the old instance {id} is gone (the provider reports NotFound); the new one is \
                     built from spec hash {}",
                    short(desired)
                ),
                (Phase::Replacing, Err(_)) => {
                    format!("the old instance {id} is gone (the provider reports NotFound)")
                }
                _ => format!(
                    "instance {id} no longer exists (the provider reports NotFound): deleted \
                     outside the operator, or lost with its host"
                ),
            })
        }
        // Who asked is in the request's value (e.g. "gateway rule blocked ..."): the audit keeps it.
        Event::RecycleRequested => observation
            .recycle_requested
            .as_ref()
            .map(|request| format!("recycle requested: {request}")),
        Event::SpecHashChanged => {
            let desired = observation.desired_hash.as_ref().ok()?;
            let applied = applied_hash(&observation.instance, record)?;
            Some(if short(applied) == short(desired) {
                format!(
                    "the proxy credentials changed and the provider cannot change a running \
                     instance's: replacing it (spec hash {} stays)",
                    short(desired)
                )
            } else {
                format!("spec hash {} -> {}", short(applied), short(desired))
            })
        }
        _ => None,
    }
}

/// The first 12 hex digits of a hash (enough to tell two apart in a message).
pub(crate) fn short(hash: &str) -> &str {
    let hex = hash.rsplit(':').next().unwrap_or(hash);
    &hex[..hex.len().min(12)]
}
