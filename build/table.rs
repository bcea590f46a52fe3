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
    pub(crate) effects: Vec<EffectDef>,
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
pub(crate) struct EffectDef {
    pub(crate) name: String,
    pub(crate) doc: String,
    /// The events whose rows may run it (its value comes from the event); empty: any.
    #[serde(default)]
    pub(crate) only_on: Vec<String>,
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

/// Every rule, section by section; the errors keep table order within a section.
fn validate(t: &Table) -> Result<(), Vec<String>> {
    let mut check = Check::declarations(t);
    check.events(t);
    let mut coverage = check.states(t);
    let groups = check.rows(t);
    check.groups(t, &groups, &mut coverage);
    check.coverage(t, &coverage);
    check.unused(t);
    if check.errors.is_empty() {
        Ok(())
    } else {
        Err(check.errors)
    }
}

/// (state, event) -> what covers it (`ignore`, `invalid`, transition rows).
type CoverageMap = BTreeMap<(String, String), Vec<String>>;

/// The problems found so far, and the declared names of each kind.
struct Check {
    errors: Vec<String>,
    facts: BTreeSet<String>,
    states: BTreeSet<String>,
    events: BTreeSet<String>,
    effects: BTreeSet<String>,
    timers: BTreeSet<String>,
}

/// `a, b, c`: the known names, for an error about an unknown one.
fn list(set: &BTreeSet<String>) -> String {
    set.iter().cloned().collect::<Vec<_>>().join(", ")
}

impl Check {
    /// Names are snake_case, documented in one line and declared once; one initial and one final state.
    fn declarations(t: &Table) -> Check {
        let mut errors = Vec::new();
        if !is_snake(&t.machine) {
            errors.push(format!("machine name `{}` must be snake_case", t.machine));
        }
        let mut names = |kind: &str, items: Vec<(&String, &String)>| -> BTreeSet<String> {
            let mut seen = BTreeSet::new();
            for (name, doc) in items {
                if !is_snake(name) {
                    errors.push(format!("{kind} `{name}` must be snake_case"));
                }
                if doc.trim().is_empty() {
                    errors.push(format!("{kind} `{name}` needs a one-line doc"));
                }
                if doc.contains('\n') {
                    errors.push(format!("{kind} `{name}`: the doc must be one line"));
                }
                if !seen.insert(name.clone()) {
                    errors.push(format!("{kind} `{name}` is declared twice"));
                }
            }
            seen
        };
        let facts = names("fact", t.facts.iter().map(|x| (&x.name, &x.doc)).collect());
        let states = names("state", t.states.iter().map(|x| (&x.name, &x.doc)).collect());
        let events = names("event", t.events.iter().map(|x| (&x.name, &x.doc)).collect());
        let effects = names("effect", t.effects.iter().map(|x| (&x.name, &x.doc)).collect());
        let timers = names("timer", t.timers.iter().map(|x| (&x.name, &x.doc)).collect());
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
        Check {
            errors,
            facts,
            states,
            events,
            effects,
            timers,
        }
    }

    /// Fact literals (`fact` / `not fact`) name declared facts, each once.
    fn literals(&mut self, context: &str, literals: &[String]) {
        let mut seen = BTreeSet::new();
        for text in literals {
            let (fact, _) = literal(text);
            if !self.facts.contains(fact) {
                let known = list(&self.facts);
                self.errors
                    .push(format!("{context}: unknown fact `{fact}`; facts: {known}"));
            }
            if !seen.insert(fact.to_owned()) {
                self.errors.push(format!("{context}: fact `{fact}` listed twice"));
            }
        }
    }

