//! The build fails, naming the row, on a broken transition table. build.rs is included here so its
//! validation can be exercised on edited copies of machines/proxy.yaml without breaking the build.

#[path = "../build.rs"]
#[allow(dead_code)]
mod build_script;

const TABLE: &str = include_str!("../machines/proxy.yaml");

/// Apply `from -> to` once to the shipped table and return the validation errors.
fn errors_after(from: &str, to: &str) -> String {
    assert_eq!(
        TABLE.matches(from).count(),
        1,
        "the edit `{from}` must match exactly once"
    );
    match build_script::load_table(&TABLE.replacen(from, to, 1)) {
        Ok(_) => panic!("editing `{from}` into `{to}` must be rejected"),
        Err(errors) => errors.join("\n"),
    }
}

fn assert_mentions(errors: &str, needle: &str) {
    assert!(errors.contains(needle), "expected `{needle}` in:\n{errors}");
}

#[test]
fn the_shipped_table_is_valid() {
    if let Err(errors) = build_script::load_table(TABLE) {
        panic!("{}", errors.join("\n"));
    }
}

#[test]
fn unknown_effect_names_the_row() {
    let errors = errors_after(
        "effects: [set_conditions, requeue_after]",
        "effects: [set_conditions, requeue_later]",
    );
    assert_mentions(
        &errors,
        "(provisioning --instance_running--> provisioning): unknown effect `requeue_later`",
    );
}

#[test]
fn unknown_guard_names_the_row() {
    let errors = errors_after(
        "{from: provisioning, on: create_failed, guard: attempts_left",
        "{from: provisioning, on: create_failed, guard: attempt_left",
    );
    assert_mentions(
        &errors,
        "(provisioning --create_failed [attempt_left]--> provisioning): unknown guard",
    );
}

#[test]
fn unknown_state_and_event_name_the_row() {
    let errors = errors_after(
        "{from: healthy, on: health_failed, to: degraded,",
        "{from: healthy, on: health_failed, to: degradd,",
    );
    assert_mentions(&errors, "unknown state `degradd` in `to`");

    let errors = errors_after(
        "{from: replacing, on: drain_complete,",
        "{from: replacing, on: drained,",
    );
    assert_mentions(
        &errors,
        "(replacing --drained--> replacing): unknown event `drained`",
    );
    // ...and the pair the row used to cover is now uncovered.
    assert_mentions(&errors, "state `replacing` does not cover event `drain_complete`");
}

#[test]
fn every_pair_is_covered_exactly_once() {
    let errors = errors_after(
        "health_passed, health_failed, health_recovered, instance_gone]",
        "health_passed, health_failed, health_recovered]",
    );
    assert_mentions(&errors, "state `pending` does not cover event `instance_gone`");

    let errors = errors_after(
        "invalid: [instance_gone, provisioning_timeout, degraded_too_long, drain_complete]",
        "invalid: [instance_gone, provisioning_timeout, degraded_too_long, drain_complete, health_failed]",
    );
    assert_mentions(
        &errors,
        "state `healthy`, event `health_failed` is covered more than once",
    );
}

#[test]
fn guarded_rows_need_an_unguarded_fallback() {
    let errors = errors_after(
        "{from: provisioning, on: create_failed, to: pending,",
        "{from: provisioning, on: create_failed, guard: leases_active, to: pending,",
    );
    assert_mentions(
        &errors,
        "guarded rows for (provisioning, create_failed) must end with an unguarded fallback row",
    );
}

#[test]
fn reasons_are_bounded_camel_case() {
    let errors = errors_after("reason: HealthCheckFailed,", "reason: health check failed,");
    assert_mentions(&errors, "reason `health check failed` must be CamelCase");
}
