//! Audits that never mislead (issue 24): every scenario's trail is read back, and a reason whose
//! documented meaning (docs/machines.md, the row's note) contradicts the effects that ran before
//! it fails the test, naming the scenario, the entry and the rule. The rules, one per reason
//! that claims something about the past:
//!
//! - `DrainComplete` ("the drain is over, send the first delete"): no delete was sent since the
//!   instance began leaving.
//! - `DeleteRetried` ("a delete failed or has not finished"): one was sent.
//! - `DeleteStuck` ("outlived drain_timeout after the provider accepted its delete"): a delete
//!   was accepted (a `DeletePending` followed it).
//! - `DeleteOverdue` ("the provider accepted none of the deletes sent"): deletes were sent and
//!   none was accepted.
//! - `schedule_retry` counts failures: it runs only on a row whose reason is a failure.
//! - `ProviderUnavailable` is one Warning per outage: no second `record_event` with it before
//!   the provider answered something.
//! - `InstanceCreated` names the spec hash, and says "found the existing instance" exactly when
//!   the trail created one that nothing removed since; `SpecChanged` and `Recreating` name the
//!   spec hash; `InstanceVanished` gives a cause.

use std::path::PathBuf;

use egress_proxies_operator::controller::simulate::{self, Scenario};
use egress_proxies_operator::machine::{AuditEntry, EffectKind, Event, Phase, reason};

/// Reasons of rows that count a failed provider call.
const FAILURES: &[&str] = &[
    reason::CREATE_FAILED,
    reason::CREATE_REJECTED,
    reason::PROVIDER_UNAVAILABLE,
    reason::INSTANCE_VANISHED,
    reason::DELETE_FAILED,
    reason::CREDENTIALS_UPDATE_FAILED,
];

/// Reasons that show the provider answered (an outage is over, or was not one).
const PROVIDER_ANSWERED: &[&str] = &[
    reason::INSTANCE_CREATED,
    reason::STALE_INSTANCE,
    reason::CREATE_FAILED,
    reason::CREATE_REJECTED,
    reason::DELETE_PENDING,
    reason::DELETED,
    reason::RECREATING,
    reason::INSTANCE_RUNNING,
    reason::HEALTHY,
];

fn is_leaving(phase: Phase) -> bool {
    matches!(phase, Phase::Replacing | Phase::Deleting)
}

/// The rules above over one trail; each violation as a line.
fn contradictions(entries: &[AuditEntry]) -> Vec<String> {
    let mut found = Vec::new();
    // Deletes since the current instance began leaving: (sent, accepted).
    let (mut sent, mut accepted) = (false, false);
    // A create in this trail made an instance that nothing removed since.
    let mut instance_made = false;
    let mut outage_reported = false;
    for (i, e) in entries.iter().enumerate() {
        let mut fail = |rule: &str| found.push(format!("entry {i} {} ({}): {rule}", e.arrow(), e.reason));
        if is_leaving(e.to) && !is_leaving(e.from) {
            (sent, accepted) = (false, false);
        }
        let r = e.reason.as_str();
        if r == reason::DRAIN_COMPLETE && sent {
            fail("DrainComplete after a delete was sent: nothing was drained, it is a retry");
        }
        if r == reason::DELETE_RETRIED && !sent {
            fail("DeleteRetried without an earlier delete");
        }
        if r == reason::DELETE_STUCK && !accepted {
            fail("DeleteStuck, but the provider accepted no delete");
        }
        if r == reason::DELETE_OVERDUE && (!sent || accepted) {
            fail("DeleteOverdue needs deletes sent and none accepted");
        }
        if e.effects.contains(&EffectKind::ScheduleRetry) && !FAILURES.contains(&r) {
            fail("schedule_retry counts a failure, and this reason is none");
        }
        if r == reason::PROVIDER_UNAVAILABLE && e.effects.contains(&EffectKind::RecordEvent) {
            if outage_reported {
                fail("a second ProviderUnavailable Warning in one outage");
            }
            outage_reported = true;
        }
        if PROVIDER_ANSWERED.contains(&r) {
            outage_reported = false;
        }
        let cause = e.cause.as_deref().unwrap_or_default();
        if r == reason::INSTANCE_CREATED {
            if !cause.contains("spec hash") {
                fail("InstanceCreated must name the spec hash");
            }
            if cause.contains("found the existing instance") != instance_made {
                fail(if instance_made {
                    "a create that found the instance it made before reads like a new one"
                } else {
                    "a fresh create claims to have found an existing instance"
                });
            }
            instance_made = true;
        }
        if (r == reason::SPEC_CHANGED || r == reason::RECREATING) && !cause.contains("spec hash") {
            fail("SpecChanged and Recreating must name the spec hash");
        }
        if r == reason::INSTANCE_VANISHED && cause.is_empty() {
            fail("InstanceVanished must give its cause");
        }
        // What this entry did, for the entries after it.
        if e.effects.contains(&EffectKind::DeleteInstance) {
            sent = true;
        }
        if e.event == Event::DeletePending {
            accepted = true;
        }
        if e.event == Event::InstanceMissing || e.event == Event::InstanceStale {
            instance_made = false;
        }
    }
    found
}

