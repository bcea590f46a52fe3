//! The transition table as build.rs reads it: the YAML schema, and the validation that makes the
//! build fail with a message naming the offending row on an unknown name, an uncovered or doubly
//! covered (state, event) pair, guarded rows without an unguarded fallback, an event raised by
//! facts that a state declares invalid, or an effect-raised event a state handles although none of
//! its incoming rows runs the effect.
//!
//! A module of the build script (see build.rs); tests/machine_table_validation.rs includes it too,
//! to check the messages on edited copies of machines/proxy.yaml.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Table {
    pub(crate) machine: String,
    pub(crate) initial: String,
    pub(crate) facts: Vec<Named>,
    pub(crate) states: Vec<StateDef>,
    pub(crate) events: Vec<EventDef>,
    pub(crate) effects: Vec<Named>,
    pub(crate) timers: Vec<TimerDef>,
    /// Reasons whose Kubernetes Events are of type Warning.
    pub(crate) warnings: Vec<String>,
    pub(crate) transitions: Vec<Row>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StateDef {
    pub(crate) name: String,
    pub(crate) doc: String,
    #[serde(default)]
    pub(crate) timer: Option<String>,
    #[serde(default, rename = "final")]
    pub(crate) is_final: bool,
    #[serde(default)]
    pub(crate) ignore: Vec<String>,
    #[serde(default)]
    pub(crate) invalid: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Named {
    pub(crate) name: String,
    pub(crate) doc: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventDef {
    pub(crate) name: String,
    pub(crate) doc: String,
    /// Fact literals (`fact` or `not fact`) that must all hold for derive to raise the event.
    #[serde(default)]
    pub(crate) when: Vec<String>,
    /// Effects whose executors raise the event.
    #[serde(default)]
    pub(crate) raised_by: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TimerDef {
    pub(crate) name: String,
    pub(crate) doc: String,
    pub(crate) default_seconds: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Row {
    pub(crate) from: String,
    pub(crate) on: String,
    /// Fact literals that must all hold for the row to match.
    #[serde(default)]
    pub(crate) guard: Vec<String>,
    pub(crate) to: String,
    #[serde(default)]
    pub(crate) reenter: bool,
    pub(crate) effects: Vec<String>,
    pub(crate) reason: String,
    pub(crate) note: String,
}

pub(crate) fn row_label(index: usize, row: &Row) -> String {
    if row.guard.is_empty() {
        format!("transition #{index} ({} --{}--> {})", row.from, row.on, row.to)
    } else {
        format!(
            "transition #{index} ({} --{} [{}]--> {})",
            row.from,
            row.on,
            row.guard.join(", "),
            row.to
        )
    }
}

fn is_snake(name: &str) -> bool {
    !name.is_empty()
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn is_camel(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_uppercase()) && name.chars().all(|c| c.is_ascii_alphanumeric())
}

/// `fact` or `not fact` into (fact, holds).
pub(crate) fn literal(text: &str) -> (&str, bool) {
    match text.strip_prefix("not ") {
        Some(fact) => (fact.trim(), false),
        None => (text.trim(), true),
    }
}

/// Parse and validate a table; the errors name the offending rows. `pub(crate)` so that
/// tests/machine_table_validation.rs can include this file and check the messages.
pub(crate) fn load_table(text: &str) -> Result<Table, Vec<String>> {
    let table: Table = serde_norway::from_str(text).map_err(|e| vec![format!("not a valid table: {e}")])?;
    validate(&table)?;
    Ok(table)
}

fn validate(t: &Table) -> Result<(), Vec<String>> {
    let mut errors = Vec::new();

    if !is_snake(&t.machine) {
        errors.push(format!("machine name `{}` must be snake_case", t.machine));
    }

    let mut check_names = |kind: &str, names: Vec<(&str, &str)>| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        for (name, doc) in names {
            if !is_snake(name) {
                errors.push(format!("{kind} `{name}` must be snake_case"));
            }
            if doc.trim().is_empty() {
                errors.push(format!("{kind} `{name}` needs a one-line doc"));
            }
            if doc.contains('\n') {
                errors.push(format!("{kind} `{name}`: the doc must be one line"));
            }
            if !seen.insert(name.to_owned()) {
                errors.push(format!("{kind} `{name}` is declared twice"));
            }
        }
        seen
    };
    let facts = check_names(
        "fact",
        t.facts
            .iter()
            .map(|s| (s.name.as_str(), s.doc.as_str()))
            .collect(),
    );
    let states = check_names(
        "state",
        t.states
            .iter()
            .map(|s| (s.name.as_str(), s.doc.as_str()))
            .collect(),
    );
    let events = check_names(
        "event",
        t.events
            .iter()
            .map(|s| (s.name.as_str(), s.doc.as_str()))
            .collect(),
    );
    let effects = check_names(
        "effect",
        t.effects
            .iter()
            .map(|s| (s.name.as_str(), s.doc.as_str()))
            .collect(),
    );
    let timers = check_names(
        "timer",
        t.timers
            .iter()
            .map(|s| (s.name.as_str(), s.doc.as_str()))
            .collect(),
    );
    let list = |set: &BTreeSet<String>| set.iter().cloned().collect::<Vec<_>>().join(", ");
    if t.facts.len() > 32 {
        errors.push(format!(
            "at most 32 facts (a `u32` bit set); the table has {}",
            t.facts.len()
        ));
    }

    match t.states.iter().find(|s| s.name == t.initial) {
        None => errors.push(format!(
            "initial state `{}` is not declared; states: {}",
            t.initial,
            list(&states)
        )),
        Some(s) if s.is_final => errors.push(format!("initial state `{}` must not be final", t.initial)),
        Some(_) => {}
    }
    if !t.states.iter().any(|s| s.is_final) {
        errors.push("declare one state with `final: true` (the end of the deletion path)".to_owned());
    }

    let check_literals = |errors: &mut Vec<String>, context: &str, literals: &[String]| {
        let mut seen = BTreeSet::new();
        for text in literals {
            let (fact, _) = literal(text);
            if !facts.contains(fact) {
                errors.push(format!(
                    "{context}: unknown fact `{fact}`; facts: {}",
                    list(&facts)
                ));
            }
            if !seen.insert(fact.to_owned()) {
                errors.push(format!("{context}: fact `{fact}` listed twice"));
            }
        }
    };

    let mut used_facts = BTreeSet::new();
    let mut used_effects = BTreeSet::new();
    for e in &t.events {
        let context = format!("event `{}`", e.name);
        check_literals(&mut errors, &context, &e.when);
        used_facts.extend(e.when.iter().map(|l| literal(l).0.to_owned()));
        if e.when.is_empty() && e.raised_by.is_empty() {
            errors.push(format!(
                "{context}: say what raises it: facts under `when`, effects under `raised_by`, or both"
            ));
        }
        for effect in &e.raised_by {
            if !effects.contains(effect) {
                errors.push(format!(
                    "{context}: `raised_by` lists unknown effect `{effect}`; effects: {}",
                    list(&effects)
                ));
            }
        }
    }

    // (state, event) -> where it is covered.
    let mut coverage: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for s in &t.states {
        if let Some(timer) = &s.timer
            && !timers.contains(timer)
        {
            errors.push(format!(
                "state `{}`: unknown timer `{timer}`; timers: {}",
                s.name,
                list(&timers)
            ));
        }
        for (kind, names) in [("ignore", &s.ignore), ("invalid", &s.invalid)] {
            for e in names {
                if !events.contains(e) {
                    errors.push(format!(
                        "state `{}`: `{kind}` lists unknown event `{e}`; events: {}",
                        s.name,
                        list(&events)
                    ));
                }
                coverage
                    .entry((s.name.clone(), e.clone()))
                    .or_default()
                    .push(format!("`{kind}`"));
            }
        }
        for e in &s.invalid {
            if t.events.iter().any(|ev| &ev.name == e && !ev.when.is_empty()) {
                errors.push(format!(
                    "state `{}`: event `{e}` is raised by facts, which can hold in any state: \
                     give it rows or list it under `ignore`, not `invalid`",
                    s.name
                ));
            }
        }
    }

    let mut used_events = BTreeSet::new();
    // (from, on) -> row indexes, in table order.
    let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
    for (i, row) in t.transitions.iter().enumerate() {
        let label = row_label(i, row);
        if !states.contains(&row.from) {
            errors.push(format!(
                "{label}: unknown state `{}` in `from`; states: {}",
                row.from,
                list(&states)
            ));
        }
        if !states.contains(&row.to) {
            errors.push(format!(
                "{label}: unknown state `{}` in `to`; states: {}",
                row.to,
                list(&states)
            ));
        }
        if !events.contains(&row.on) {
            errors.push(format!(
                "{label}: unknown event `{}`; events: {}",
                row.on,
                list(&events)
            ));
        }
        if t.states.iter().any(|s| s.name == row.from && s.is_final) {
            errors.push(format!(
                "{label}: the final state `{}` cannot have transitions",
                row.from
            ));
        }
        check_literals(&mut errors, &label, &row.guard);
        used_facts.extend(row.guard.iter().map(|l| literal(l).0.to_owned()));
        if row.reenter {
            let has_timer = t.states.iter().any(|s| s.name == row.from && s.timer.is_some());
            if row.from != row.to || !has_timer {
                errors.push(format!(
                    "{label}: `reenter` restarts a timer: only on a self-transition of a state with a timer"
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for e in &row.effects {
            if !effects.contains(e) {
                errors.push(format!(
                    "{label}: unknown effect `{e}`; effects: {}",
                    list(&effects)
                ));
            }
            if !seen.insert(e) {
                errors.push(format!("{label}: effect `{e}` listed twice"));
            }
            used_effects.insert(e.clone());
        }
        if !is_camel(&row.reason) {
            errors.push(format!("{label}: reason `{}` must be CamelCase", row.reason));
        }
        if row.note.trim().is_empty() || row.note.contains('\n') {
            errors.push(format!("{label}: needs a one-line `note` saying why"));
        }
        used_events.insert(row.on.clone());
        groups
            .entry((row.from.clone(), row.on.clone()))
            .or_default()
            .push(i);
    }

    for ((from, on), rows) in &groups {
        coverage
            .entry((from.clone(), on.clone()))
            .or_default()
            .push("transition rows".to_owned());
        let (last, guarded) = rows.split_last().expect("a group has at least one row");
        if !t.transitions[*last].guard.is_empty() {
            errors.push(format!(
                "{}: guarded rows for ({from}, {on}) must end with an unguarded fallback row",
                row_label(*last, &t.transitions[*last])
            ));
        }
        let mut seen_guards = BTreeSet::new();
        for i in guarded {
            let row = &t.transitions[*i];
            if row.guard.is_empty() {
                errors.push(format!(
                    "{}: only the last row for ({from}, {on}) may be unguarded; rows after it are unreachable",
                    row_label(*i, row)
                ));
            } else if !seen_guards.insert(row.guard.clone()) {
                errors.push(format!(
                    "{}: guard repeated for ({from}, {on}); the later row is unreachable",
                    row_label(*i, row)
                ));
            }
        }
        // An event only effects raise can happen in a state only right after a row into it ran
        // one of those effects.
        if let Some(event) = t.events.iter().find(|e| &e.name == on)
            && event.when.is_empty()
        {
            let reachable = t
                .transitions
                .iter()
                .any(|r| &r.to == from && r.effects.iter().any(|e| event.raised_by.contains(e)));
            if !reachable {
                errors.push(format!(
                    "state `{from}` has rows for `{on}`, which only {} raise(s), but no row into `{from}` runs it: \
                     the rows are unreachable (declare the event `invalid` there)",
                    event.raised_by.join(" / ")
                ));
            }
        }
    }

    for s in &t.states {
        for e in &t.events {
            match coverage.get(&(s.name.clone(), e.name.clone())) {
                None => errors.push(format!(
                    "state `{}` does not cover event `{}`: add a transition row, or list it under `ignore` or `invalid`",
                    s.name, e.name
                )),
                Some(by) if by.len() > 1 => errors.push(format!(
                    "state `{}`, event `{}` is covered more than once: {}",
                    s.name,
                    e.name,
                    by.join(" and ")
                )),
                Some(_) => {}
            }
        }
    }

    let reasons: BTreeSet<&str> = t.transitions.iter().map(|r| r.reason.as_str()).collect();
    for warning in &t.warnings {
        if !reasons.contains(warning.as_str()) {
            errors.push(format!(
                "`warnings` lists `{warning}`, which no transition row gives as its reason"
            ));
        }
    }
    let used_timers: BTreeSet<String> = t.states.iter().filter_map(|s| s.timer.clone()).collect();
    for (kind, declared, used) in [
        ("event", &events, &used_events),
        ("effect", &effects, &used_effects),
        ("fact", &facts, &used_facts),
        ("timer", &timers, &used_timers),
    ] {
        for name in declared.difference(used) {
            errors.push(format!("{kind} `{name}` is declared but nothing uses it"));
        }
    }

    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

pub(crate) fn camel(snake: &str) -> String {
    snake
        .split('_')
        .map(|part| {
            let mut chars = part.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect()
}

/// `SpecChanged` -> `SPEC_CHANGED`.
pub(crate) fn shouty(camel_name: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel_name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}
