//! **derive** (pure): the event a state should decide next, given the facts.
//!
//! Nothing here is hand-written lifecycle logic: it reads the table's `events` section (each
//! event's `when` literals, in priority order) and the state's `ignore` list. The first event whose
//! facts all hold and that the state does not ignore is the one to decide. The build rejects a
//! table in which a state declares a fact-raised event `invalid`, so derive can only yield events
//! the state has rows for; `tests/machine_properties.rs` checks that over every fact combination.

use super::table::{EVENTS, Event, Facts, Phase, state_info};

/// The highest-priority event `facts` raise that `phase` handles with a row, if any.
pub fn derive(phase: Phase, facts: Facts) -> Option<Event> {
    let ignored = state_info(phase).ignore;
    EVENTS
        .iter()
        .filter(|info| !info.when.is_empty() && facts.all(info.when))
        .map(|info| info.event)
        .find(|event| !ignored.contains(event))
}