#[tokio::test]
async fn no_scenario_trail_has_a_reason_its_effects_contradict() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("machines/scenarios");
    let mut problems = Vec::new();
    let mut read = 0;
    for path in simulate::scenario_files(&dir).expect("machines/scenarios is readable") {
        let scenario = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
        let replay = scenario.replay().await.unwrap_or_else(|e| panic!("{e}"));
        let entries: Vec<AuditEntry> = replay.audit().cloned().collect();
        read += entries.len();
        for problem in contradictions(&entries) {
            problems.push(format!("{}: {problem}", scenario.name));
        }
    }
    assert!(read > 200, "the scenarios' trails were read ({read} entries)");
    assert!(
        problems.is_empty(),
        "misleading audit lines:\n{}",
        problems.join("\n")
    );
}

/// The rules catch the lines issue 24 found (as the old engine wrote them), so the test above
/// cannot pass by reading nothing.
#[test]
fn the_rules_catch_the_lines_issue_24_found() {
    let at = jiff::Timestamp::UNIX_EPOCH;
    let entry = |from: Phase, event: Event, to: Phase, effects: &[EffectKind], reason: &str, cause: &str| {
        AuditEntry {
            at,
            from,
            event,
            to,
            guard: Vec::new(),
            effects: effects.to_vec(),
            reason: reason.to_owned(),
            note: String::new(),
            cause: (!cause.is_empty()).then(|| cause.to_owned()),
        }
    };
    use EffectKind::*;
    let drain = entry(
        Phase::Healthy,
        Event::DeletionRequested,
        Phase::Deleting,
        &[DisableLeases, DrainLeases, SetConditions, RecordEvent],
        "DrainingForDeletion",
        "",
    );
    // DeleteStuck although the provider was down the whole drain: no delete was sent.
    let stuck = entry(
        Phase::Deleting,
        Event::TimerExpired,
        Phase::Deleting,
        &[DeleteInstance, SetConditions, RecordEvent],
        reason::DELETE_STUCK,
        "drain_timeout (300 s) ran out in deleting",
    );
    assert_eq!(contradictions(&[drain.clone(), stuck]).len(), 1);
    // DrainComplete for a retried delete.
    let failed = entry(
        Phase::Deleting,
        Event::DeleteFailed,
        Phase::Deleting,
        &[ScheduleRetry, SetConditions, RecordEvent],
        reason::DELETE_FAILED,
        "provider unavailable",
    );
    let deletion = entry(
        Phase::Healthy,
        Event::DeletionRequested,
        Phase::Deleting,
        &[
            DisableLeases,
            RevokeLeases,
            DeleteInstance,
            SetConditions,
            RecordEvent,
        ],
        "DeletionRequested",
        "",
    );
    let drained = entry(
        Phase::Deleting,
        Event::DrainComplete,
        Phase::Deleting,
        &[RevokeLeases, DeleteInstance, RecordEvent],
        reason::DRAIN_COMPLETE,
        "",
    );
    assert_eq!(contradictions(&[deletion, failed, drained]).len(), 1);
    // A delete still terminating counted as a failure.
    let pending = entry(
        Phase::Deleting,
        Event::DeletePending,
        Phase::Deleting,
        &[ScheduleRetry, RecordEvent],
        reason::DELETE_PENDING,
        "terminating",
    );
    assert_eq!(contradictions(&[pending]).len(), 1);
    // Two ProviderUnavailable Warnings for one outage.
    let unavailable = entry(
        Phase::Provisioning,
        Event::ProviderUnavailable,
        Phase::Pending,
        &[ScheduleRetry, SetConditions, RecordEvent],
        reason::PROVIDER_UNAVAILABLE,
        "connection refused",
    );
    assert_eq!(contradictions(&[unavailable.clone(), unavailable]).len(), 1);
    // A create that adopted what the crashed one made, told as a second create, and without
    // the spec hash; InstanceVanished without a cause.
    let created = entry(
        Phase::Provisioning,
        Event::InstanceCreated,
        Phase::Provisioning,
        &[SetConditions, RecordEvent],
        reason::INSTANCE_CREATED,
        "instance sim/sim/epo-sim-proxy",
    );
    assert_eq!(contradictions(&[created.clone(), created]).len(), 3);
    let vanished = entry(
        Phase::Healthy,
        Event::InstanceMissing,
        Phase::Provisioning,
        &[
            DisableLeases,
            RevokeLeases,
            CreateInstance,
            SetConditions,
            RecordEvent,
        ],
        reason::INSTANCE_VANISHED,
        "",
    );
    assert_eq!(contradictions(&[vanished]).len(), 1);
}
