//! **plan** (no client required): a decided transition's effects, in the row's order, with the
//! parameters the executors need — a value tests print and assert before anything runs.

use std::fmt;

use jiff::Timestamp;

use super::status::Record;
use crate::machine::{Backoff, Decision, EffectKind, Event, Phase, TimerKind, policy};

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
    /// `schedule_check`: look again at `next_check` without counting a failure.
    ScheduleCheck {
        /// Not before this.
        next_check: Timestamp,
    },
    /// `clear_retry`.
    ClearRetry,
    /// `update_credentials`.
    UpdateCredentials,
    /// `remove_finalizer`.
    RemoveFinalizer,
    /// `note_recycle`.
    NoteRecycle,
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
            Planned::ScheduleCheck { next_check } => write!(f, "schedule_check(next at {next_check})"),
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
            Planned::ScheduleCheck { .. } => EffectKind::ScheduleCheck,
            Planned::ClearRetry => EffectKind::ClearRetry,
            Planned::UpdateCredentials => EffectKind::UpdateCredentials,
            Planned::RemoveFinalizer => EffectKind::RemoveFinalizer,
            Planned::NoteRecycle => EffectKind::NoteRecycle,
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
            // The first backoff step, undrawn: a check is no failure, so it neither counts nor
            // grows.
            EffectKind::ScheduleCheck => Planned::ScheduleCheck {
                next_check: add(input.now, input.backoff.nominal(1)),
            },
            EffectKind::ClearRetry => Planned::ClearRetry,
            EffectKind::UpdateCredentials => Planned::UpdateCredentials,
            EffectKind::RemoveFinalizer => Planned::RemoveFinalizer,
            EffectKind::NoteRecycle => Planned::NoteRecycle,
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

/// The soonest a reconcile that settled asks to look again: a due time closer than this (a
/// retry a few hundred milliseconds ahead) is rounded up to it, so no rounding or clock skew can
/// turn a wake-up into a loop. A configuration whose poll is shorter (tests scale every
/// duration down) uses its poll instead: see [`floor`].
pub const MIN_WAKE: std::time::Duration = std::time::Duration::from_secs(1);

/// The floor of every wake-up under `timers`: [`MIN_WAKE`], or the poll if that is shorter.
pub fn floor(timers: &crate::machine::Timers) -> std::time::Duration {
    MIN_WAKE.min(timers.poll)
}

/// Why the reconciler looks at a Proxy again when it does: what each waiting state waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeWhy {
    /// Deleted: nothing is left to do.
    Deleted,
    /// The spec cannot be realised: only the user's fix (a spec or Secret change) wakes it.
    InvalidSpec,
    /// The reconcile ran out of rounds while every round changed the world: again soon.
    Unsettled,
    /// The provider is down: its availability flip wakes it, and it checks again at `at`.
    ProviderDown {
        /// The next check.
        at: Timestamp,
    },
    /// A failed provider call is retried at `at`.
    Retry {
        /// The next attempt.
        at: Timestamp,
    },
    /// The state's timer runs out at `at`.
    Timer {
        /// The timer.
        timer: TimerKind,
        /// When it runs out.
        at: Timestamp,
    },
    /// A state that waits for the world (a boot, a drain, a delete) polls it.
    Poll {
        /// The state.
        phase: Phase,
        /// How often.
        every: std::time::Duration,
    },
    /// A replacement the pool's budget holds back is looked at again on every poll.
    BudgetHeld {
        /// How often.
        every: std::time::Duration,
    },
    /// At rest: only a change or the periodic resync wakes it.
    Resync {
        /// How often.
        every: std::time::Duration,
    },
}

impl WakeWhy {
    /// The reason as text, with `time` rendering an instant (an offset in a scenario trail,
    /// RFC 3339 in logs).
    pub fn describe(&self, time: impl Fn(Timestamp) -> String) -> String {
        let secs = |d: &std::time::Duration| format!("{} s", d.as_secs());
        match self {
            WakeWhy::Deleted => "deleted: nothing left to do".to_owned(),
            WakeWhy::InvalidSpec => "invalid spec: waits for a change".to_owned(),
            WakeWhy::Unsettled => "the reconcile ran out of rounds: again after the floor".to_owned(),
            WakeWhy::ProviderDown { at } => format!("provider down: next check at {}", time(*at)),
            WakeWhy::Retry { at } => format!("next attempt at {}", time(*at)),
            WakeWhy::Timer { timer, at } => format!("{} runs out at {}", timer.as_str(), time(*at)),
            WakeWhy::Poll { phase, every } => match phase {
                Phase::Provisioning => format!("booting: polls every {}", secs(every)),
                _ => format!("{phase}: polls the drain and the delete every {}", secs(every)),
            },
            WakeWhy::BudgetHeld { every } => {
                format!(
                    "replacement held by the pool's budget: polls every {}",
                    secs(every)
                )
            }
            WakeWhy::Resync { every } => format!("at rest: resync every {}", secs(every)),
        }
    }
}

