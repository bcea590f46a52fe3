//! Guards: the named conditions of the transition table, as plain functions.
//!
//! The generated handlers call `guards::<name>(input, data)`, so a guard the table names but this
//! module lacks fails to compile; build.rs also checks the names against the table's `guards:`
//! section. Guards are pure: they read the controller's observations ([`GuardInput`]) and the
//! current state's data ([`StateData`]), never a clock or a client.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// What the controller observed that guards may depend on (besides the state itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GuardInput {
    /// How many `create_instance` effects one provisioning episode may issue.
    pub max_create_attempts: u32,
    /// Leases currently held on this proxy.
    pub active_leases: u32,
}

impl GuardInput {
    /// Default for `max_create_attempts`.
    pub const DEFAULT_MAX_CREATE_ATTEMPTS: u32 = 3;
}

impl Default for GuardInput {
    fn default() -> Self {
        GuardInput {
            max_create_attempts: Self::DEFAULT_MAX_CREATE_ATTEMPTS,
            active_leases: 0,
        }
    }
}

/// A uniform view of the current state's local data (fields a state lacks read as `None` / 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateData {
    /// When the current state was entered.
    pub since: Option<Timestamp>,
    /// `create_instance` effects issued since the current state was entered.
    pub attempts: u32,
}

/// Fewer create attempts in this provisioning episode than `max_create_attempts`.
pub fn attempts_left(input: &GuardInput, data: &StateData) -> bool {
    data.attempts < input.max_create_attempts
}

/// At least one lease on this proxy is active.
pub fn leases_active(input: &GuardInput, _data: &StateData) -> bool {
    input.active_leases > 0
}
