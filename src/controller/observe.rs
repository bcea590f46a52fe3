//! **observe**: what the world says about one Proxy, and the table's facts that follow.
//!
//! [`Observation`] is what the reconciler gathered (client required: Secrets, the provider's
//! `get`, the health verdict, the leases, the pool); [`facts`] turns it, the record written so far
//! and the clock into the table's [`Facts`] (no client required). Level-triggered: facts come from
//! comparing the world with the record, never from what woke the reconciler.

use jiff::Timestamp;

use super::{
    pool::PoolFacts,
    status::{DeleteProgress, Record},
};
use crate::{
    health::Verdict as HealthVerdict,
    machine::{Fact, Facts, Phase, Timers, reason},
    provider::{Instance, InstanceState},
};

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
    /// The Secret's proxy credentials differ from the ones this process gave the instance (or it
    /// does not know them yet, after a restart).
    pub credentials_changed: bool,
    /// Why the provider is unavailable, if it is.
    pub provider_down: Option<String>,
    /// The instance.
    pub instance: InstanceObservation,
    /// The health engine's verdict.
    pub health: HealthVerdict,
    /// Leases held on the proxy.
    pub active_leases: usize,
    /// The pool's budget facts.
    pub pool: PoolFacts,
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
