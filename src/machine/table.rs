//! The Proxy transition table, compiled: generated types plus the hand-written types they use.
//!
//! build.rs turns `machines/proxy.yaml` into `$OUT_DIR/proxy_machine.rs`, included here. It holds
//! [`Phase`], [`Event`], [`State`], the statig machine (one `#[state]` handler per table state,
//! each a `match event` over the rows) and the static metadata [`ROWS`], [`STATES`], [`EFFECTS`],
//! [`GUARDS`]. This module owns the types that generated code refers to: [`Row`], [`StateInfo`],
//! [`EffectInfo`], [`GuardInfo`], [`DecideCtx`] and the persisted form [`StateRecord`].

use std::borrow::Cow;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::effects::EffectKind;
use super::guards::{self, GuardInput, StateData};

include!(concat!(env!("OUT_DIR"), "/proxy_machine.rs"));

/// One transition row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Position in the table (and in [`ROWS`]).
    pub index: usize,
    /// Source phase.
    pub from: Phase,
    /// The event that triggers the row.
    pub on: Event,
    /// The guard that must hold; `None` for the unguarded (fallback) row.
    pub guard: Option<&'static str>,
    /// Target phase.
    pub to: Phase,
    /// Effects to carry out, in order.
    pub effects: &'static [EffectKind],
    /// Bounded CamelCase reason for conditions and Kubernetes Events.
    pub reason: &'static str,
    /// Why the row exists.
    pub note: &'static str,
}

/// The declared outcomes of a state for events without a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateInfo {
    /// The state.
    pub phase: Phase,
    /// Events that are expected but meaningless here.
    pub ignore: &'static [Event],
    /// Events the controller must never derive here.
    pub invalid: &'static [Event],
}

/// An effect as documented in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EffectInfo {
    /// The Rust kind.
    pub kind: EffectKind,
    /// The name in the table (equals `kind.as_str()`, checked by a test).
    pub name: &'static str,
    /// One-line doc.
    pub doc: &'static str,
}

/// A guard as documented in the table, with its implementation.
#[derive(Clone, Copy, Debug)]
pub struct GuardInfo {
    /// The name in the table.
    pub name: &'static str,
    /// One-line doc.
    pub doc: &'static str,
    /// The function in [`guards`].
    pub check: fn(&GuardInput, &StateData) -> bool,
}

/// How the table covers a (phase, event) pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// Transition rows, guarded ones first, the unguarded fallback last.
    Rows(Vec<&'static Row>),
    /// Listed under `ignore`.
    Ignored,
    /// Listed under `invalid`.
    Invalid,
}

/// How the table covers `event` in `phase` (build.rs guarantees exactly one of the three).
pub fn coverage(phase: Phase, event: Event) -> Coverage {
    let rows: Vec<&'static Row> = ROWS.iter().filter(|r| r.from == phase && r.on == event).collect();
    if !rows.is_empty() {
        return Coverage::Rows(rows);
    }
    let info = state_info(phase);
    if info.ignore.contains(&event) {
        Coverage::Ignored
    } else {
        Coverage::Invalid
    }
}

/// The ignore / invalid lists of `phase`.
pub fn state_info(phase: Phase) -> &'static StateInfo {
    STATES
        .iter()
        .find(|s| s.phase == phase)
        .expect("invariant: build.rs emits one StateInfo per phase")
}

/// The context the generated handlers read and write while deciding one event.
///
/// Handlers get the clock and the observations from here (they are pure) and report which row
/// matched, so [`decide`](super::decide) can return that row's effects and reason.
#[derive(Debug)]
pub struct DecideCtx {
    now: Timestamp,
    input: GuardInput,
    matched: Option<&'static Row>,
}

impl DecideCtx {
    pub(crate) fn new(now: Timestamp, input: GuardInput) -> Self {
        DecideCtx {
            now,
            input,
            matched: None,
        }
    }

    /// The time of the decision (the new `since` of a state change).
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// The observations guards read.
    pub fn input(&self) -> &GuardInput {
        &self.input
    }

    pub(crate) fn matched(&mut self, row: &'static Row) {
        self.matched = Some(row);
    }

    pub(crate) fn matched_row(&self) -> Option<&'static Row> {
        self.matched
    }
}

/// The persisted, flat form of [`State`]: what the Proxy status stores.
///
/// Flat rather than an internally tagged enum so that the CRD schema stays structural (Kubernetes
/// rejects `oneOf` branches that declare their own properties). `since` and `attempts` are present
/// exactly when the phase has them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct StateRecord {
    /// The lifecycle phase.
    pub phase: Phase,
    /// When the phase was entered (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub since: Option<Timestamp>,
    /// Create attempts in the current provisioning episode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
}

/// A persisted state that cannot be rehydrated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateRecordError {
    /// The phase needs a data field the record lacks.
    #[error("state `{}` needs the field `{field}`", phase.as_str())]
    MissingField {
        /// The phase of the record.
        phase: Phase,
        /// The missing field.
        field: &'static str,
    },
}

impl schemars::JsonSchema for State {
    fn schema_name() -> Cow<'static, str> {
        // The serialized form is the record's, so is the schema.
        StateRecord::schema_name()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        StateRecord::json_schema(generator)
    }
}

impl Default for State {
    fn default() -> Self {
        <ProxyMachine as statig::blocking::IntoStateMachine>::initial()
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
