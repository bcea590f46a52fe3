//! The lifecycle over random worlds (issue 24, item 2): proptest draws a scenario — failing and
//! succeeding creates, deletes and credentials updates of every error kind, crashes before the
//! status write, spec edits, Secret rotations and breakages, provider outages, health flaps,
//! boots, vanished instances, leases, deletes at any moment, cloud-init rotations, probe results
//! judged by thresholds, edits of limits and health settings — and replays it through the real
//! reconciler against the scenario world, following the wake-ups the operator asks for between
//! steps (and for ten minutes after the last), as a runner would. At every reconcile:
//!
//! - at most one live instance per Proxy: the world keys instances by name, like every provider
//!   (`provider-contract.md`), so this holds by construction; what is checked is that a create
//!   never replaces a live instance of another spec (`instance_stale` deletes it first);
//! - the finalizer is removed only when the instance is gone: a Proxy object that is gone
//!   leaves no instance behind;
//! - no lease is handed out by a proxy that is not healthy: admission is open only while the
//!   *stored* status says `healthy` (a crash before that write leaves it closed), with a
//!   passing verdict;
//! - retries back off: each `schedule_retry` counts one more failure than the last (until a
//!   `clear_retry`) and waits its nominal backoff (the cap for a rejected create);
//! - **at most 8 reconciles in any simulated minute in which nothing changes** (no scripted
//!   step): a waiting state polls every 10 s (6 a minute), plus at most a retry time and a
//!   timer falling between two polls. A 0 s wake-up makes a thousand at one instant.
//!
//! A failing case is printed as a scenario file: keep it in machines/scenarios/ as a regression.

use std::time::Duration;

use egress_proxies_operator::controller::plan::Planned;
use egress_proxies_operator::controller::simulate::{
    Failure, Replay, Scenario, SimConfig, SimStep, SpecEdit, WorldChange,
};
use egress_proxies_operator::machine::{Backoff, EffectKind, Event, Phase};
use proptest::prelude::*;

/// Reconciles allowed in a simulated minute without a scripted change.
const QUIET_MINUTE_BOUND: usize = 8;

