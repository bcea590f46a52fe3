//! The table checked exhaustively (issue 24, item 2): every state × every fact valuation that
//! `observe` can produce (the others are excluded by the rules in [`consistent`], each with the
//! reason it cannot occur), and for each:
//!
//! - **derive is total and deterministic**: the same facts give the same event, the event has
//!   rows in the state, and `decide` picks a row whose guard holds (never `InvalidTransition`);
//! - **no livelock**: following rounds in which no effect changes the world (only the status
//!   record changes: conditions, SpecValid, the retry, the finalizer, the state and its timer)
//!   never returns to a (state, facts) it has seen, and settles within a few rounds;
//! - **every waiting outcome wakes honestly**: where nothing is derived, the wake-up the planner
//!   gives is at least the floor, or waits for a change only where nothing else can help
//!   (deleted; an invalid spec in pending) — with a retry time in the past, the case that once
//!   requeued at 0 s;
//! - **every row is reachable**: by a consistent valuation (derived events), or after a row into
//!   its state that runs an effect raising its event.
//!
//! About 3 million valuations; a failure names the state and the facts.

use std::collections::BTreeSet;

use egress_proxies_operator::controller::{
    plan::{floor, next_wake},
    status::Record,
};
use egress_proxies_operator::machine::table::{EVENTS, ROWS, Row, event_info};
use egress_proxies_operator::machine::{
    Coverage, EffectKind, Event, Fact, Facts, Outcome, Phase, State, Timers, coverage, decide, derive, reason,
};

const NOW: jiff::Timestamp = jiff::Timestamp::constant(1_735_689_600, 0);

/// Whether `observe::facts` can produce `facts` in `phase`.
fn consistent(phase: Phase, facts: Facts) -> bool {
    let f = |fact| facts.get(fact);
    let implies = |a: bool, b: bool| !a || b;
    // One provider answer: present, missing, or neither (not looked up, lookup failed).
    !(f(Fact::InstancePresent) && f(Fact::InstanceMissing))
        // Running is a state of a present instance.
        && implies(f(Fact::InstanceRunning), f(Fact::InstancePresent))
        // Pending and deleted do not look the instance up (`needs_instance`).
        && implies(
            matches!(phase, Phase::Pending | Phase::Deleted),
            !f(Fact::InstancePresent) && !f(Fact::InstanceMissing) && !f(Fact::InstanceRunning),
        )
        // One health verdict.
        && !(f(Fact::HealthPassing) && f(Fact::HealthFailing))
        // Hashes and credentials are compared only against a spec that resolves.
        && implies(f(Fact::SpecChanged), f(Fact::SpecValid))
        && implies(f(Fact::CredentialsChanged), f(Fact::SpecValid))
        // An accepted delete was attempted; only a leaving instance has deletes (the status
        // keeps them as the Provisioned reason of replacing and deleting only).
        && implies(f(Fact::DeleteAccepted), f(Fact::DeleteAttempted))
        && implies(
            f(Fact::DeleteAttempted),
            matches!(phase, Phase::Replacing | Phase::Deleting),
        )
        // Only a state with a timer has one that runs out.
        && implies(f(Fact::TimerExpired), phase.timer().is_some())
}

fn valuations(phase: Phase) -> impl Iterator<Item = Facts> {
    (0..1u32 << Fact::ALL.len())
        .map(Facts::from_bits)
        .filter(move |facts| consistent(phase, *facts))
}

/// The first row of (phase, event) whose guard holds.
fn row_for(phase: Phase, event: Event, facts: Facts) -> Option<&'static Row> {
    ROWS.iter()
        .find(|r| r.from == phase && r.on == event && facts.all(r.guard))
}

