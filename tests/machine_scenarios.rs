//! Lifecycle scenarios: audit trails of whole runs through the engine, as insta snapshots under
//! snapshots/, plus the crash-and-rehydrate check at every state and the shipped scenario files.

use egress_proxies_operator::machine::scenario::{Replay, Replayer, Scenario, Step, StepOutcome};
use egress_proxies_operator::machine::{EffectKind, Event, GuardInput, Phase, State};

use Event::*;

/// Snapshots land in <repo>/snapshots, named after this test file.
macro_rules! snapshot {
    ($($body:tt)*) => {
        insta::with_settings!(
            { snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"), omit_expression => true },
            { $($body)* }
        )
    };
}

/// Replay `scenario`, snapshot its steps, and return the replay for extra assertions.
fn check(snapshot_name: &str, scenario: Scenario) -> Replay {
    let replay = scenario.replay();
    // The audit holds exactly the transitions; ignored and invalid steps leave no entry.
    let transitions = replay
        .steps
        .iter()
        .filter(|s| s.outcome == StepOutcome::Transitioned)
        .count();
    assert_eq!(replay.audit.entries.len(), transitions);
    snapshot!(insta::assert_yaml_snapshot!(snapshot_name, replay));
    replay
}

fn effects_of(replay: &Replay) -> Vec<EffectKind> {
    replay
        .audit
        .entries
        .iter()
        .flat_map(|e| e.effects.iter().copied())
        .collect()
}

fn count(effects: &[EffectKind], kind: EffectKind) -> usize {
    effects.iter().filter(|e| **e == kind).count()
}

/// Create, boot, pass: the happy path.
fn create_to_healthy() -> Scenario {
    Scenario::new("create to healthy")
        .describe("A new Proxy is provisioned, boots and passes its health checks.")
        .at(0, SpecObserved)
        .at(2, InstanceCreated)
        .at(30, InstanceRunning)
        .at(45, HealthFailed)
        .at(75, HealthPassed)
}

#[test]
fn create_to_healthy_once() {
    let replay = check("create_to_healthy", create_to_healthy());
    assert_eq!(replay.end, Phase::Healthy);
    let effects = effects_of(&replay);
    assert_eq!(count(&effects, EffectKind::CreateInstance), 1);
    assert_eq!(count(&effects, EffectKind::EnableLeases), 1);
}

#[test]
fn health_fails_and_recovers() {
    let replay = check(
        "health_fails_and_recovers",
        Scenario::new("health fails and recovers")
            .describe("A healthy proxy fails its checks, leaves the rotation, and comes back.")
            .starting_in(Phase::Healthy, 0)
            .at(60, HealthFailed)
            .at(90, HealthFailed)
            .at(150, HealthRecovered),
    );
    assert_eq!(replay.end, Phase::Healthy);
    let effects = effects_of(&replay);
    assert_eq!(count(&effects, EffectKind::DisableLeases), 1);
    assert_eq!(count(&effects, EffectKind::EnableLeases), 1);
    assert_eq!(count(&effects, EffectKind::CreateInstance), 0);
}

#[test]
fn degraded_too_long_is_replaced() {
    let replay = check(
        "degraded_too_long_is_replaced",
        Scenario::new("degraded too long is replaced")
            .describe("A degraded proxy with active leases never recovers: drain, delete, recreate.")
            .starting_in(Phase::Healthy, 0)
            .with_input(GuardInput {
                active_leases: 1,
                ..GuardInput::default()
            })
            .at(10, HealthFailed)
            .at(910, DegradedTooLong)
            .step(Step::at(960, DrainComplete).active_leases(0))
            .at(965, InstanceGone)
            .at(967, InstanceCreated)
            .at(1000, HealthPassed),
    );
    assert_eq!(replay.end, Phase::Healthy);
    let effects = effects_of(&replay);
    let drain = effects.iter().position(|e| *e == EffectKind::DrainLeases);
    let delete = effects.iter().position(|e| *e == EffectKind::DeleteInstance);
    let create = effects.iter().position(|e| *e == EffectKind::CreateInstance);
    assert!(
        drain < delete && delete < create,
        "drain, then delete, then create: {effects:?}"
    );
}

#[test]
fn secret_rotation_is_replaced() {
    let replay = check(
        "secret_rotation_is_replaced",
        Scenario::new("secret rotation is replaced")
            .describe("The cloud-init Secret's content changes; no lease is active, so the old instance goes at once.")
            .starting_in(Phase::Healthy, 0)
            .at(0, SpecHashChanged)
            .at(1, SpecHashChanged)
            .at(5, InstanceGone)
            .at(7, InstanceCreated)
            .at(40, InstanceRunning)
            .at(70, HealthPassed),
    );
    assert_eq!(replay.end, Phase::Healthy);
    let effects = effects_of(&replay);
    assert_eq!(count(&effects, EffectKind::DeleteInstance), 1);
    assert_eq!(count(&effects, EffectKind::CreateInstance), 1);
    assert_eq!(count(&effects, EffectKind::DrainLeases), 0);
}

#[test]
fn attribute_change_does_nothing() {
    // Attributes are not in the spec hash: the controller derives only `spec_observed`.
    let replay = check(
        "attribute_change_does_nothing",
        Scenario::new("attribute change does nothing")
            .describe(
                "Attributes, lease limits and health settings change; the hash does not, so nothing happens.",
            )
            .starting_in(Phase::Healthy, 0)
            .at(10, SpecObserved)
            .at(40, HealthPassed)
            .at(70, SpecObserved),
    );
    assert_eq!(replay.end, Phase::Healthy);
    assert!(replay.audit.entries.is_empty(), "no transition, no effect");
}

#[test]
fn provider_down_during_create() {
    let replay = check(
        "provider_down_during_create",
        Scenario::new("provider down during create")
            .describe("The provider fails the create and goes down; creating resumes when it is back.")
            .at(0, SpecObserved)
            .at(5, CreateFailed)
            .at(10, ProviderUnavailable)
            .at(70, ProviderUnavailable)
            .at(130, ProviderAvailable)
            .at(135, InstanceCreated)
            .at(180, HealthPassed)
            .at(600, ProviderUnavailable),
    );
    assert_eq!(
        replay.end,
        Phase::Healthy,
        "a healthy proxy is not torn down by a provider outage"
    );
}

#[test]
fn instance_vanishes_while_healthy() {
    let replay = check(
        "instance_vanishes_while_healthy",
        Scenario::new("instance vanishes while healthy")
            .describe("Someone deletes the VM under a leased proxy: revoke the leases and recreate it.")
            .starting_in(Phase::Healthy, 0)
            .with_input(GuardInput {
                active_leases: 2,
                ..GuardInput::default()
            })
            .step(Step::at(100, InstanceMissing).active_leases(0))
            .at(102, InstanceCreated)
            .at(140, HealthPassed),
    );
    assert_eq!(replay.end, Phase::Healthy);
    let first = &replay.audit.entries[0];
    assert!(first.effects.contains(&EffectKind::RevokeLeases));
    assert!(first.effects.contains(&EffectKind::CreateInstance));
}

#[test]
fn delete_during_provisioning() {
    let replay = check(
        "delete_during_provisioning",
        Scenario::new("delete during provisioning")
            .describe("The Proxy is deleted while its instance boots; stale boot events are ignored.")
            .at(0, SpecObserved)
            .at(2, InstanceCreated)
            .at(10, DeletionRequested)
            .at(12, InstanceRunning)
            .at(15, InstanceGone),
    );
    assert_eq!(replay.end, Phase::Deleted);
    let effects = effects_of(&replay);
    assert_eq!(effects.last(), Some(&EffectKind::RecordEvent));
    assert_eq!(count(&effects, EffectKind::RemoveFinalizer), 1);
}

#[test]
fn delete_while_replacing() {
    let replay = check(
        "delete_while_replacing",
        Scenario::new("delete while replacing")
            .describe(
                "The Proxy is deleted while its leases drain for a replacement: revoke them and delete.",
            )
            .starting_in(Phase::Healthy, 0)
            .with_input(GuardInput {
                active_leases: 2,
                ..GuardInput::default()
            })
            .at(0, SpecHashChanged)
            .at(30, DeletionRequested)
            .step(Step::at(32, DrainComplete).active_leases(0))
            .at(35, InstanceGone),
    );
    assert_eq!(replay.end, Phase::Deleted);
    let effects = effects_of(&replay);
    assert_eq!(
        count(&effects, EffectKind::CreateInstance),
        0,
        "no new instance for a deleted Proxy"
    );
}

#[test]
fn create_attempts_exhausted() {
    let replay = check(
        "create_attempts_exhausted",
        Scenario::new("create attempts exhausted")
            .describe("Every create fails: three attempts, then pending backs off and a new episode starts.")
            .at(0, SpecObserved)
            .at(1, CreateFailed)
            .at(11, InstanceMissing)
            .at(12, CreateFailed)
            .at(22, InstanceMissing)
            .at(23, CreateFailed)
            .at(83, SpecObserved)
            .at(85, InstanceCreated),
    );
    assert_eq!(replay.end, Phase::Provisioning);
    let effects = effects_of(&replay);
    assert_eq!(
        count(&effects, EffectKind::CreateInstance),
        4,
        "3 in the first episode, 1 in the next"
    );
    assert_eq!(replay.end_state.data().attempts, 1);
}

#[test]
fn provisioning_timeout_is_replaced() {
    let replay = check(
        "provisioning_timeout_is_replaced",
        Scenario::new("provisioning timeout is replaced")
            .describe("The instance runs but never passes its checks: start over with a fresh one.")
            .at(0, SpecObserved)
            .at(2, InstanceCreated)
            .at(30, InstanceRunning)
            .at(600, ProvisioningTimeout)
            .at(605, InstanceGone)
            .at(660, HealthPassed),
    );
    assert_eq!(replay.end, Phase::Healthy);
}

#[test]
fn invalid_spec_keeps_a_healthy_proxy_serving() {
    let replay = check(
        "invalid_spec_keeps_serving",
        Scenario::new("invalid spec keeps serving")
            .describe(
                "The cloud-init Secret loses its label: report it, keep serving; a bogus event is INVALID.",
            )
            .starting_in(Phase::Healthy, 0)
            .at(10, SpecInvalid)
            .at(20, DrainComplete)
            .at(70, SpecObserved),
    );
    assert_eq!(replay.end, Phase::Healthy);
    assert_eq!(replay.steps[1].outcome, StepOutcome::Invalid);
}

/// The whole lifecycle of DESIGN §4; it visits every state, so it also drives the crash test.
fn full_lifecycle() -> Scenario {
    Scenario::new("full lifecycle")
        .describe("create → healthy → degraded → recovered → spec change → replaced → deleted")
        .at(0, SpecObserved)
        .at(2, InstanceCreated)
        .at(30, InstanceRunning)
        .at(60, HealthPassed)
        .at(600, HealthFailed)
        .at(660, HealthRecovered)
        .step(Step::at(1200, SpecHashChanged).active_leases(1))
        .step(Step::at(1260, DrainComplete).active_leases(0))
        .at(1265, InstanceGone)
        .at(1267, InstanceCreated)
        .at(1300, HealthPassed)
        .at(2000, DeletionRequested)
        .at(2005, InstanceGone)
}

#[test]
fn full_lifecycle_trail() {
    let replay = check("full_lifecycle", full_lifecycle());
    assert_eq!(replay.end, Phase::Deleted);
}

/// Crash after every step (so at every state the run passes through), rehydrate the state from
/// its serialized form, and continue: the trail equals the uninterrupted run's, and rehydrating
/// itself adds no entry and no effect.
#[test]
fn crash_and_rehydrate_at_each_state() {
    for scenario in [
        full_lifecycle(),
        create_attempts_exhausted_scenario(),
        delete_while_draining(),
    ] {
        let uninterrupted = scenario.replay();
        let mut crashed_in = std::collections::BTreeSet::new();
        for cut in 0..=scenario.steps.len() {
            let mut before = Replayer::new(scenario.start.clone(), scenario.input);
            for step in &scenario.steps[..cut] {
                before.apply(step);
            }
            crashed_in.insert(before.state().phase());

            // What the status holds, through JSON as the API server stores it.
            let persisted = serde_json::to_string(before.state()).expect("state serializes");
            let rehydrated: State = serde_json::from_str(&persisted).expect("state rehydrates");
            assert_eq!(&rehydrated, before.state(), "lossless round trip at cut {cut}");

            // Guard input is observed afresh after a restart: replay the sticky overrides.
            let mut input = scenario.input;
            for step in &scenario.steps[..cut] {
                if let Some(n) = step.input.active_leases {
                    input.active_leases = n;
                }
                if let Some(n) = step.input.max_create_attempts {
                    input.max_create_attempts = n;
                }
            }
            let mut after = Replayer::new(rehydrated, input);
            assert!(after.audit().entries.is_empty(), "rehydrating records nothing");
            for step in &scenario.steps[cut..] {
                after.apply(step);
            }

            let mut resumed = before.audit().entries.clone();
            resumed.extend(after.audit().entries.iter().cloned());
            assert_eq!(
                resumed, uninterrupted.audit.entries,
                "{}: crash after step {cut} changed the trail",
                scenario.name
            );
            assert_eq!(after.state(), &uninterrupted.end_state);
        }
        if scenario.name == "full lifecycle" {
            assert_eq!(
                crashed_in.into_iter().collect::<Vec<_>>(),
                Phase::ALL.to_vec(),
                "the full lifecycle crashes once in every state"
            );
        }
    }
}

fn create_attempts_exhausted_scenario() -> Scenario {
    Scenario::new("attempts")
        .at(0, SpecObserved)
        .at(1, CreateFailed)
        .at(11, InstanceMissing)
        .at(12, CreateFailed)
        .at(22, InstanceMissing)
        .at(23, CreateFailed)
        .at(83, SpecObserved)
}

fn delete_while_draining() -> Scenario {
    Scenario::new("delete while draining")
        .starting_in(Phase::Healthy, 0)
        .with_input(GuardInput {
            active_leases: 2,
            ..GuardInput::default()
        })
        .at(0, DeletionRequested)
        .step(Step::at(60, DrainComplete).active_leases(0))
        .at(65, InstanceGone)
}

/// The shipped scenario files replay, and their rendered trails are snapshots too.
#[test]
fn shipped_scenarios_render() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("machines/scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("machines/scenarios exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "ship at least three scenarios");
    for file in files {
        let text = egress_proxies_operator::machine::scenario::replay_file(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 name")
            .replace('-', "_");
        snapshot!(insta::assert_snapshot!(format!("file_{stem}"), text));
    }
}
