//! **plan** (no client required): a decided transition's effects, in the row's order, with the
//! parameters the executors need — a value tests print and assert before anything runs.

use std::fmt;

use jiff::Timestamp;

use super::status::Record;
use crate::machine::{Backoff, Decision, EffectKind, Event, Phase, policy};

/// What `report_spec` says in `SpecValid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpecReport {
    /// The spec is invalid: this text says what to fix.
    Invalid(String),
    /// The spec is valid.
    Valid,
}

impl SpecReport {
    /// Writes it into the status record.
    pub fn apply_to(&self, record: &mut Record) {
        record.spec_problem = match self {
            SpecReport::Invalid(text) => Some(text.clone()),
            SpecReport::Valid => None,
        };
    }
}

impl fmt::Display for SpecReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpecReport::Invalid(text) => write!(f, "report_spec(SpecValid=False: {text:?})"),
            SpecReport::Valid => f.write_str("report_spec(SpecValid=True)"),
        }
    }
}

/// What `set_conditions` reports: the `Ready` reason and message, and `Provisioned`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conditions {
    /// Ready's reason (the row's).
    pub reason: &'static str,
    /// Ready's message (the cause, or the event's doc).
    pub message: String,
    /// Report `Provisioned=True` (the event says the instance runs).
    pub provisioned: bool,
}

impl Conditions {
    /// Writes them into the status record (`Provisioned` is only ever set here).
    pub fn apply_to(&self, record: &mut Record) {
        record.ready_reason = self.reason.to_owned();
        record.ready_message = self.message.clone();
        record.instance_running |= self.provisioned;
    }
}

impl fmt::Display for Conditions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "set_conditions(Ready={}: {:?}", self.reason, self.message)?;
        if self.provisioned {
            f.write_str(", Provisioned=True")?;
        }
        f.write_str(")")
    }
}

/// One effect with its parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Planned {
    /// `add_finalizer`.
    AddFinalizer,
    /// `create_instance` for the current spec.
    CreateInstance,
    /// `delete_instance`.
    DeleteInstance,
    /// `enable_leases`.
    EnableLeases,
    /// `disable_leases`.
    DisableLeases,
    /// `drain_leases`.
    DrainLeases,
    /// `revoke_leases`.
    RevokeLeases,
    /// `set_conditions`.
    SetConditions(Conditions),
    /// `report_spec`.
    ReportSpec(SpecReport),
    /// `record_event`: a Kubernetes Event / store entry.
    RecordEvent {
        /// The row's reason.
        reason: &'static str,
        /// The cause, or the event's doc.
        message: String,
    },
    /// `schedule_retry`: the failure count and the next attempt time.
    ScheduleRetry {
        /// Consecutive failures, this one included.
        attempts: u32,
        /// Not before this.
        next_attempt: Timestamp,
    },
    /// `clear_retry`.
    ClearRetry,
    /// `update_credentials`.
    UpdateCredentials,
    /// `remove_finalizer`.
    RemoveFinalizer,
}

impl fmt::Display for Planned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Planned::SetConditions(conditions) => conditions.fmt(f),
            Planned::ReportSpec(report) => report.fmt(f),
            Planned::RecordEvent { reason, message } => write!(f, "record_event({reason}: {message:?})"),
            Planned::ScheduleRetry {
                attempts,
                next_attempt,
            } => {
                write!(f, "schedule_retry(attempt {attempts}, next at {next_attempt})")
            }
            other => f.write_str(other.kind().as_str()),
        }
    }
}

impl Planned {
    /// The table's effect this carries out.
    pub fn kind(&self) -> EffectKind {
        match self {
            Planned::AddFinalizer => EffectKind::AddFinalizer,
            Planned::CreateInstance => EffectKind::CreateInstance,
            Planned::DeleteInstance => EffectKind::DeleteInstance,
            Planned::EnableLeases => EffectKind::EnableLeases,
            Planned::DisableLeases => EffectKind::DisableLeases,
            Planned::DrainLeases => EffectKind::DrainLeases,
            Planned::RevokeLeases => EffectKind::RevokeLeases,
            Planned::SetConditions(_) => EffectKind::SetConditions,
            Planned::ReportSpec(_) => EffectKind::ReportSpec,
            Planned::RecordEvent { .. } => EffectKind::RecordEvent,
            Planned::ScheduleRetry { .. } => EffectKind::ScheduleRetry,
            Planned::ClearRetry => EffectKind::ClearRetry,
            Planned::UpdateCredentials => EffectKind::UpdateCredentials,
            Planned::RemoveFinalizer => EffectKind::RemoveFinalizer,
        }
    }
}

