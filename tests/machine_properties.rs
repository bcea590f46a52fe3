//! Properties of the table, checked exhaustively: the state space is finite, so every state with
//! every guard-relevant input is tried instead of sampling randomly.
//!
//! - from every state, deletion is reachable and ends in `deleted` with the instance gone and the
//!   finalizer removed;
//! - no state other than the final one is a dead end, and every state is reachable;
//! - replaying an event right after the transition it caused is harmless: it is ignored or a
//!   self-transition, and never asks for a second create without evidence that the instance is gone.

use std::collections::BTreeSet;

use egress_proxies_operator::machine::scenario::EPOCH;
use egress_proxies_operator::machine::table::ROWS;
use egress_proxies_operator::machine::{
    Decision, EffectKind, Event, GuardInput, Outcome, Phase, State, decide,
};

const MAX: u32 = GuardInput::DEFAULT_MAX_CREATE_ATTEMPTS;

/// Every state (each attempts count up to the limit) with every lease situation.
fn all_situations() -> Vec<(State, GuardInput)> {
    let mut out = Vec::new();
    for phase in Phase::ALL {
        let attempt_counts: Vec<u32> = if phase.data_fields().contains(&"attempts") {
            (0..=MAX).collect()
        } else {
            vec![0]
        };
        for attempts in attempt_counts {
            for active_leases in [0, 1, 5] {
                out.push((
                    State::from_parts(phase, EPOCH, attempts),
                    GuardInput {
                        max_create_attempts: MAX,
                        active_leases,
                    },
                ));
            }
        }
    }
    out
}

fn at(secs: i64) -> jiff::Timestamp {
    EPOCH + jiff::SignedDuration::from_secs(secs)
}

fn step(state: &State, event: Event, input: &GuardInput, secs: i64) -> Decision {
    decide(state, event, input, at(secs)).unwrap_or_else(|e| panic!("deletion path hit {e}"))
}

#[test]
fn deletion_is_reachable_from_every_state_and_ends_with_the_instance_gone() {
    for (start, mut input) in all_situations() {
        let label = format!("{start:?} with {input:?}");
        let mut effects: Vec<EffectKind> = Vec::new();
        let mut state = start.clone();

        let d = step(&state, Event::DeletionRequested, &input, 1);
        effects.extend(&d.effects);
        state = d.to;

        // Drive the world the way the executors would: a drain completes once asked for, a
        // delete makes the instance gone. Bounded: a loop here is a bug in the table.
        for t in 2..10 {
            if state.phase().is_final() {
                break;
            }
            let event = if effects.last_drain_pending() {
                input.active_leases = 0;
                Event::DrainComplete
            } else {
                Event::InstanceGone
            };
            let d = step(&state, event, &input, t);
            assert_eq!(
                d.outcome,
                Outcome::Transitioned,
                "{label}: {event} stalls in {}",
                state.phase()
            );
            effects.extend(&d.effects);
            state = d.to;
        }

        assert_eq!(
            state.phase(),
            Phase::Deleted,
            "{label}: deletion must end in deleted"
        );
        if start.phase() == Phase::Deleted {
            assert!(effects.is_empty(), "{label}: nothing left to do");
            continue;
        }
        let remove_count = effects
            .iter()
            .filter(|e| **e == EffectKind::RemoveFinalizer)
            .count();
        assert_eq!(
            remove_count, 1,
            "{label}: the finalizer is removed once: {effects:?}"
        );
        if start.phase() == Phase::Deleting {
            // The delete (or the drain before it) was asked for on entering `deleting`; the path
            // ends on the provider's NotFound, i.e. with the instance gone.
            continue;
        }
        let delete = effects.iter().position(|e| *e == EffectKind::DeleteInstance);
        let remove = effects.iter().position(|e| *e == EffectKind::RemoveFinalizer);
        assert!(delete.is_some(), "{label}: the instance is deleted: {effects:?}");
        assert!(delete < remove, "{label}: the finalizer goes last: {effects:?}");
        let revoke = effects.iter().rposition(|e| *e == EffectKind::RevokeLeases);
        assert!(
            revoke.is_some(),
            "{label}: no lease survives deletion: {effects:?}"
        );
        assert!(
            !effects.contains(&EffectKind::CreateInstance),
            "{label}: deletion never creates"
        );
        assert!(
            !effects.contains(&EffectKind::EnableLeases),
            "{label}: deletion never enables leases"
        );
    }
}