/// Effects that change the world (the provider, the leases, the object's existence): after
/// one, the next round observes something new, which is progress.
fn changes_the_world(effect: EffectKind) -> bool {
    match effect {
        EffectKind::CreateInstance
        | EffectKind::DeleteInstance
        | EffectKind::UpdateCredentials
        | EffectKind::EnableLeases
        | EffectKind::DisableLeases
        | EffectKind::DrainLeases
        | EffectKind::RevokeLeases
        | EffectKind::RemoveFinalizer => true,
        // Only the status record or the finalizer change: modelled in `after_round`.
        EffectKind::AddFinalizer
        | EffectKind::SetConditions
        | EffectKind::ReportSpec
        | EffectKind::RecordEvent
        | EffectKind::ScheduleRetry
        | EffectKind::ScheduleCheck
        | EffectKind::ClearRetry
        | EffectKind::NoteRecycle => false,
    }
}

/// The facts of the next round after `row` ran, when none of its effects changed the world:
/// what the record-level effects write, read back as the facts `observe` derives from them.
fn after_round(row: &Row, facts: Facts) -> Facts {
    let mut next = facts;
    for effect in row.effects {
        match effect {
            EffectKind::SetConditions => {
                next.set(
                    Fact::ProviderDownReported,
                    row.reason == reason::PROVIDER_UNAVAILABLE,
                );
                if row.on == Event::InstanceRunning {
                    next.set(Fact::RunningReported, true);
                }
            }
            EffectKind::ReportSpec => next.set(Fact::SpecInvalidReported, row.on == Event::SpecInvalid),
            EffectKind::ScheduleRetry | EffectKind::ScheduleCheck => next.set(Fact::RetryDue, false),
            EffectKind::ClearRetry => next.set(Fact::RetryDue, true),
            EffectKind::AddFinalizer => next.set(Fact::FinalizerPresent, true),
            // The request is recorded as acted on: it asks for nothing more.
            EffectKind::NoteRecycle => next.set(Fact::RecycleRequested, false),
            _ => {}
        }
    }
    // A state entered (or re-entered) now has its whole timer ahead.
    if row.to != row.from || row.reenter {
        next.set(Fact::TimerExpired, false);
    }
    // The instance is looked up only where one is expected.
    if matches!(row.to, Phase::Pending | Phase::Deleted) {
        for fact in [
            Fact::InstancePresent,
            Fact::InstanceMissing,
            Fact::InstanceRunning,
        ] {
            next.set(fact, false);
        }
    }
    if !matches!(row.to, Phase::Replacing | Phase::Deleting) {
        next.set(Fact::DeleteAttempted, false);
        next.set(Fact::DeleteAccepted, false);
    }
    next
}

/// A status record that reads back as `facts` in `phase`; a retry that is due is a time in the
/// past (its attempt ran), one that is not is ahead.
fn record_for(phase: Phase, facts: Facts, timers: &Timers) -> Record {
    let mut record = Record::new(NOW);
    let lasted = match phase.timer() {
        Some(timer) if facts.get(Fact::TimerExpired) => timers.duration(timer).as_secs() + 5,
        _ => 1,
    };
    let since = NOW - jiff::SignedDuration::from_secs(i64::try_from(lasted).unwrap_or(i64::MAX));
    record.state = State::new(phase, since);
    if facts.get(Fact::ProviderDownReported) {
        reason::PROVIDER_UNAVAILABLE.clone_into(&mut record.ready_reason);
    }
    record.retry_attempts = 1;
    record.next_attempt = Some(if facts.get(Fact::RetryDue) {
        NOW - jiff::SignedDuration::from_secs(5)
    } else {
        NOW + jiff::SignedDuration::from_secs(30)
    });
    record
}