impl fmt::Display for WakeWhy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(|at| at.to_string()))
    }
}

/// When the reconciler looks at a Proxy again, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wake {
    /// After this long (`None`: only a change wakes it).
    pub after: Option<std::time::Duration>,
    /// Nothing but the periodic resync is due: a mode may cover it with one sweep over all
    /// Proxies (cluster mode does) instead of a timer per Proxy.
    pub resync_only: bool,
    /// What it waits for.
    pub why: WakeWhy,
}

impl Wake {
    /// After `after` (never sooner than `floor`), for a reason other than the resync.
    pub fn after(after: std::time::Duration, floor: std::time::Duration, why: WakeWhy) -> Wake {
        Wake {
            after: Some(after.max(floor)),
            resync_only: false,
            why,
        }
    }

    /// Again after the floor: a reconcile that ran out of rounds (every round changed the
    /// world). It could ask for 0 s, but a table or executor bug that keeps raising events would
    /// then spin; at the floor it costs one reconcile a second and shows in the trail.
    pub fn unsettled(floor: std::time::Duration) -> Wake {
        Wake {
            after: Some(floor),
            resync_only: false,
            why: WakeWhy::Unsettled,
        }
    }

    /// Only a change wakes it.
    pub fn on_change(why: WakeWhy) -> Wake {
        Wake {
            after: None,
            resync_only: false,
            why,
        }
    }
}

