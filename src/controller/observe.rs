//! The **observe** step's pure half: what a snapshot of the world says happened, as events for
//! the machine. Level-triggered: events come from comparing the snapshot with the persisted
//! status and the current state, never from what woke the reconciler.

use jiff::Timestamp;

use crate::{
    machine::{Event, State, Timers, due_timer},
    provider::InstanceState,
};

/// A user error that keeps the Proxy from being realised (the user must change something).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecProblem {
    /// Bounded CamelCase reason (`UnknownProvider`, `CloudInitSecretNotFound`, ...).
    pub reason: &'static str,
    /// What to fix. Never contains secret content.
    pub message: String,
}

/// Whether the Proxy's provider instance can be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderObservation {
    /// Reachable (or not known to be down).
    Available,
    /// Down, with the reason.
    Unavailable(String),
}

/// What the provider says about the Proxy's instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceObservation {
    /// Not looked up (the state doesn't need it, or the spec is invalid).
    NotChecked,
    /// NotFound: it certainly does not exist.
    Missing,
    /// It exists.
    Present(InstanceState),
    /// The lookup failed; nothing can be concluded.
    Unknown,
}

/// The health engine's verdict on the proxy, as far as the lifecycle cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthObservation {
    /// No threshold crossed yet.
    Unknown,
    /// The success threshold is met; `after_failing` if the proxy had failed before.
    Passing {
        /// Whether this follows a failing verdict.
        after_failing: bool,
    },
    /// The failure threshold is crossed.
    Failing,
}

/// Everything the events of one reconcile are derived from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The Proxy has a deletionTimestamp.
    pub deletion_requested: bool,
    /// The spec hash of the current spec, or why it can't be realised.
    pub spec_hash: Result<String, SpecProblem>,
    /// The spec hash the running instance was built from (`status.specHash`).
    pub applied_hash: Option<String>,
    /// The provider's availability.
    pub provider: ProviderObservation,
    /// The instance.
    pub instance: InstanceObservation,
    /// The health verdict.
    pub health: HealthObservation,
    /// Leases currently held on the proxy.
    pub active_leases: u32,
    /// `Ready` condition reason and message as persisted, to report a problem once, not on every
    /// reconcile.
    pub reported: Option<(String, String)>,
    /// When the `Ready` condition last changed (the start of a pending back-off).
    pub reported_since: Option<Timestamp>,
    /// The `Provisioned` condition is already `True`.
    pub provisioned_reported: bool,
    /// `metadata.generation` differs from `status.observedGeneration`.
    pub generation_changed: bool,
}

impl Snapshot {
    fn reported_reason(&self) -> Option<&str> {
        self.reported.as_ref().map(|(reason, _)| reason.as_str())
    }
}

/// The events `snapshot` implies in `state`, most important first. The reconciler applies them in
/// order and stops deriving after the first phase change (the resulting status write wakes it
/// again with a fresh snapshot).
pub fn derive_events(state: &State, snapshot: &Snapshot, now: Timestamp, timers: &Timers) -> Vec<Event> {
    // Deletion wins over everything: nothing else matters for an object that is going away.
    if snapshot.deletion_requested {
        return match state {
            State::Deleted { .. } => Vec::new(),
            State::Deleting { .. } => draining_events(snapshot, Event::InstanceGone),
            _ => vec![Event::DeletionRequested],
        };
    }
    if let Err(problem) = &snapshot.spec_hash {
        let already_reported = snapshot
            .reported
            .as_ref()
            .is_some_and(|(reason, message)| reason == "InvalidSpec" && message == &problem.message);
        return if already_reported || matches!(state, State::Deleting { .. } | State::Deleted { .. }) {
            Vec::new()
        } else {
            vec![Event::SpecInvalid]
        };
    }
    let hash_changed = match (&snapshot.spec_hash, &snapshot.applied_hash) {
        (Ok(current), Some(applied)) => current != applied,
        _ => false,
    };
    let provider_down = matches!(snapshot.provider, ProviderObservation::Unavailable(_));
    let mut events = Vec::new();
    match state {
        State::Pending => {
            if provider_down {
                if snapshot.reported_reason() != Some("ProviderUnavailable") {
                    events.push(Event::ProviderUnavailable);
                }
            } else if snapshot.reported_reason() == Some("ProviderUnavailable") {
                events.push(Event::ProviderAvailable);
            } else if !backing_off(snapshot, now, timers) {
                events.push(Event::SpecObserved);
            }
        }
        State::Provisioning { .. } => {
            if provider_down {
                events.push(Event::ProviderUnavailable);
            }
            if hash_changed {
                events.push(Event::SpecHashChanged);
            }
            match snapshot.instance {
                InstanceObservation::Missing => events.push(Event::InstanceMissing),
                InstanceObservation::Present(InstanceState::Running) if !snapshot.provisioned_reported => {
                    events.push(Event::InstanceRunning)
                }
                _ => {}
            }
            match snapshot.health {
                HealthObservation::Passing { after_failing: false } => events.push(Event::HealthPassed),
                HealthObservation::Passing { after_failing: true } => events.push(Event::HealthRecovered),
                _ => {}
            }
        }
        State::Healthy { .. } => {
            if hash_changed {
                events.push(Event::SpecHashChanged);
            }
            if snapshot.instance == InstanceObservation::Missing {
                events.push(Event::InstanceMissing);
            }
            if snapshot.health == HealthObservation::Failing {
                events.push(Event::HealthFailed);
            }
        }
        State::Degraded { .. } => {
            if hash_changed {
                events.push(Event::SpecHashChanged);
            }
            if snapshot.instance == InstanceObservation::Missing {
                events.push(Event::InstanceMissing);
            }
            if let HealthObservation::Passing { .. } = snapshot.health {
                events.push(Event::HealthRecovered);
            }
        }
        // A Proxy in deleting always has a deletion mark (it cannot be removed), handled above.
        State::Replacing { .. } | State::Deleting { .. } => {
            events.extend(draining_events(snapshot, Event::InstanceGone));
        }
        State::Deleted { .. } => {}
    }
    events.extend(due_timer(state, now, timers));
    events
}

/// While draining towards a delete: the instance is gone, or no lease is left to wait for.
fn draining_events(snapshot: &Snapshot, gone: Event) -> Vec<Event> {
    match snapshot.instance {
        InstanceObservation::Missing => vec![gone],
        InstanceObservation::Present(_) if snapshot.active_leases == 0 => vec![Event::DrainComplete],
        _ => Vec::new(),
    }
}

/// Pending after exhausted create attempts waits `pending_retry` before a new episode, unless
/// the user changed the spec.
fn backing_off(snapshot: &Snapshot, now: Timestamp, timers: &Timers) -> bool {
    if snapshot.generation_changed || snapshot.reported_reason() != Some("CreateAttemptsExhausted") {
        return false;
    }
    let Some(since) = snapshot.reported_since else {
        return false;
    };
    let elapsed = now.duration_since(since);
    elapsed.is_negative() || elapsed.unsigned_abs() < timers.pending_retry
}