#[derive(Clone, Debug)]
enum Action {
    Nothing,
    FailCreate(&'static str, u32),
    FailDelete(&'static str, u32),
    FailUpdate(u32),
    Crash,
    SpecEdit,
    Rotate,
    SpecBroken,
    SpecFixed,
    Provider(bool),
    Health(&'static str),
    Instance(&'static str),
    Leases(usize),
    Delete,
    CloudInit,
    Probes(Vec<bool>),
    Edit(i32),
}

fn kind() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("transient"),
        Just("permanent"),
        Just("rejected"),
        Just("unavailable")
    ]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => Just(Action::Nothing),
        2 => (kind(), 1..4u32).prop_map(|(k, n)| Action::FailCreate(k, n)),
        2 => (kind(), 1..4u32).prop_map(|(k, n)| Action::FailDelete(k, n)),
        1 => (1..3u32).prop_map(Action::FailUpdate),
        1 => Just(Action::Crash),
        2 => Just(Action::SpecEdit),
        2 => Just(Action::Rotate),
        1 => Just(Action::SpecBroken),
        1 => Just(Action::SpecFixed),
        2 => any::<bool>().prop_map(Action::Provider),
        4 => prop_oneof![Just("passing"), Just("failing"), Just("unknown")].prop_map(Action::Health),
        2 => prop_oneof![Just("running"), Just("starting"), Just("vanished")].prop_map(Action::Instance),
        2 => (0..3usize).prop_map(Action::Leases),
        1 => Just(Action::Delete),
        2 => Just(Action::CloudInit),
        3 => prop::collection::vec(any::<bool>(), 1..4).prop_map(Action::Probes),
        1 => (1..4i32).prop_map(Action::Edit),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        any::<(bool, bool, bool)>(),
        prop::collection::vec((1..180u64, action()), 1..24),
    )
        .prop_map(|((slow_boot, slow_delete, in_place), actions)| {
            let mut at = 0;
            let mut revision = 1;
            let steps = actions
                .into_iter()
                .map(|(gap, action)| {
                    at += gap;
                    let mut step = SimStep {
                        at,
                        ..SimStep::default()
                    };
                    let mut fail = |effect: &str, kind: &str, times| {
                        step.fail.insert(
                            effect.to_owned(),
                            Failure {
                                times,
                                kind: kind.to_owned(),
                                message: format!("scripted {kind}"),
                            },
                        );
                    };
                    let mut world = WorldChange::default();
                    match action {
                        Action::Nothing => {}
                        Action::FailCreate(kind, n) => fail("create_instance", kind, n),
                        Action::FailDelete(kind, n) => fail("delete_instance", kind, n),
                        Action::FailUpdate(n) => fail("update_credentials", "transient", n),
                        Action::Crash => step.crash = true,
                        Action::SpecEdit | Action::Rotate | Action::CloudInit => {
                            revision += 1;
                            let label = format!("v{revision}");
                            match action {
                                Action::SpecEdit => world.spec = Some(label),
                                Action::Rotate => world.credentials = Some(label),
                                _ => world.cloud_init = Some(label),
                            }
                        }
                        Action::Probes(results) => {
                            world.probes = results
                                .into_iter()
                                .map(|pass| if pass { "pass" } else { "fail" }.to_owned())
                                .collect();
                        }
                        Action::Edit(n) => {
                            world.edit = Some(SpecEdit {
                                max_concurrent: Some(n),
                                failure_threshold: Some(n),
                                ..SpecEdit::default()
                            });
                        }
                        Action::SpecBroken => world.spec_problem = Some("the Secret is gone".to_owned()),
                        Action::SpecFixed => world.spec_problem = Some(String::new()),
                        Action::Provider(up) => {
                            world.provider = Some(if up { "up" } else { "down" }.to_owned())
                        }
                        Action::Health(verdict) => world.health = Some(verdict.to_owned()),
                        Action::Instance(state) => world.instance = Some(state.to_owned()),
                        Action::Leases(n) => world.leases = Some(n),
                        Action::Delete => world.deleted = true,
                    }
                    step.world = world;
                    step
                })
                .collect();
            Scenario {
                name: "random-world".to_owned(),
                config: SimConfig {
                    slow_boot,
                    slow_delete,
                    credentials_in_place: in_place,
                    follow_wakeups: true,
                    ..SimConfig::default()
                },
                steps,
                ..Scenario::default()
            }
        })
}

/// The scenario as a file, to keep a failing case as a regression.
fn as_yaml(scenario: &Scenario) -> String {
    let c = &scenario.config;
    let mut out = format!(
        "name: regression-NAME\ndescription: found by tests/machine_simulation.rs\nconfig: {{follow_wakeups: true, slow_boot: {}, slow_delete: {}, credentials_in_place: {}}}\nsteps:\n",
        c.slow_boot, c.slow_delete, c.credentials_in_place
    );
    for step in &scenario.steps {
        let w = &step.world;
        let mut world = Vec::new();
        let mut push = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                world.push(format!("{k}: {v:?}"));
            }
        };
        push("health", w.health.clone());
        push("provider", w.provider.clone());
        push("leases", w.leases.map(|n| n.to_string()));
        push("spec", w.spec.clone());
        push("spec_problem", w.spec_problem.clone());
        push("credentials", w.credentials.clone());
        push("cloud_init", w.cloud_init.clone());
        push(
            "probes",
            (!w.probes.is_empty()).then(|| format!("[{}]", w.probes.join(", "))),
        );
        push(
            "edit",
            w.edit.as_ref().map(|e| {
                format!(
                    "{{max_concurrent: {}, failure_threshold: {}}}",
                    e.max_concurrent.unwrap_or(1),
                    e.failure_threshold.unwrap_or(3)
                )
            }),
        );
        push("instance", w.instance.clone());
        push("deleted", w.deleted.then(|| "true".to_owned()));
        let fail: Vec<String> = step
            .fail
            .iter()
            .map(|(e, f)| format!("{e}: {{times: {}, kind: {}}}", f.times, f.kind))
            .collect();
        out.push_str(&format!(
            "  - {{at: {}, world: {{{}}}, fail: {{{}}}, crash: {}}}\n",
            step.at,
            world.join(", "),
            fail.join(", "),
            step.crash
        ));
    }
    out
}

