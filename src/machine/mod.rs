//! The lifecycle engine: the Proxy transition table as a typed, pure state machine.
//!
//! **decide** step of the pipeline (no client required, no clock, no I/O): given the current
//! [`State`] (rehydrated from the Proxy status), one [`Event`] derived from the controller's
//! observation, the [`Facts`] and the time, [`decide`] returns a [`Decision`]: the next state,
//! the effects for the executors, and the table row's reason. Everything comes from
//! `machines/proxy.yaml`: build.rs generates the statig machine from it, so the running code can take
//! no transition the table lacks (see [`table`]).
//!
//! [`decide`] drives statig the way its docs describe: the state read from the Proxy status goes
//! into an uninitialized machine (`state_mut`), `init_with_context` enters it, and
//! `handle_with_context` dispatches the event. Initialising runs the entry actions into the
//! current state, so the machine has none (nor exit actions): every effect belongs to a transition
//! row, and rehydrating after a restart cannot repeat one. docs/architecture.md ("The generated
//! engine") says why the machine is flat and what each handler outcome means.
//!
//! Submodules: [`table`] (generated types and metadata), [`mod@derive`] (facts → event),
//! [`effects`] (the effect kinds), [`policy`] (timers and retry backoff), [`audit`] (audit trail),
//! [`docs`] (docs/machines.md). Scenario replays run the whole reconciler: see
//! [`crate::controller::simulate`].

pub mod audit;
pub mod derive;
pub mod docs;
pub mod effects;
pub mod policy;
pub mod table;

use jiff::Timestamp;
use serde::Serialize;

pub use audit::{Audit, AuditEntry};
pub use derive::derive;
pub use effects::EffectKind;
pub use policy::{Backoff, Timers};
pub use table::{
    Coverage, Event, Fact, Facts, Literal, Phase, Row, State, StateRecord, TimerKind, coverage, reason,
};

/// Whether a handled event changed anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A transition row matched (possibly a self-transition): apply `to` and the effects.
    Transitioned,
    /// The state ignores this event: nothing to do, nothing to audit.
    Ignored,
}

/// What the engine decided for one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The state before the event.
    pub from: State,
    /// The event.
    pub event: Event,
    /// The state after the event (equal to `from` when ignored).
    pub to: State,
    /// Effects to carry out, in order (empty when ignored).
    pub effects: Vec<EffectKind>,
    /// The matched row (`None` when ignored): its reason, guard and note.
    pub row: Option<&'static Row>,
    /// Transitioned or ignored.
    pub outcome: Outcome,
}

impl Decision {
    /// The row's bounded CamelCase reason, or `Ignored`.
    pub fn reason(&self) -> &'static str {
        self.row.map_or("Ignored", |r| r.reason)
    }

    /// The guard literals that selected the row (empty for an unguarded row or when ignored).
    pub fn guard(&self) -> &'static [Literal] {
        self.row.map_or(&[], |r| r.guard)
    }
}

/// The event is invalid in the state: the table says it cannot happen there (an executor raised an
/// event no row into the state can raise).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("event `{event}` is invalid in state `{}`", state.phase())]
pub struct InvalidTransition {
    /// The (unchanged) state.
    pub state: State,
    /// The rejected event.
    pub event: Event,
}

/// Decide what `event` does in `state`: the engine's only entry point. Pure.
///
/// `now` becomes the `since` of a new state; `facts` feed the guards. An ignored event returns a
/// [`Decision`] with [`Outcome::Ignored`], no effects and `to == from`; an invalid one returns
/// [`InvalidTransition`] and the caller keeps its state.
pub fn decide(
    state: &State,
    event: Event,
    facts: Facts,
    now: Timestamp,
) -> Result<Decision, InvalidTransition> {
    use statig::blocking::IntoStateMachineExt as _;

    let mut ctx = table::DecideCtx::new(now, facts);
    let mut machine = table::ProxyMachine.uninitialized_state_machine();
    *machine.state_mut() = state.clone();
    let mut machine = machine.init_with_context(&mut ctx);
    machine.handle_with_context(&event, &mut ctx);
    // The handler recorded what it did: a row, an ignored event, or nothing (the table's `invalid`
    // events return `Super`, and with no superstate statig leaves them unhandled).
    if let Some(row) = ctx.matched_row() {
        Ok(Decision {
            from: state.clone(),
            event,
            to: machine.state().clone(),
            effects: row.effects.to_vec(),
            row: Some(row),
            outcome: Outcome::Transitioned,
        })
    } else if ctx.was_ignored() {
        Ok(Decision {
            from: state.clone(),
            event,
            to: state.clone(),
            effects: Vec::new(),
            row: None,
            outcome: Outcome::Ignored,
        })
    } else {
        Err(InvalidTransition {
            state: state.clone(),
            event,
        })
    }
}

/// `secs` seconds after a fixed instant in 2025: the clock of the unit tests.
#[cfg(test)]
pub(crate) fn test_time(secs: i64) -> Timestamp {
    Timestamp::from_second(1_750_000_000 + secs).expect("the test clock stays in range")
}

#[cfg(test)]
mod tests {
    use statig::blocking::State as _;

    use super::*;

    /// Rehydration cannot repeat effects: the generated machine has no entry or exit actions, so
    /// even statig's own action hooks do nothing on any state.
    #[test]
    fn no_entry_or_exit_actions() {
        for phase in Phase::ALL {
            let mut state = State::new(phase, jiff::Timestamp::UNIX_EPOCH);
            let before = state.clone();
            let mut ctx = table::DecideCtx::new(jiff::Timestamp::UNIX_EPOCH, Facts::NONE);
            state.call_entry_action(&mut table::ProxyMachine, &mut ctx);
            state.call_exit_action(&mut table::ProxyMachine, &mut ctx);
            assert_eq!(state, before);
            assert!(ctx.matched_row().is_none());
        }
    }
}
