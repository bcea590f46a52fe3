//! Properties of the table and of `derive`, checked exhaustively: there are few enough facts that
//! every combination is tried instead of sampling.
//!
//! - derive, over every fact combination in every state, yields only events the state has rows
//!   for (never an ignored or invalid one);
//! - every transition row is reachable: by a fact combination (derive picks its event, its guard
//!   holds and no earlier row's does) or, for an event only executors raise, after a row into its
//!   state that runs a raising effect; the test lists every row that is not;
//! - from every state, deletion ends in `deleted` with the finalizer removed once where one was set
//!   (replayed through the real reconciler against the scenario world);
//! - no state other than the final one is a dead end, and every state is reachable;
//! - decide is deterministic and pure.

use std::collections::BTreeSet;

use egress_proxies_operator::controller::simulate::Scenario;
use egress_proxies_operator::machine::table::{EVENTS, ROWS, event_info};
use egress_proxies_operator::machine::{
    Coverage, EffectKind, Event, Fact, Facts, Outcome, Phase, State, coverage, decide, derive,
};

const EPOCH: jiff::Timestamp = jiff::Timestamp::constant(1_735_689_600, 0);

fn all_facts() -> impl Iterator<Item = Facts> {
    (0..1u32 << Fact::ALL.len()).map(Facts::from_bits)
}

#[test]
fn derive_yields_only_events_the_state_has_rows_for() {
    for phase in Phase::ALL {
        for facts in all_facts() {
            if let Some(event) = derive(phase, facts) {
                assert!(
                    matches!(coverage(phase, event), Coverage::Rows(_)),
                    "derive raised {event} in {phase} with {facts:?}, which the table marks {:?}",
                    coverage(phase, event)
                );
                assert!(facts.all(event_info(event).when), "{event}: its facts hold");
            }
        }
    }
}

/// Every event derive can raise in a state comes before (in priority) every other raised event
/// the state handles: it is the first handled one.
#[test]
fn derive_picks_the_first_handled_event_in_priority_order() {
    for phase in [Phase::Healthy, Phase::Provisioning, Phase::Replacing] {
        for facts in all_facts().step_by(97) {
            let handled: Vec<Event> = EVENTS
                .iter()
                .filter(|e| !e.when.is_empty() && facts.all(e.when))
                .map(|e| e.event)
                .filter(|e| matches!(coverage(phase, *e), Coverage::Rows(_)))
                .collect();
            assert_eq!(
                derive(phase, facts),
                handled.first().copied(),
                "{phase} {facts:?}"
            );
        }
    }
}

#[test]
fn every_transition_row_is_reachable() {
    let mut unreachable = Vec::new();
    for row in &ROWS {
        let earlier: Vec<_> = ROWS
            .iter()
            .filter(|r| r.from == row.from && r.on == row.on && r.index < row.index)
            .collect();
        let guard_ok = |facts: Facts| facts.all(row.guard) && earlier.iter().all(|r| !facts.all(r.guard));
        let info = event_info(row.on);
        let by_facts = !info.when.is_empty()
            && all_facts().any(|facts| derive(row.from, facts) == Some(row.on) && guard_ok(facts));
        let by_effect = ROWS
            .iter()
            .any(|into| into.to == row.from && into.effects.iter().any(|e| info.raised_by.contains(e)))
            && all_facts().step_by(7).any(guard_ok);
        if !by_facts && !by_effect {
            unreachable.push(format!("#{} {} --{}--> {}", row.index, row.from, row.on, row.to));
        }
    }
    assert!(
        unreachable.is_empty(),
        "rows no fact combination or effect reaches:\n{}",
        unreachable.join("\n")
    );
}

#[tokio::test]
async fn deletion_ends_in_deleted_from_every_state() {
    for phase in Phase::ALL.into_iter().filter(|p| !p.is_final()) {
        for leases in [0, 2] {
            let yaml = format!(
                "name: delete-from-{phase}\nstart: {{phase: {phase}, leases: {leases}}}\nsteps:\n  \
                 - {{at: 10, world: {{deleted: true}}}}\n  - {{at: 20, world: {{leases: 0}}}}\n  - {{at: 30}}\n"
            );
            let scenario = Scenario::from_yaml(&yaml, std::path::Path::new("generated")).expect("valid");
            let replay = scenario.replay().await.expect("replays");
            let label = format!("from {phase} with {leases} lease(s):\n{}", replay.render());
            assert_eq!(replay.end(), Phase::Deleted, "{label}");
            let effects: Vec<EffectKind> = replay.audit().flat_map(|e| e.effects.clone()).collect();
            let removes = effects
                .iter()
                .filter(|e| **e == EffectKind::RemoveFinalizer)
                .count();
            // A pending Proxy has no finalizer yet (none is added before a provider call): the
            // API server removes it at once.
            let finalizer_held = phase != Phase::Pending;
            assert_eq!(removes, usize::from(finalizer_held), "{label}");
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
}

#[test]
fn no_dead_end_except_the_final_state() {
    for phase in Phase::ALL {
        let exits: Vec<_> = ROWS.iter().filter(|r| r.from == phase && r.to != phase).collect();
        if phase.is_final() {
            assert!(exits.is_empty(), "{phase} is final");
            for event in Event::ALL {
                if let Ok(d) = decide(&State::new(phase, EPOCH), event, Facts::NONE, EPOCH) {
                    assert_eq!(d.outcome, Outcome::Ignored, "{phase} ignores {event}");
                }
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

/// Deciding is pure: the same inputs give the same decision, and the input state is untouched.
#[test]
fn decide_is_deterministic() {
    for phase in Phase::ALL {
        let state = State::new(phase, EPOCH);
        for event in Event::ALL {
            for facts in all_facts().step_by(4099) {
                let a = decide(&state, event, facts, EPOCH);
                let b = decide(&state, event, facts, EPOCH);
                assert_eq!(a, b);
                assert_eq!(state, State::new(phase, EPOCH));
            }
        }
    }
}
