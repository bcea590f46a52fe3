//! The Proxy transition table, compiled: generated types plus the hand-written types they use.
//!
//! build.rs turns `machines/proxy.yaml` into `$OUT_DIR/proxy_machine.rs`, included here (the
//! templates are in build/generate.rs). It holds [`Fact`], [`Phase`], [`Event`] (in priority
//! order), [`EffectKind`], [`TimerKind`], [`State`], the [`reason`] constants, the statig machine
//! (one `#[state]` handler per table state, each a `match event` over the rows) and the static
//! metadata [`ROWS`], [`EVENTS`], [`STATES`], [`EFFECTS`]. This
//! module owns the types that generated code refers to: [`Facts`], [`Literal`], [`Row`],
//! [`EventInfo`], [`StateInfo`], [`EffectInfo`], [`DecideCtx`] and the persisted form
//! [`StateRecord`].

use std::borrow::Cow;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

include!(concat!(env!("OUT_DIR"), "/proxy_machine.rs"));

/// The facts of one observation: one bit per [`Fact`].
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Facts(u32);

impl Facts {
    /// No fact holds.
    pub const NONE: Facts = Facts(0);

    /// Facts from a bit set (bit `i` is `Fact::ALL[i]`); property tests enumerate these.
    pub const fn from_bits(bits: u32) -> Facts {
        Facts(bits)
    }

    /// The bit set.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether `fact` holds.
    pub const fn get(self, fact: Fact) -> bool {
        self.0 & (1 << fact as u32) != 0
    }

    /// Sets `fact` to `holds`.
    pub fn set(&mut self, fact: Fact, holds: bool) {
        if holds {
            self.0 |= 1 << fact as u32;
        } else {
            self.0 &= !(1 << fact as u32);
        }
    }

    /// These facts with `fact` set to `holds`.
    pub fn with(mut self, fact: Fact, holds: bool) -> Facts {
        self.set(fact, holds);
        self
    }

    /// Whether every literal holds.
    pub fn all(self, literals: &[Literal]) -> bool {
        literals.iter().all(|l| self.get(l.fact) == l.holds)
    }

    /// The facts that hold, in table order.
    pub fn holding(self) -> impl Iterator<Item = Fact> {
        Fact::ALL.into_iter().filter(move |f| self.get(*f))
    }
}

impl std::fmt::Debug for Facts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.holding().map(Fact::as_str)).finish()
    }
}

/// `fact` (holds) or `not fact` (does not hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Literal {
    /// The fact.
    pub fact: Fact,
    /// Whether it must hold.
    pub holds: bool,
}

impl std::fmt::Display for Literal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.holds {
            f.write_str(self.fact.as_str())
        } else {
            write!(f, "not {}", self.fact.as_str())
        }
    }
}

/// Literals as the table writes them: `a, not b`.
pub fn format_literals(literals: &[Literal]) -> String {
    literals
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One transition row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Position in the table (and in [`ROWS`]).
    pub index: usize,
    /// Source phase.
    pub from: Phase,
    /// The event that triggers the row.
    pub on: Event,
    /// Facts that must all hold; empty for the unguarded (fallback) row.
    pub guard: &'static [Literal],
    /// Target phase.
    pub to: Phase,
    /// A self-transition that restarts the state's timer.
    pub reenter: bool,
    /// Effects to carry out, in order.
    pub effects: &'static [EffectKind],
    /// Bounded CamelCase reason for conditions and Kubernetes Events.
    pub reason: &'static str,
    /// Why the row exists.
    pub note: &'static str,
}

/// What raises an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventInfo {
    /// The event.
    pub event: Event,
    /// Derive raises it when all of these hold (empty: derive never does).
    pub when: &'static [Literal],
    /// Executors of these effects raise it.
    pub raised_by: &'static [EffectKind],
}

/// The declared outcomes of a state for events without a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateInfo {
    /// The state.
    pub phase: Phase,
    /// Events that are expected but meaningless here.
    pub ignore: &'static [Event],
    /// Events that cannot happen here.
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
    if state_info(phase).ignore.contains(&event) {
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

/// What raises `event`.
pub fn event_info(event: Event) -> &'static EventInfo {
    EVENTS
        .iter()
        .find(|e| e.event == event)
        .expect("invariant: build.rs emits one EventInfo per event")
}

/// The context the generated handlers read and write while deciding one event.
///
/// Handlers get the clock and the facts from here (they are pure) and report which row matched or
/// that they ignored the event, so [`decide`](super::decide) can return that row's effects and
/// reason. statig's machine does not hand back a handler's outcome; this context is how statig
/// expects results to leave a handler.
#[derive(Debug)]
pub struct DecideCtx {
    now: Timestamp,
    facts: Facts,
    matched: Option<&'static Row>,
    ignored: bool,
}

impl DecideCtx {
    pub(crate) fn new(now: Timestamp, facts: Facts) -> Self {
        DecideCtx {
            now,
            facts,
            matched: None,
            ignored: false,
        }
    }

    /// The time of the decision (the new `since` of a state change).
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// Whether every guard literal holds.
    pub fn holds(&self, literals: &[Literal]) -> bool {
        self.facts.all(literals)
    }

    pub(crate) fn matched(&mut self, row: &'static Row) {
        self.matched = Some(row);
    }

    pub(crate) fn matched_row(&self) -> Option<&'static Row> {
        self.matched
    }

    pub(crate) fn ignored(&mut self) {
        self.ignored = true;
    }

    pub(crate) fn was_ignored(&self) -> bool {
        self.ignored
    }
}

/// The persisted, flat form of [`State`]: what the Proxy status stores.
///
/// Flat rather than an internally tagged enum so that the CRD schema stays structural (Kubernetes
/// rejects `oneOf` branches that declare their own properties).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct StateRecord {
    /// The lifecycle phase.
    pub phase: Phase,
    /// When the phase was entered (RFC 3339).
    #[schemars(with = "String")]
    pub since: Timestamp,
}

impl From<State> for StateRecord {
    fn from(state: State) -> StateRecord {
        StateRecord {
            phase: state.phase(),
            since: state.since(),
        }
    }
}

impl From<StateRecord> for State {
    fn from(record: StateRecord) -> State {
        State::new(record.phase, record.since)
    }
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

impl std::fmt::Display for Fact {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
