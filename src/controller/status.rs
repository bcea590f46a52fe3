//! The status executor's pure half: the status a Proxy should have, from its machine state and
//! what the reconcile learnt. The status is written only when this differs from what is stored,
//! so a steady-state resync writes nothing.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::{
    api::ProxyStatus,
    machine::{Phase, State, StateRecord},
};

/// The operator's finalizer on Proxies.
pub const FINALIZER: &str = "crawl.example.com/proxy-cleanup";

/// Condition types.
pub const READY: &str = "Ready";
/// The instance exists and runs.
pub const PROVISIONED: &str = "Provisioned";
/// The health checks pass.
pub const HEALTHY: &str = "Healthy";

/// What the status is computed from.
#[derive(Clone, Debug)]
pub struct StatusInput<'a> {
    /// The machine state after this reconcile.
    pub state: &'a State,
    /// The stored status (conditions keep their transition times when unchanged).
    pub previous: &'a ProxyStatus,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// Bounded reason of the last transition (or of the stored `Ready` condition).
    pub reason: &'a str,
    /// Human-readable detail for the `Ready` condition; never secret content.
    pub message: &'a str,
    /// Provider ID of the running instance.
    pub provider_id: Option<String>,
    /// `host:port`.
    pub endpoint: Option<String>,
    /// Spec hash of the running instance.
    pub spec_hash: Option<String>,
    /// The instance reported running.
    pub instance_running: bool,
    /// Set when a health verdict changed the status in this reconcile.
    pub last_health_check_time: Option<Timestamp>,
    /// Now, for new condition transition times.
    pub now: Timestamp,
}

/// The desired status.
pub fn desired_status(input: StatusInput<'_>) -> ProxyStatus {
    let record = StateRecord::from(input.state.clone());
    let phase = record.phase;
    let (provisioned, provisioned_reason) = match phase {
        Phase::Healthy | Phase::Degraded => ("True", "InstanceRunning"),
        Phase::Provisioning if input.instance_running => ("True", "InstanceRunning"),
        Phase::Provisioning => ("False", "InstanceStarting"),
        Phase::Replacing => ("False", "Replacing"),
        Phase::Deleting | Phase::Deleted => ("False", "Deleting"),
        Phase::Pending => ("False", "NotProvisioned"),
    };
    let (healthy, healthy_reason) = match phase {
        Phase::Healthy => ("True", "HealthCheckPassing"),
        Phase::Degraded => ("False", "HealthCheckFailing"),
        _ => ("Unknown", "NotChecked"),
    };
    let ready = if phase == Phase::Healthy { "True" } else { "False" };
    let previous = &input.previous.conditions;
    let conditions = vec![
        condition(
            previous,
            READY,
            ready,
            input.reason,
            input.message,
            input.generation,
            input.now,
        ),
        condition(
            previous,
            PROVISIONED,
            provisioned,
            provisioned_reason,
            "",
            input.generation,
            input.now,
        ),
        condition(
            previous,
            HEALTHY,
            healthy,
            healthy_reason,
            "",
            input.generation,
            input.now,
        ),
    ];
    ProxyStatus {
        phase: Some(phase.as_str().to_owned()),
        phase_since: record.since.map(Time),
        create_attempts: record.attempts.map(|a| i32::try_from(a).unwrap_or(i32::MAX)),
        conditions,
        observed_generation: input.generation,
        spec_hash: input.spec_hash,
        provider_id: input.provider_id,
        endpoint: input.endpoint,
        last_health_check_time: input
            .last_health_check_time
            .map(Time)
            .or_else(|| input.previous.last_health_check_time.clone()),
    }
}

/// A condition; its transition time moves only when its status does.
fn condition(
    previous: &[Condition],
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// The machine state a stored status describes (`Pending` for a new Proxy or an unreadable
/// status, which restarts the lifecycle idempotently).
pub fn state_from_status(status: Option<&ProxyStatus>) -> Result<State, String> {
    let Some(status) = status else {
        return Ok(State::default());
    };
    let Some(phase) = status.phase.as_deref() else {
        return Ok(State::default());
    };
    let phase = Phase::from_name(phase).ok_or_else(|| format!("unknown phase {phase:?} in status"))?;
    let record = StateRecord {
        phase,
        since: status.phase_since.as_ref().map(|t| t.0),
        attempts: status.create_attempts.map(|a| u32::try_from(a).unwrap_or(0)),
    };
    State::try_from(record).map_err(|e| e.to_string())
}

/// The stored `Ready` condition, if any.
pub fn ready_condition(status: Option<&ProxyStatus>) -> Option<&Condition> {
    status?.conditions.iter().find(|c| c.type_ == READY)
}