    /// Every event says what raises it: facts, effects, or both.
    fn events(&mut self, t: &Table) {
        for e in &t.events {
            let context = format!("event `{}`", e.name);
            self.literals(&context, &e.when);
            if e.when.is_empty() && e.raised_by.is_empty() {
                self.errors.push(format!(
                    "{context}: say what raises it: facts under `when`, effects under `raised_by`, or both"
                ));
            }
            for effect in &e.raised_by {
                if !self.effects.contains(effect) {
                    self.errors.push(format!(
                        "{context}: `raised_by` lists unknown effect `{effect}`; effects: {}",
                        list(&self.effects)
                    ));
                }
            }
        }
    }

    /// States name known timers and events; returns what their `ignore` / `invalid` lists cover.
    fn states(&mut self, t: &Table) -> CoverageMap {
        let mut coverage = CoverageMap::new();
        for s in &t.states {
            if let Some(timer) = &s.timer
                && !self.timers.contains(timer)
            {
                self.errors.push(format!(
                    "state `{}`: unknown timer `{timer}`; timers: {}",
                    s.name,
                    list(&self.timers)
                ));
            }
            for (kind, names) in [("ignore", &s.ignore), ("invalid", &s.invalid)] {
                for e in names {
                    if !self.events.contains(e) {
                        self.errors.push(format!(
                            "state `{}`: `{kind}` lists unknown event `{e}`; events: {}",
                            s.name,
                            list(&self.events)
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
                    self.errors.push(format!(
                        "state `{}`: event `{e}` is raised by facts, which can hold in any state: \
                         give it rows or list it under `ignore`, not `invalid`",
                        s.name
                    ));
                }
            }
        }
        coverage
    }

    /// Each row on its own; returns the row indexes per (from, on), in table order.
    fn rows(&mut self, t: &Table) -> BTreeMap<(String, String), Vec<usize>> {
        let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
        for def in &t.effects {
            for event in def.only_on.iter().filter(|e| !self.events.contains(*e)) {
                self.errors.push(format!(
                    "effect `{}`: `only_on` lists unknown event `{event}`; events: {}",
                    def.name,
                    list(&self.events)
                ));
            }
        }
        for (i, row) in t.transitions.iter().enumerate() {
            let label = row_label(i, row);
            for (field, state) in [("from", &row.from), ("to", &row.to)] {
                if !self.states.contains(state) {
                    self.errors.push(format!(
                        "{label}: unknown state `{state}` in `{field}`; states: {}",
                        list(&self.states)
                    ));
                }
            }
            if !self.events.contains(&row.on) {
                self.errors.push(format!(
                    "{label}: unknown event `{}`; events: {}",
                    row.on,
                    list(&self.events)
                ));
            }
            if t.states.iter().any(|s| s.name == row.from && s.is_final) {
                self.errors.push(format!(
                    "{label}: the final state `{}` cannot have transitions",
                    row.from
                ));
            }
            self.literals(&label, &row.guard);
            if row.reenter {
                let has_timer = t.states.iter().any(|s| s.name == row.from && s.timer.is_some());
                if row.from != row.to || !has_timer {
                    self.errors.push(format!(
                        "{label}: `reenter` restarts a timer: only on a self-transition of a state with a timer"
                    ));
                }
            }
            let mut seen = BTreeSet::new();
            for e in &row.effects {
                if !self.effects.contains(e) {
                    self.errors.push(format!(
                        "{label}: unknown effect `{e}`; effects: {}",
                        list(&self.effects)
                    ));
                }
                if !seen.insert(e) {
                    self.errors.push(format!("{label}: effect `{e}` listed twice"));
                }
                if let Some(def) = t.effects.iter().find(|d| &d.name == e)
                    && !def.only_on.is_empty()
                    && !def.only_on.contains(&row.on)
                {
                    self.errors.push(format!(
                        "{label}: effect `{e}` takes its value from the events {} only",
                        def.only_on.join(" / ")
                    ));
                }
            }
            if !is_camel(&row.reason) {
                self.errors
                    .push(format!("{label}: reason `{}` must be CamelCase", row.reason));
            }
            if row.note.trim().is_empty() || row.note.contains('\n') {
                self.errors
                    .push(format!("{label}: needs a one-line `note` saying why"));
            }
            groups
                .entry((row.from.clone(), row.on.clone()))
                .or_default()
                .push(i);
        }
        groups
    }

    /// The rows of one (state, event): distinct guards, one unguarded fallback last, reachable.
    fn groups(
        &mut self,
        t: &Table,
        groups: &BTreeMap<(String, String), Vec<usize>>,
        coverage: &mut CoverageMap,
    ) {
        for ((from, on), rows) in groups {
            coverage
                .entry((from.clone(), on.clone()))
                .or_default()
                .push("transition rows".to_owned());
            let (last, guarded) = rows.split_last().expect("a group has at least one row");
            if !t.transitions[*last].guard.is_empty() {
                self.errors.push(format!(
                    "{}: guarded rows for ({from}, {on}) must end with an unguarded fallback row",
                    row_label(*last, &t.transitions[*last])
                ));
            }
            let mut seen_guards = BTreeSet::new();
            for i in guarded {
                let row = &t.transitions[*i];
                if row.guard.is_empty() {
                    self.errors.push(format!(
                        "{}: only the last row for ({from}, {on}) may be unguarded; rows after it are unreachable",
                        row_label(*i, row)
                    ));
                } else if !seen_guards.insert(row.guard.clone()) {
                    self.errors.push(format!(
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
                    self.errors.push(format!(
                        "state `{from}` has rows for `{on}`, which only {} raise(s), but no row into `{from}` runs it: \
                         the rows are unreachable (declare the event `invalid` there)",
                        event.raised_by.join(" / ")
                    ));
                }
            }
        }
    }

    /// Every (state, event) pair is covered exactly once.
    fn coverage(&mut self, t: &Table, coverage: &CoverageMap) {
        for s in &t.states {
            for e in &t.events {
                match coverage.get(&(s.name.clone(), e.name.clone())) {
                    None => self.errors.push(format!(
                        "state `{}` does not cover event `{}`: add a transition row, or list it under `ignore` or `invalid`",
                        s.name, e.name
                    )),
                    Some(by) if by.len() > 1 => self.errors.push(format!(
                        "state `{}`, event `{}` is covered more than once: {}",
                        s.name,
                        e.name,
                        by.join(" and ")
                    )),
                    Some(_) => {}
                }
            }
        }
    }

    /// Warnings name reasons rows give; every declared name is used somewhere.
    fn unused(&mut self, t: &Table) {
        let reasons: BTreeSet<&str> = t.transitions.iter().map(|r| r.reason.as_str()).collect();
        for warning in &t.warnings {
            if !reasons.contains(warning.as_str()) {
                self.errors.push(format!(
                    "`warnings` lists `{warning}`, which no transition row gives as its reason"
                ));
            }
        }
        let fact_names = |literals: &[String]| -> Vec<String> {
            literals.iter().map(|l| literal(l).0.to_owned()).collect()
        };
        let used_facts: BTreeSet<String> = (t.events.iter().flat_map(|e| fact_names(&e.when)))
            .chain(t.transitions.iter().flat_map(|r| fact_names(&r.guard)))
            .collect();
        let used_effects: BTreeSet<String> = t.transitions.iter().flat_map(|r| r.effects.clone()).collect();
        let used_events: BTreeSet<String> = t.transitions.iter().map(|r| r.on.clone()).collect();
        let used_timers: BTreeSet<String> = t.states.iter().filter_map(|s| s.timer.clone()).collect();
        for (kind, declared, used) in [
            ("event", &self.events, &used_events),
            ("effect", &self.effects, &used_effects),
            ("fact", &self.facts, &used_facts),
            ("timer", &self.timers, &used_timers),
        ] {
            for name in declared.difference(used) {
                self.errors
                    .push(format!("{kind} `{name}` is declared but nothing uses it"));
            }
        }
    }
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