#[test]
fn every_state_and_fact_valuation_decides_settles_and_wakes_honestly() {
    let timers = Timers::default();
    let mut reached: BTreeSet<usize> = BTreeSet::new();
    let mut checked = 0usize;
    for phase in Phase::ALL {
        let state = State::new(phase, NOW);
        for facts in valuations(phase) {
            checked += 1;
            let label = || format!("state {phase}, facts {facts:?}");
            // Total and deterministic.
            let event = derive(phase, facts);
            assert_eq!(
                event,
                derive(phase, facts),
                "derive is not deterministic: {}",
                label()
            );
            if let Some(event) = event {
                assert!(
                    matches!(coverage(phase, event), Coverage::Rows(_)),
                    "derive raised {event}, which has no rows: {}",
                    label()
                );
                let decision = decide(&state, event, facts, NOW)
                    .unwrap_or_else(|invalid| panic!("{invalid}: {}", label()));
                assert_eq!(decision.outcome, Outcome::Transitioned, "{event}: {}", label());
                let row = decision.row.expect("a transition has its row");
                assert!(
                    facts.all(row.guard),
                    "row #{} guard fails: {}",
                    row.index,
                    label()
                );
                assert_eq!(Some(row), row_for(phase, event, facts), "{event}: {}", label());
                reached.insert(row.index);
            }
            // No livelock: rounds that change only the record settle without repeating.
            let (mut at, mut now_facts) = (phase, facts);
            let mut seen = vec![(at, now_facts)];
            while let Some(event) = derive(at, now_facts) {
                let row = row_for(at, event, now_facts)
                    .unwrap_or_else(|| panic!("no row for {event} in {at}: from {}", label()));
                if row.effects.iter().any(|e| changes_the_world(*e)) {
                    break;
                }
                (at, now_facts) = (row.to, after_round(row, now_facts));
                assert!(
                    !seen.contains(&(at, now_facts)),
                    "livelock: from {} the rounds {seen:?} return to {at} {now_facts:?} without \
                     time passing or the world changing",
                    label()
                );
                seen.push((at, now_facts));
                // Within one reconcile: the reconciler runs at most 8 rounds (`MAX_ROUNDS`).
                assert!(seen.len() <= 7, "no settling after {seen:?}: from {}", label());
            }
            // Honest wake-ups where nothing more is derived.
            if event.is_none() {
                let spec_valid = facts.get(Fact::SpecValid);
                let wake = next_wake(&record_for(phase, facts, &timers), NOW, &timers, spec_valid);
                match wake.after {
                    Some(after) => assert!(
                        after >= floor(&timers),
                        "wake-up in {after:?} ({}) with nothing due: {}",
                        wake.why,
                        label()
                    ),
                    None => assert!(
                        phase == Phase::Deleted || (phase == Phase::Pending && !spec_valid),
                        "waits for a change ({}) though time can help: {}",
                        wake.why,
                        label()
                    ),
                }
            }
        }
    }
    assert!(checked > 1_000_000, "{checked} valuations");

    // Events executors raise (decided with the facts of the round that ran the effect): after a
    // reached row into their state that runs a raising effect, under a guard some consistent
    // valuation satisfies.
    for row in &ROWS {
        let info = event_info(row.on);
        if info.raised_by.is_empty() || reached.contains(&row.index) {
            continue;
        }
        let raised_after_reached = ROWS.iter().any(|into| {
            reached.contains(&into.index)
                && into.to == row.from
                && into.effects.iter().any(|e| info.raised_by.contains(e))
        });
        let earlier: Vec<&Row> = ROWS
            .iter()
            .filter(|r| r.from == row.from && r.on == row.on && r.index < row.index)
            .collect();
        let guard_satisfiable = valuations(row.from)
            .any(|facts| facts.all(row.guard) && earlier.iter().all(|r| !facts.all(r.guard)));
        if raised_after_reached && guard_satisfiable {
            reached.insert(row.index);
        }
    }
    let unreachable: Vec<String> = ROWS
        .iter()
        .filter(|r| !reached.contains(&r.index))
        .map(|r| format!("#{} {} --{}--> {} ({})", r.index, r.from, r.on, r.to, r.reason))
        .collect();
    assert!(
        unreachable.is_empty(),
        "rows no consistent valuation reaches:\n{}",
        unreachable.join("\n")
    );
    // Every event the table derives is derived somewhere.
    for info in EVENTS.iter().filter(|e| !e.when.is_empty()) {
        assert!(
            ROWS.iter()
                .any(|r| r.on == info.event && reached.contains(&r.index)),
            "{} is never derived",
            info.event
        );
    }
}
