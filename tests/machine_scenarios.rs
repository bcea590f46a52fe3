//! Lifecycle scenarios: every file in machines/scenarios/ replayed through the real reconciler
//! against the scenario world, its audit trail an insta snapshot under snapshots/. The suite also
//! checks each file's `expect`, that every transition row is covered by at least one scenario,
//! and that executors raise only the events the table says they raise.

use std::{collections::BTreeSet, path::PathBuf};

use egress_proxies_operator::controller::simulate::{self, Replay, Scenario};
use egress_proxies_operator::machine::table::{ROWS, event_info};
use egress_proxies_operator::machine::{Event, Phase, reason};

fn scenario_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("machines/scenarios");
    simulate::scenario_files(&dir).expect("machines/scenarios is readable")
}

async fn replay_all() -> Vec<(String, Scenario, Replay)> {
    let mut out = Vec::new();
    for path in scenario_files() {
        let scenario = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let replay = scenario.replay().await.unwrap_or_else(|e| panic!("{e}"));
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 name")
            .to_owned();
        out.push((stem, scenario, replay));
    }
    out
}

#[tokio::test]
async fn every_scenario_file_replays_as_its_snapshot_and_expectation() {
    let replays = replay_all().await;
    assert!(
        replays.len() >= 25,
        "at least 25 scenarios ship, found {}",
        replays.len()
    );
    for (stem, scenario, replay) in &replays {
        let trail = replay.render();
        insta::with_settings!(
            { snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"), omit_expression => true,
              prepend_module_to_snapshot => false },
            { insta::assert_snapshot!(format!("scenario__{stem}"), trail) }
        );
        // Issue 24: no trail asks to look again at once.
        for step in &replay.steps {
            assert_ne!(
                step.outcome.requeue_after,
                Some(std::time::Duration::ZERO),
                "{stem}: a 0 s wake-up at +{}s\n{trail}",
                step.at
            );
        }
        if let Some(end) = &scenario.expect.end {
            assert_eq!(replay.end().as_str(), end, "{stem}: end phase\n{trail}");
        }
        if let Some(creates) = scenario.expect.creates {
            assert_eq!(replay.creates, creates, "{stem}: create calls\n{trail}");
        }
    }
}

#[tokio::test]
async fn every_transition_row_is_covered_by_a_scenario() {
    let mut covered = BTreeSet::new();
    for (_, _, replay) in replay_all().await {
        for entry in replay.audit() {
            let row = ROWS
                .iter()
                .find(|r| {
                    r.from == entry.from
                        && r.on == entry.event
                        && r.to == entry.to
                        && r.reason == entry.reason
                        && r.guard.iter().map(ToString::to_string).collect::<Vec<_>>() == entry.guard
                })
                .unwrap_or_else(|| panic!("an audit entry matches no row: {entry:?}"));
            covered.insert(row.index);
        }
    }
    let uncovered: Vec<String> = ROWS
        .iter()
        .filter(|r| !covered.contains(&r.index))
        .map(|r| format!("#{} {} --{}--> {} ({})", r.index, r.from, r.on, r.to, r.reason))
        .collect();
    assert!(
        uncovered.is_empty(),
        "rows no scenario covers:\n{}",
        uncovered.join("\n")
    );
}

/// An event only executors raise appears right after a transition that ran one of its raising
/// effects: the executors raise nothing the table does not declare.
#[tokio::test]
async fn executors_raise_only_declared_events() {
    for (stem, _, replay) in replay_all().await {
        let entries: Vec<_> = replay.audit().collect();
        for pair in entries.windows(2) {
            let (before, entry) = (pair[0], pair[1]);
            let info = event_info(entry.event);
            if info.when.is_empty() {
                assert!(
                    before.effects.iter().any(|e| info.raised_by.contains(e)),
                    "{stem}: {} follows {:?}, which runs none of {:?}",
                    entry.event,
                    before.effects,
                    info.raised_by
                );
            }
        }
    }
}

/// `Ready` says why the proxy is or is not ready, in every status any scenario writes: a True
/// Ready never carries a warning's reason, and reporting on the spec (SpecValid) leaves Ready
/// alone wherever the spec is not what the proxy waits for: a healthy proxy keeps serving its
/// last valid spec (Ready=True as it was), a degraded or booting one stays not ready for the
/// reason it was.
#[tokio::test]
async fn ready_tells_why_and_spec_reports_leave_it_alone_where_the_spec_does_not_block() {
    let mut checked = 0;
    for (stem, _, replay) in replay_all().await {
        let mut ready_before: Option<(String, String, String)> = None;
        for step in &replay.steps {
            let Some(status) = &step.written else { continue };
            let Some(ready) = status.conditions.iter().find(|c| c.type_ == "Ready") else {
                continue;
            };
            let now = (ready.status.clone(), ready.reason.clone(), ready.message.clone());
            assert!(
                !(ready.status == "True" && reason::WARNINGS.contains(&ready.reason.as_str())),
                "{stem} at +{}s: Ready=True with the warning reason {}\n{}",
                step.at,
                ready.reason,
                replay.render()
            );
            let spec_reports_only = !step.outcome.audit.is_empty()
                && step.outcome.audit.iter().all(|e| {
                    matches!(e.event, Event::SpecInvalid | Event::SpecFixed)
                        && matches!(e.from, Phase::Healthy | Phase::Degraded | Phase::Provisioning)
                });
            if spec_reports_only && let Some(before) = &ready_before {
                checked += 1;
                assert_eq!(
                    &now,
                    before,
                    "{stem} at +{}s: a spec report changed Ready\n{}",
                    step.at,
                    replay.render()
                );
            }
            ready_before = Some(now);
        }
    }
    assert!(
        checked >= 4,
        "the scenarios report on the spec of running proxies ({checked} times)"
    );
}

/// A failing effect is never silent: the trail names the transition it caused and its cause.
#[tokio::test]
async fn failures_are_in_the_audit_with_their_cause() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("machines/scenarios/delete-fails-then-succeeds.yaml");
    let replay = Scenario::load(&path)
        .expect("loads")
        .replay()
        .await
        .expect("replays");
    let failed: Vec<_> = replay
        .audit()
        .filter(|e| e.reason == reason::DELETE_FAILED)
        .collect();
    assert_eq!(failed.len(), 2, "{}", replay.render());
    for entry in failed {
        assert_eq!(entry.cause.as_deref(), Some("provider error: domain is locked"));
    }
    assert_eq!(replay.end(), Phase::Deleted);
}

#[test]
fn a_bad_scenario_gets_a_clear_error() {
    let bad = [
        (
            "name: x\nsteps:\n  - {at: 5}\n  - {at: 1}\n",
            "before the previous step",
        ),
        (
            "name: x\nstart: {phase: booting}\nsteps: []\n",
            "unknown phase `booting`",
        ),
        (
            "name: x\nsteps:\n  - {at: 0, fail: {add_finalizer: {times: 1, kind: transient}}}\n",
            "only create_instance, delete_instance and update_credentials",
        ),
        (
            "name: x\nsteps:\n  - {at: 0, world: {health: green}}\n",
            "world.health `green`",
        ),
        ("name: x\nsteps:\n  - {at: 0, wrold: {}}\n", "unknown field"),
    ];
    for (yaml, needle) in bad {
        let err = Scenario::from_yaml(yaml, std::path::Path::new("bad.yaml")).expect_err(yaml);
        assert!(err.to_string().contains(needle), "{err}");
    }
}
