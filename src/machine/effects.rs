//! The kinds of side effect a transition asks for.
//!
//! Hand-written on purpose: the generated code names `EffectKind::CreateInstance` for the table's
//! `create_instance`, so an effect the table invents without a Rust variant fails to compile, and the
//! executors (which `match` on this enum) fail to compile when a variant is added without them.
//! Parameters (durations, lease ids, ...) are not here: executors map a kind to a concrete action
//! with their configuration.

use serde::{Deserialize, Serialize};

/// One side effect requested by a transition, in the order the row lists it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum EffectKind {
    /// Add the operator's finalizer to the Proxy so deletion waits for cleanup.
    AddFinalizer,
    /// Create the provider instance for the current spec (idempotent per owner UID).
    CreateInstance,
    /// Delete the provider instance (idempotent; NotFound is success).
    DeleteInstance,
    /// Let the discovery API hand out new leases on this proxy.
    EnableLeases,
    /// Stop handing out new leases; existing leases keep running.
    DisableLeases,
    /// Ask holders to finish; existing leases are not renewed and expire.
    DrainLeases,
    /// Revoke every lease on this proxy at once.
    RevokeLeases,
    /// Write phase and conditions to the status.
    SetConditions,
    /// Record a Kubernetes Event (or a store entry) with the row's reason.
    RecordEvent,
    /// Count a failed provider call and schedule the next attempt.
    ScheduleRetry,
    /// Forget the failed provider calls.
    ClearRetry,
    /// Remove the operator's finalizer so Kubernetes can delete the Proxy.
    RemoveFinalizer,
}

impl EffectKind {
    /// Every kind, in declaration order.
    pub const ALL: [EffectKind; 12] = [
        EffectKind::AddFinalizer,
        EffectKind::CreateInstance,
        EffectKind::DeleteInstance,
        EffectKind::EnableLeases,
        EffectKind::DisableLeases,
        EffectKind::DrainLeases,
        EffectKind::RevokeLeases,
        EffectKind::SetConditions,
        EffectKind::RecordEvent,
        EffectKind::ScheduleRetry,
        EffectKind::ClearRetry,
        EffectKind::RemoveFinalizer,
    ];

    /// The snake_case name used in the table and the audit trail.
    pub const fn as_str(self) -> &'static str {
        match self {
            EffectKind::AddFinalizer => "add_finalizer",
            EffectKind::CreateInstance => "create_instance",
            EffectKind::DeleteInstance => "delete_instance",
            EffectKind::EnableLeases => "enable_leases",
            EffectKind::DisableLeases => "disable_leases",
            EffectKind::DrainLeases => "drain_leases",
            EffectKind::RevokeLeases => "revoke_leases",
            EffectKind::SetConditions => "set_conditions",
            EffectKind::RecordEvent => "record_event",
            EffectKind::ScheduleRetry => "schedule_retry",
            EffectKind::ClearRetry => "clear_retry",
            EffectKind::RemoveFinalizer => "remove_finalizer",
        }
    }

    /// Whether carrying this effect out twice is the same as carrying it out once.
    ///
    /// Everything is, except `CreateInstance` and `ScheduleRetry` (which counts a failure):
    /// providers promise idempotent creates, but the engine does not lean on it. It asks for a
    /// second create only on evidence that there is no instance (`instance_missing`) or after a
    /// failure (`retry_due`), which the replay property test checks.
    /// (`RecordEvent` twice is two identical Events, which Kubernetes aggregates.)
    pub const fn is_idempotent(self) -> bool {
        !matches!(self, EffectKind::CreateInstance | EffectKind::ScheduleRetry)
    }
}

impl std::fmt::Display for EffectKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