/// A decided transition and its planned effects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Phase before.
    pub from: Phase,
    /// The event.
    pub event: Event,
    /// Phase after.
    pub to: Phase,
    /// The row's reason.
    pub reason: &'static str,
    /// What caused the event, if more than its name says.
    pub cause: Option<String>,
    /// The effects, in the row's order.
    pub effects: Vec<Planned>,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} --{}--> {} ({})",
            self.from, self.event, self.to, self.reason
        )?;
        for effect in &self.effects {
            write!(f, "\n  {effect}")?;
        }
        Ok(())
    }
}

/// What planning needs besides the decision.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The time of the decision.
    pub now: Timestamp,
    /// The record before the transition (for the failure count).
    pub record: &'a Record,
    /// Retry backoff.
    pub backoff: &'a Backoff,
    /// A number in [0, 1) that draws the backoff's jitter.
    pub jitter: f64,
}

/// The plan of `decision` (which must have matched a row), caused by `cause`.
pub fn plan(decision: &Decision, cause: Option<&str>, input: PlanInput<'_>) -> Plan {
    let reason = decision.reason();
    let message = cause.map_or_else(|| decision.event.doc().to_owned(), str::to_owned);
    let effects = decision
        .effects
        .iter()
        .map(|kind| match kind {
            EffectKind::AddFinalizer => Planned::AddFinalizer,
            EffectKind::CreateInstance => Planned::CreateInstance,
            EffectKind::DeleteInstance => Planned::DeleteInstance,
            EffectKind::EnableLeases => Planned::EnableLeases,
            EffectKind::DisableLeases => Planned::DisableLeases,
            EffectKind::DrainLeases => Planned::DrainLeases,
            EffectKind::RevokeLeases => Planned::RevokeLeases,
            EffectKind::SetConditions => Planned::SetConditions(Conditions {
                reason,
                message: message.clone(),
                provisioned: decision.event == Event::InstanceRunning,
            }),
            // The table runs it on spec_invalid and spec_fixed only (the build checks it).
            EffectKind::ReportSpec => Planned::ReportSpec(if decision.event == Event::SpecFixed {
                SpecReport::Valid
            } else {
                SpecReport::Invalid(message.clone())
            }),
            EffectKind::RecordEvent => Planned::RecordEvent {
                reason,
                message: message.clone(),
            },
            EffectKind::ScheduleRetry => {
                let attempts = input.record.retry_attempts.saturating_add(1);
                // A rejected request cannot succeed soon: wait the longest delay at once.
                let delay = if decision.event == Event::CreateRejected {
                    input.backoff.cap
                } else {
                    input.backoff.delay(attempts, input.jitter)
                };
                Planned::ScheduleRetry {
                    attempts,
                    next_attempt: add(input.now, delay),
                }
            }
            EffectKind::ClearRetry => Planned::ClearRetry,
            EffectKind::UpdateCredentials => Planned::UpdateCredentials,
            EffectKind::RemoveFinalizer => Planned::RemoveFinalizer,
        })
        .collect();
    Plan {
        from: decision.from.phase(),
        event: decision.event,
        to: decision.to.phase(),
        reason,
        cause: cause.map(str::to_owned),
        effects,
    }
}

fn add(now: Timestamp, delay: std::time::Duration) -> Timestamp {
    let delay = jiff::SignedDuration::try_from(delay).unwrap_or(jiff::SignedDuration::MAX);
    now.checked_add(delay).unwrap_or(Timestamp::MAX)
}

/// When the reconciler looks at a Proxy again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Wake {
    /// After this long (`None`: only a change wakes it).
    pub after: Option<std::time::Duration>,
    /// Nothing but the periodic resync is due: a mode may cover it with one sweep over all
    /// Proxies (cluster mode does) instead of a timer per Proxy.
    pub resync_only: bool,
}

impl Wake {
    /// After `after`, for a reason other than the resync.
    pub fn after(after: std::time::Duration) -> Wake {
        Wake {
            after: Some(after),
            resync_only: false,
        }
    }
}

/// When the reconciler should look at this Proxy again, after a reconcile that ended in `record`:
/// the earliest of its state's timer, its retry, the poll of a state that waits for the world,
/// and the resync.
pub fn next_wake(record: &Record, now: Timestamp, timers: &crate::machine::Timers, spec_valid: bool) -> Wake {
    let phase = record.state.phase();
    let retry = record.next_attempt.map(|at| policy::until(at, now));
    let timer = timers.remaining(&record.state, now);
    let poll = match phase {
        Phase::Deleted => return Wake::default(),
        // A user error: the fix (a spec or Secret change) wakes us; nothing else can help.
        Phase::Pending if !spec_valid && retry.is_none() => return Wake::default(),
        // Waiting for the world (a boot, a drain, a delete): look again every poll.
        Phase::Provisioning | Phase::Replacing | Phase::Deleting => Some(timers.poll),
        Phase::Pending | Phase::Healthy | Phase::Degraded => None,
    };
    match [poll, timer, retry].into_iter().flatten().min() {
        Some(due) => Wake::after(due.min(timers.resync)),
        None => Wake {
            after: Some(timers.resync),
            resync_only: true,
        },
    }
}