/// When the reconciler should look at this Proxy again, after a reconcile that derived no more
/// events and ended in `record`: the earliest of its state's timer, its retry, and the poll of a
/// state that waits for the world, capped by the resync.
///
/// Only what lies ahead counts: a retry time or a timer that has passed is not a reason to look
/// again now. The reconcile just ran with it due and derived nothing (the attempt ran, or waits
/// for something else, such as the provider coming back), so looking again at once would find
/// the same facts: that is how a past `nextAttemptTime` once requeued at 0 s over and over.
/// Nothing is ever sooner than the [`floor`].
pub fn next_wake(record: &Record, now: Timestamp, timers: &crate::machine::Timers, spec_valid: bool) -> Wake {
    let phase = record.state.phase();
    let at = |after: std::time::Duration| add(now, after);
    let retry = record
        .next_attempt
        .filter(|at| *at > now)
        .map(|at| (policy::until(at, now), WakeWhy::Retry { at }));
    let timer = phase.timer().and_then(|timer| {
        let left = timers.remaining(&record.state, now)?;
        (!left.is_zero()).then(|| (left, WakeWhy::Timer { timer, at: at(left) }))
    });
    let provider_down = record.ready_reason == crate::machine::reason::PROVIDER_UNAVAILABLE;
    let poll = match phase {
        Phase::Deleted => return Wake::on_change(WakeWhy::Deleted),
        // A user error: the fix (a spec or Secret change) wakes us; nothing else can help, not
        // even a retry coming due (provisioning needs a valid spec).
        Phase::Pending if !spec_valid => return Wake::on_change(WakeWhy::InvalidSpec),
        // The availability flip wakes it; the poll is the safety net.
        Phase::Pending | Phase::Provisioning | Phase::Replacing | Phase::Deleting if provider_down => {
            Some((timers.poll, WakeWhy::ProviderDown { at: at(timers.poll) }))
        }
        // Waiting for the world (a boot, a drain, a delete): look again every poll.
        Phase::Provisioning | Phase::Replacing | Phase::Deleting => Some((
            timers.poll,
            WakeWhy::Poll {
                phase,
                every: timers.poll,
            },
        )),
        Phase::Pending | Phase::Healthy | Phase::Degraded => None,
    };
    match [retry, timer, poll]
        .into_iter()
        .flatten()
        .min_by_key(|(after, _)| *after)
    {
        Some((after, why)) if after < timers.resync => Wake::after(after, floor(timers), why),
        _ => Wake {
            after: Some(timers.resync),
            resync_only: true,
            why: WakeWhy::Resync { every: timers.resync },
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::machine::{State, Timers, reason, test_time as t};

    fn record(phase: Phase, since: i64) -> Record {
        let mut record = Record::new(t(0));
        record.state = State::new(phase, t(since));
        record
    }

    fn secs(after: Option<Duration>) -> Option<u64> {
        after.map(|d| d.as_secs())
    }

    /// Issue 24: a retry time that has passed (its attempt ran) is no reason to look again at
    /// once; only what lies ahead is, and nothing is sooner than the floor.
    #[test]
    fn a_past_retry_time_never_wakes_at_once() {
        let timers = Timers::default();
        for phase in [
            Phase::Pending,
            Phase::Provisioning,
            Phase::Replacing,
            Phase::Deleting,
        ] {
            let mut booting = record(phase, 0);
            booting.retry_attempts = 2;
            booting.next_attempt = Some(t(30));
            let wake = next_wake(&booting, t(31), &timers, true);
            let after = wake.after.expect("a timed wake-up");
            assert!(after >= timers.poll.min(timers.resync), "{phase}: {wake:?}");
            assert!(!matches!(wake.why, WakeWhy::Retry { .. }), "{phase}: {wake:?}");
        }
    }

    #[test]
    fn each_waiting_state_says_what_it_waits_for() {
        let timers = Timers::default();
        // A retry ahead: its time.
        let mut failed = record(Phase::Pending, 0);
        failed.next_attempt = Some(t(40));
        let wake = next_wake(&failed, t(30), &timers, true);
        assert_eq!(
            (secs(wake.after), wake.why),
            (Some(10), WakeWhy::Retry { at: t(40) })
        );
        // A retry a fraction of a second ahead: the floor.
        let soon = next_wake(
            &failed,
            t(40) - jiff::SignedDuration::from_millis(200),
            &timers,
            true,
        );
        assert_eq!(soon.after, Some(MIN_WAKE));
        // An invalid spec: only a change, even with a retry scheduled.
        let wake = next_wake(&failed, t(30), &timers, false);
        assert_eq!((wake.after, wake.why), (None, WakeWhy::InvalidSpec));
        // The provider is down: the poll.
        let mut down = record(Phase::Pending, 0);
        down.ready_reason = reason::PROVIDER_UNAVAILABLE.to_owned();
        let wake = next_wake(&down, t(30), &timers, true);
        assert_eq!(
            (secs(wake.after), wake.why),
            (Some(10), WakeWhy::ProviderDown { at: t(40) })
        );
        // Booting: the poll; its timer when nearer.
        let wake = next_wake(&record(Phase::Provisioning, 0), t(30), &timers, true);
        assert_eq!(
            wake.why,
            WakeWhy::Poll {
                phase: Phase::Provisioning,
                every: timers.poll
            }
        );
        let wake = next_wake(&record(Phase::Provisioning, 0), t(595), &timers, true);
        assert_eq!(secs(wake.after), Some(5));
        assert!(matches!(wake.why, WakeWhy::Timer { .. }), "{wake:?}");
        // At rest: the resync only.
        let wake = next_wake(&record(Phase::Healthy, 0), t(30), &timers, true);
        assert!(wake.resync_only, "{wake:?}");
        // Deleted: nothing.
        assert_eq!(
            next_wake(&record(Phase::Deleted, 0), t(30), &timers, true).after,
            None
        );
    }

    /// Whatever the record and the clock, a wake-up is at least the floor; only a reconcile that
    /// did not settle asks for 0 s.
    #[test]
    fn no_wake_up_is_sooner_than_the_floor() {
        let timers = Timers::default();
        for phase in Phase::ALL {
            for since in [0, 299, 300, 599, 600, 899, 900] {
                for next in [None, Some(0), Some(599), Some(600), Some(601)] {
                    for ready in [reason::PROVIDER_UNAVAILABLE, reason::HEALTHY] {
                        let mut r = record(phase, since);
                        r.next_attempt = next.map(t);
                        r.ready_reason = ready.to_owned();
                        for valid in [true, false] {
                            let wake = next_wake(&r, t(600), &timers, valid);
                            if let Some(after) = wake.after {
                                assert!(after >= MIN_WAKE, "{phase} {since} {next:?}: {wake:?}");
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(
            Wake::after(Duration::ZERO, floor(&timers), WakeWhy::Unsettled).after,
            Some(MIN_WAKE)
        );
    }
}