/// Every invariant over every reconcile of `replay`; the first broken one, described.
fn broken_invariant(scenario: &Scenario, replay: &Replay) -> Option<String> {
    let defaults = Backoff::default();
    let secs = |s: Option<u64>, d: Duration| s.map_or(d, Duration::from_secs);
    let backoff = Backoff {
        initial: secs(scenario.config.backoff_initial, defaults.initial),
        cap: secs(scenario.config.backoff_cap, defaults.cap),
        jitter: 0.0,
    };
    let mut last_attempts = 0u32;
    let mut instance_spec_live = false;
    // The phase the store holds: a start phase is stored; a new Proxy has no status.
    let mut stored_phase = scenario.start.phase.as_deref().and_then(Phase::from_name);
    for (i, step) in replay.steps.iter().enumerate() {
        let at = step.at;
        let w = step.world;
        // A crash loses the status write, and with it the count the step wrote.
        let persisted_attempts = last_attempts;
        if !w.object && w.instance {
            return Some(format!("+{at}s: the Proxy is gone but its instance is not"));
        }
        // A crash loses the status write: the store keeps what it held.
        if !step.crashed {
            stored_phase = Some(step.phase());
        }
        if w.leases_admitted && !(stored_phase == Some(Phase::Healthy) && w.health_passing) {
            return Some(format!(
                "+{at}s: leases admitted in {} while the stored status says {stored_phase:?} \
                 (health passing: {})",
                step.phase(),
                w.health_passing
            ));
        }
        for entry in &step.outcome.audit {
            // A create never stands in for a live instance of another spec: the stale one is
            // deleted first.
            if entry.event == Event::InstanceStale {
                instance_spec_live = true;
            }
            if entry.effects.contains(&EffectKind::DeleteInstance) {
                instance_spec_live = false;
            }
            if instance_spec_live && entry.event == Event::InstanceCreated {
                return Some(format!("+{at}s: created over a stale instance"));
            }
        }
        for plan in &step.outcome.plans {
            for effect in &plan.effects {
                match effect {
                    Planned::ScheduleRetry {
                        attempts,
                        next_attempt,
                    } => {
                        if *attempts != last_attempts + 1 {
                            return Some(format!(
                                "+{at}s: retry attempt {attempts} after attempt {last_attempts}"
                            ));
                        }
                        let now = egress_proxies_operator::controller::simulate::EPOCH
                            + jiff::SignedDuration::from_secs(i64::try_from(at).unwrap_or(0));
                        let delay = Duration::try_from(next_attempt.duration_since(now)).unwrap_or_default();
                        if delay != backoff.nominal(*attempts) && delay != backoff.cap {
                            return Some(format!(
                                "+{at}s: attempt {attempts} waits {delay:?}, not its backoff"
                            ));
                        }
                        last_attempts = *attempts;
                    }
                    Planned::ClearRetry => last_attempts = 0,
                    _ => {}
                }
            }
        }
        if step.crashed {
            last_attempts = persisted_attempts;
        }
        // Quiet minutes: from each reconcile, the next 60 s without a scripted step.
        let scripted_within = replay.steps[i + 1..]
            .iter()
            .take_while(|s| s.at < at + 60)
            .any(|s| !s.woke);
        if step.woke && !scripted_within {
            let count = replay.steps[i..].iter().take_while(|s| s.at < at + 60).count();
            if count > QUIET_MINUTE_BOUND {
                return Some(format!(
                    "+{at}s: {count} reconciles in a quiet minute (at most {QUIET_MINUTE_BOUND})"
                ));
            }
        }
    }
    None
}

fn replay(scenario: &Scenario) -> Replay {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime
        .block_on(scenario.replay())
        .unwrap_or_else(|e| panic!("{e}\n{}", as_yaml(scenario)))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_worlds_keep_every_invariant(scenario in scenario()) {
        let replay = replay(&scenario);
        if let Some(broken) = broken_invariant(&scenario, &replay) {
            panic!("{broken}\n\nkeep as machines/scenarios/regression-NAME.yaml:\n{}\ntrail:\n{}",
                as_yaml(&scenario), replay.render());
        }
    }
}

/// The simulation follows wake-ups: a rest after a failure that succeeded on retry takes a
/// handful of reconciles, and the bound is not met by following nothing.
#[test]
fn the_simulation_follows_the_operators_wake_ups() {
    let yaml = "name: x\nconfig: {follow_wakeups: true, slow_boot: true}\nsteps:\n  \
                - {at: 0, fail: {create_instance: {times: 1, kind: transient}}}\n  \
                - {at: 120, world: {instance: running, health: passing}}\n";
    let scenario = Scenario::from_yaml(yaml, std::path::Path::new("inline")).expect("valid");
    let replay = replay(&scenario);
    let woke: Vec<u64> = replay.steps.iter().filter(|s| s.woke).map(|s| s.at).collect();
    // The retry at +10 s, then the booting poll every 10 s until the step at +120 s, then the
    // resync (5 min) in the ten minutes followed after it.
    assert_eq!(
        woke,
        [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 420],
        "{}",
        replay.render()
    );
    assert_eq!(broken_invariant(&scenario, &replay), None);
}

/// Every shipped scenario again, following the operator's wake-ups between its steps: the same
/// invariants and the same bound on quiet minutes hold there too.
#[test]
fn every_scenario_keeps_the_invariants_when_its_wake_ups_are_followed() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("machines/scenarios");
    let files = egress_proxies_operator::controller::simulate::scenario_files(&dir).expect("readable");
    assert!(files.len() >= 25);
    for path in files {
        let mut scenario = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
        scenario.config.follow_wakeups = true;
        let replay = replay(&scenario);
        if let Some(broken) = broken_invariant(&scenario, &replay) {
            panic!("{}: {broken}\n{}", path.display(), replay.render());
        }
    }
}
