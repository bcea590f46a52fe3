//! The kinds of side effect a transition asks for: [`EffectKind`], generated from the table's
//! `effects` section (names and docs), plus what the engine knows about each kind.
//!
//! The planner (`controller::plan`) matches on [`EffectKind`] without a wildcard, so an effect the
//! table adds without a plan and an executor fails to compile. Parameters (durations, lease ids,
//! ...) are not here: the planner maps a kind to a concrete action with its configuration.

pub use super::table::EffectKind;

impl EffectKind {
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
