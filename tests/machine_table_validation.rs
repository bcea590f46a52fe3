//! The build fails, naming the row, on a broken transition table. build/table.rs (the build script's
//! table module) is included here so its validation can be exercised on edited copies of
//! machines/proxy.yaml without breaking the build.

#[path = "../build/table.rs"]
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
    let errors = errors_after("effects: [set_conditions],", "effects: [set_condition],");
    assert_mentions(
        &errors,
        "(provisioning --instance_running--> provisioning): unknown effect `set_condition`",
    );
}

#[test]
fn an_effect_on_an_event_it_does_not_take_names_the_row() {
    let errors = errors_after(
        "effects: [disable_leases, set_conditions, record_event],\n     reason: HealthCheckFailed, note: \"Out of rotation",
        "effects: [disable_leases, report_spec, record_event],\n     reason: HealthCheckFailed, note: \"Out of rotation",
    );
    assert_mentions(
        &errors,
        "(healthy --health_failed--> degraded): effect `report_spec` takes its value from the events spec_invalid / spec_fixed only",
    );
}

#[test]
fn unknown_guard_fact_names_the_row() {
    let errors = errors_after(
        "{from: healthy, on: deletion_requested, guard: [leases_active]",
        "{from: healthy, on: deletion_requested, guard: [lease_active]",
    );
    assert_mentions(
        &errors,
        "(healthy --deletion_requested [lease_active]--> deleting): unknown fact `lease_active`",
    );
}

#[test]
fn an_event_needs_facts_or_effects_that_raise_it() {
    let errors = errors_after(
        "    doc: The provider accepted the delete but still reports the instance (it is terminating).\n    raised_by: [delete_instance]",
        "    doc: The provider accepted the delete but still reports the instance (it is terminating).",
    );
    assert_mentions(&errors, "event `delete_pending`: say what raises it");
}

#[test]
fn a_fact_raised_event_cannot_be_invalid_anywhere() {
    let errors = errors_after(
        "invalid: [delete_failed, delete_pending]",
        "invalid: [delete_failed, delete_pending, health_failed]",
    );
    assert_mentions(
        &errors,
        "state `provisioning`: event `health_failed` is raised by facts",
    );
}

#[test]
fn rows_for_an_effect_raised_event_need_a_row_that_runs_the_effect() {
    // No row into `pending` creates, so a pending row for create_failed could never be taken.
    let errors = errors_after(
        "    invalid: [instance_created, instance_stale, create_failed, create_rejected, delete_failed, delete_pending,\n              credentials_updated, credentials_update_failed]\n\n  - name: provisioning",
        "    invalid: [instance_created, instance_stale, create_rejected, delete_failed, delete_pending,\n              credentials_updated, credentials_update_failed]\n\n  - name: provisioning",
    );
    assert_mentions(&errors, "state `pending` does not cover event `create_failed`");
    let table = TABLE
        .replacen(
            "    invalid: [instance_created, instance_stale, create_failed, create_rejected, delete_failed, delete_pending,\n              credentials_updated, credentials_update_failed]\n\n  - name: provisioning",
            "    invalid: [instance_created, instance_stale, create_rejected, delete_failed, delete_pending,\n              credentials_updated, credentials_update_failed]\n\n  - name: provisioning",
            1,
        )
        .replacen(
            "transitions:\n",
            "transitions:\n  - {from: pending, on: create_failed, to: pending, effects: [record_event], reason: CreateFailed, note: \"never taken\"}\n",
            1,
        );
    let errors = build_script::load_table(&table)
        .expect_err("unreachable rows are refused")
        .join("\n");
    assert_mentions(
        &errors,
        "state `pending` has rows for `create_failed`, which only create_instance raise(s), but no row into `pending` runs it",
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
        "             health_passed, drain_complete, delete_due, timer_expired, credentials_changed]\n    invalid: [instance_created,",
        "             health_passed, drain_complete, delete_due, credentials_changed]\n    invalid: [instance_created,",
    );
    assert_mentions(&errors, "state `pending` does not cover event `timer_expired`");

    let errors = errors_after(
        "    ignore: [spec_observed, provider_available, health_failed, drain_complete, delete_due]",
        "    ignore: [spec_observed, provider_available, health_failed, drain_complete, delete_due, health_passed]",
    );
    assert_mentions(
        &errors,
        "state `provisioning`, event `health_passed` is covered more than once",
    );
}

#[test]
fn guarded_rows_need_an_unguarded_fallback() {
    let errors = errors_after(
        "{from: provisioning, on: create_failed, to: pending,",
        "{from: provisioning, on: create_failed, guard: [leases_active], to: pending,",
    );
    assert_mentions(
        &errors,
        "guarded rows for (provisioning, create_failed) must end with an unguarded fallback row",
    );
}

#[test]
fn reenter_only_restarts_a_timer_on_a_self_transition() {
    let errors = errors_after(
        "{from: degraded, on: timer_expired, to: degraded, reenter: true,",
        "{from: degraded, on: timer_expired, to: replacing, reenter: true,",
    );
    assert_mentions(&errors, "`reenter` restarts a timer");
}

#[test]
fn reasons_are_bounded_camel_case() {
    let errors = errors_after("reason: HealthCheckFailed,", "reason: health check failed,");
    assert_mentions(&errors, "reason `health check failed` must be CamelCase");
}