/// A drain was requested and no delete followed it yet.
trait DrainPending {
    fn last_drain_pending(&self) -> bool;
}

impl DrainPending for Vec<EffectKind> {
    fn last_drain_pending(&self) -> bool {
        let drain = self.iter().rposition(|e| *e == EffectKind::DrainLeases);
        let delete = self.iter().rposition(|e| *e == EffectKind::DeleteInstance);
        drain.is_some() && delete < drain
    }
}

#[test]
fn no_dead_end_except_the_final_state() {
    for phase in Phase::ALL {
        let exits: Vec<_> = ROWS.iter().filter(|r| r.from == phase && r.to != phase).collect();
        if phase.is_final() {
            assert!(exits.is_empty(), "{phase} is final");
            for event in Event::ALL {
                let d = decide(
                    &State::from_parts(phase, EPOCH, 0),
                    event,
                    &GuardInput::default(),
                    at(1),
                )
                .expect("the final state accepts every event");
                assert_eq!(d.outcome, Outcome::Ignored, "{phase} ignores {event}");
            }
        } else {
            assert!(!exits.is_empty(), "{phase} is a dead end");
        }
    }
    assert_eq!(Phase::ALL.iter().filter(|p| p.is_final()).count(), 1);
}

#[test]
fn every_state_is_reachable_from_the_initial_one() {
    let mut seen = BTreeSet::from([Phase::INITIAL]);
    let mut frontier = vec![Phase::INITIAL];
    while let Some(phase) = frontier.pop() {
        for row in ROWS.iter().filter(|r| r.from == phase) {
            if seen.insert(row.to) {
                frontier.push(row.to);
            }
        }
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), Phase::ALL.to_vec());
}

/// Idempotent on replay: the controller is level-triggered, so it may derive the same event again
/// right after acting on it (a retry after a failed status write, a duplicate watch event). The
/// second decision must be ignored or a self-transition whose effects are idempotent; a second
/// `CreateInstance` is only allowed when the event itself says the instance is not there.
#[test]
fn replaying_an_event_after_its_transition_is_harmless() {
    let evidence_of_no_instance = [Event::InstanceMissing, Event::InstanceGone];
    for (state, input) in all_situations() {
        for event in Event::ALL {
            let Ok(first) = decide(&state, event, &input, at(1)) else {
                continue;
            };
            if first.outcome == Outcome::Ignored {
                continue;
            }
            let label = format!("{:?} --{event}--> {:?}", state, first.to);
            let second = decide(&first.to, event, &input, at(2))
                .unwrap_or_else(|e| panic!("{label}: replay is invalid: {e}"));
            if evidence_of_no_instance.contains(&event) {
                // Each repetition is new evidence that the instance is not there: it may ask for
                // another create and count an attempt (attempts_left bounds it).
                continue;
            }
            match second.outcome {
                Outcome::Ignored => {}
                Outcome::Transitioned => {
                    assert_eq!(
                        second.to.phase(),
                        first.to.phase(),
                        "{label}: replay moved the state again"
                    );
                    for effect in &second.effects {
                        assert!(effect.is_idempotent(), "{label}: replay asks for {effect} again");
                    }
                }
            }
            // Replaying more often changes nothing further.
            let third = decide(&second.to, event, &input, at(3)).expect("still valid");
            assert_eq!(third.to.phase(), second.to.phase(), "{label}: third replay");
        }
    }
}

/// Deciding is pure: the same inputs give the same decision, and the input state is untouched.
#[test]
fn decide_is_deterministic() {
    for (state, input) in all_situations() {
        for event in Event::ALL {
            let before = state.clone();
            let a = decide(&state, event, &input, at(7));
            let b = decide(&state, event, &input, at(7));
            assert_eq!(a, b);
            assert_eq!(state, before);
        }
    }
}
