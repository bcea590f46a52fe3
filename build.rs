//! Build script: generates the typed lifecycle machines from `machines/*.yaml`.
//!
//! Each table becomes `$OUT_DIR/<machine>_machine.rs` (included by `src/machine/table.rs`): the
//! `Fact`, `Phase`, `Event`, `TimerKind` and `State` types, a `#[statig::state_machine]` impl whose
//! state handlers are a `match event` built from the rows, the `reason` constants, and the static
//! metadata (rows, events with the facts that raise them, states with their timers) that `derive`,
//! the docs renderer and the tests read. The table is validated first and the build fails with a
//! message naming the offending row on an unknown name, an uncovered or doubly covered
//! (state, event) pair, guarded rows without an unguarded fallback, an event raised by facts that a
//! state declares invalid, or an effect-raised event a state handles although none of its incoming
//! rows runs the effect. Effect names are emitted as `EffectKind::CreateInstance`, so a name the
//! Rust code lacks also fails compilation.
//!
//! Nothing checked in is written: the output goes to OUT_DIR only.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::{env, fs};

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Table {
    machine: String,
    initial: String,
    facts: Vec<Named>,
    states: Vec<StateDef>,
    events: Vec<EventDef>,
    effects: Vec<Named>,
    timers: Vec<TimerDef>,
    /// Reasons whose Kubernetes Events are of type Warning.
    warnings: Vec<String>,
    transitions: Vec<Row>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateDef {
    name: String,
    doc: String,
    #[serde(default)]
    timer: Option<String>,
    #[serde(default, rename = "final")]
    is_final: bool,
    #[serde(default)]
    ignore: Vec<String>,
    #[serde(default)]
    invalid: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Named {
    name: String,
    doc: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventDef {
    name: String,
    doc: String,
    /// Fact literals (`fact` or `not fact`) that must all hold for derive to raise the event.
    #[serde(default)]
    when: Vec<String>,
    /// Effects whose executors raise the event.
    #[serde(default)]
    raised_by: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimerDef {
    name: String,
    doc: String,
    default_seconds: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    from: String,
    on: String,
    /// Fact literals that must all hold for the row to match.
    #[serde(default)]
    guard: Vec<String>,
    to: String,
    #[serde(default)]
    reenter: bool,
    effects: Vec<String>,
    reason: String,
    note: String,
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=machines");

    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let machines_dir = manifest_dir.join("machines");

    let mut tables: Vec<PathBuf> = fs::read_dir(&machines_dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", machines_dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    tables.sort();
    if tables.is_empty() {
        panic!("no transition table found in {}", machines_dir.display());
    }

    for path in tables {
        let rel = format!(
            "machines/{}",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("?")
        );
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: cannot read: {e}"));
        let table = load_table(&text).unwrap_or_else(|errors| {
            panic!(
                "\n{rel}: the transition table is invalid ({} problem(s)):\n  - {}\n",
                errors.len(),
                errors.join("\n  - ")
            )
        });
        let code = generate(&table, &rel);
        let out = out_dir.join(format!("{}_machine.rs", table.machine));
        write_if_changed(&out, &code);
    }
}

fn write_if_changed(path: &Path, contents: &str) {
    if fs::read_to_string(path).is_ok_and(|old| old == contents) {
        return;
    }
    fs::write(path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn row_label(index: usize, row: &Row) -> String {
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
fn literal(text: &str) -> (&str, bool) {
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

fn camel(snake: &str) -> String {
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
fn shouty(camel_name: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel_name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// A Rust string literal for `s` (Debug escaping yields valid Rust).
fn lit(s: &str) -> String {
    format!("{s:?}")
}

/// `[Literal { fact: Fact::X, holds: true }, ...]` for fact literals.
fn literals(texts: &[String]) -> String {
    let items: Vec<String> = texts
        .iter()
        .map(|text| {
            let (fact, holds) = literal(text);
            format!("Literal {{ fact: Fact::{}, holds: {holds} }}", camel(fact))
        })
        .collect();
    format!("&[{}]", items.join(", "))
}

/// A `name => value` match over `items` as one `const fn`.
fn const_match(w: &mut String, doc: &str, name: &str, ty: &str, ret: &str, arms: &[(String, String)]) {
    let _ = writeln!(w, "    /// {doc}");
    let _ = writeln!(w, "    pub const fn {name}(self) -> {ret} {{");
    let _ = writeln!(w, "        match self {{");
    for (variant, value) in arms {
        let _ = writeln!(w, "            {ty}::{variant} => {value},");
    }
    let _ = writeln!(w, "        }}\n    }}");
}

/// A plain enum with `ALL`, `as_str`, `doc` and `from_name`, from (name, doc) pairs.
fn named_enum(w: &mut String, ty: &str, doc: &str, derives: &str, items: &[(&str, &str)]) {
    let _ = writeln!(w, "/// {doc}");
    let _ = writeln!(w, "#[derive({derives})]");
    let _ = writeln!(w, "#[serde(rename_all = \"snake_case\")]");
    let _ = writeln!(w, "pub enum {ty} {{");
    for (name, doc) in items {
        let _ = writeln!(w, "    #[doc = {}]", lit(doc));
        let _ = writeln!(w, "    {},", camel(name));
    }
    let _ = writeln!(w, "}}\n");
    let _ = writeln!(w, "impl {ty} {{");
    let _ = writeln!(w, "    /// Every variant, in table order.");
    let _ = writeln!(w, "    pub const ALL: [{ty}; {}] = [", items.len());
    for (name, _) in items {
        let _ = writeln!(w, "        {ty}::{},", camel(name));
    }
    let _ = writeln!(w, "    ];");
    let arms = |f: &dyn Fn(&str, &str) -> String| -> Vec<(String, String)> {
        items.iter().map(|(n, d)| (camel(n), f(n, d))).collect()
    };
    const_match(
        w,
        "The snake_case name used in the table.",
        "as_str",
        ty,
        "&'static str",
        &arms(&|n, _| lit(n)),
    );
    const_match(
        w,
        "The one-line doc from the table.",
        "doc",
        ty,
        "&'static str",
        &arms(&|_, d| lit(d)),
    );
    let _ = writeln!(w, "    /// Parse a snake_case name.");
    let _ = writeln!(w, "    pub fn from_name(name: &str) -> Option<{ty}> {{");
    let _ = writeln!(w, "        Self::ALL.into_iter().find(|v| v.as_str() == name)");
    let _ = writeln!(w, "    }}");
    let _ = writeln!(w, "}}\n");
}

fn generate(t: &Table, source: &str) -> String {
    let mut o = String::new();
    let machine_ty = format!("{}Machine", camel(&t.machine));
    const DERIVES: &str = "Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize, schemars::JsonSchema";

    let w = &mut o;
    let _ = writeln!(
        w,
        "// @generated by build.rs from {source}. Do not edit: change the table instead.\n"
    );
    let _ = writeln!(w, "/// Name of the machine, as in `machine:` of the table.");
    let _ = writeln!(w, "pub const MACHINE: &str = {};", lit(&t.machine));
    let _ = writeln!(w, "/// Path of the table this code was generated from.");
    let _ = writeln!(w, "pub const SOURCE: &str = {};\n", lit(source));

    let facts: Vec<(&str, &str)> = t
        .facts
        .iter()
        .map(|n| (n.name.as_str(), n.doc.as_str()))
        .collect();
    named_enum(
        w,
        "Fact",
        "A boolean observation `derive` and the guards read.",
        DERIVES,
        &facts,
    );
    let states: Vec<(&str, &str)> = t
        .states
        .iter()
        .map(|s| (s.name.as_str(), s.doc.as_str()))
        .collect();
    named_enum(
        w,
        "Phase",
        "A lifecycle phase: the state without its data.",
        DERIVES,
        &states,
    );
    let events: Vec<(&str, &str)> = t
        .events
        .iter()
        .map(|e| (e.name.as_str(), e.doc.as_str()))
        .collect();
    named_enum(
        w,
        "Event",
        "What happened, derived from facts or raised by an executor; `ALL` is in priority order.",
        DERIVES,
        &events,
    );
    let timers: Vec<(&str, &str)> = t
        .timers
        .iter()
        .map(|e| (e.name.as_str(), e.doc.as_str()))
        .collect();
    named_enum(
        w,
        "TimerKind",
        "A configurable duration a state waits for.",
        DERIVES,
        &timers,
    );

    // ---- Phase extras ---------------------------------------------------------------------------
    let _ = writeln!(w, "impl Phase {{");
    let _ = writeln!(w, "    /// The phase a new object starts in.");
    let _ = writeln!(w, "    pub const INITIAL: Phase = Phase::{};", camel(&t.initial));
    let phase_arms = |f: &dyn Fn(&StateDef) -> String| -> Vec<(String, String)> {
        t.states.iter().map(|s| (camel(&s.name), f(s))).collect()
    };
    const_match(
        w,
        "Whether this is a final state (every event is ignored there).",
        "is_final",
        "Phase",
        "bool",
        &phase_arms(&|s| s.is_final.to_string()),
    );
    const_match(
        w,
        "The state's timer, if it waits for one.",
        "timer",
        "Phase",
        "Option<TimerKind>",
        &phase_arms(&|s| match &s.timer {
            Some(timer) => format!("Some(TimerKind::{})", camel(timer)),
            None => "None".to_owned(),
        }),
    );
    let _ = writeln!(w, "}}\n");

    let _ = writeln!(w, "impl TimerKind {{");
    let arms: Vec<(String, String)> = t
        .timers
        .iter()
        .map(|d| {
            (
                camel(&d.name),
                format!("std::time::Duration::from_secs({})", d.default_seconds),
            )
        })
        .collect();
    const_match(
        w,
        "The documented default.",
        "default_duration",
        "TimerKind",
        "std::time::Duration",
        &arms,
    );
    let _ = writeln!(w, "}}\n");

    // ---- reasons ---------------------------------------------------------------------------------
    let reasons: BTreeSet<&str> = t.transitions.iter().map(|r| r.reason.as_str()).collect();
    let _ = writeln!(
        w,
        "/// Every reason a row gives, as constants: Rust code names these, never string literals."
    );
    let _ = writeln!(w, "pub mod reason {{");
    for r in &reasons {
        let _ = writeln!(w, "    /// `{r}`");
        let _ = writeln!(w, "    pub const {}: &str = {};", shouty(r), lit(r));
    }
    let _ = writeln!(w, "    /// Every reason, sorted.");
    let all: Vec<String> = reasons.iter().map(|r| shouty(r)).collect();
    let _ = writeln!(
        w,
        "    pub const ALL: [&str; {}] = [{}];",
        reasons.len(),
        all.join(", ")
    );
    let warnings: Vec<String> = t.warnings.iter().map(|r| shouty(r)).collect();
    let _ = writeln!(
        w,
        "    /// Reasons whose Kubernetes Events are Warnings (the table's `warnings`)."
    );
    let _ = writeln!(
        w,
        "    pub const WARNINGS: [&str; {}] = [{}];",
        warnings.len(),
        warnings.join(", ")
    );
    let _ = writeln!(w, "}}\n");

    // ---- State -----------------------------------------------------------------------------------
    let _ = writeln!(
        w,
        "/// A lifecycle state with when it was entered; persisted in the Proxy status."
    );
    let _ = writeln!(w, "///");
    let _ = writeln!(
        w,
        "/// Serialized flat through [`StateRecord`] (`{{\"phase\": ..., \"since\": ...}}`)."
    );
    let _ = writeln!(
        w,
        "#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]"
    );
    let _ = writeln!(w, "#[serde(from = \"StateRecord\", into = \"StateRecord\")]");
    let _ = writeln!(w, "pub enum State {{");
    for s in &t.states {
        let _ = writeln!(w, "    #[doc = {}]", lit(&s.doc));
        let _ = writeln!(
            w,
            "    {} {{\n        /// When this state was entered.\n        since: jiff::Timestamp,\n    }},",
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "}}\n");
    let _ = writeln!(w, "impl State {{");
    let _ = writeln!(w, "    /// The phase of this state.");
    let _ = writeln!(
        w,
        "    pub const fn phase(&self) -> Phase {{\n        match self {{"
    );
    for s in &t.states {
        let _ = writeln!(
            w,
            "            State::{} {{ .. }} => Phase::{},",
            camel(&s.name),
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "    /// When this state was entered.");
    let _ = writeln!(
        w,
        "    pub const fn since(&self) -> jiff::Timestamp {{\n        match self {{"
    );
    for s in &t.states {
        let _ = writeln!(w, "            State::{} {{ since }} => *since,", camel(&s.name));
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "    /// The state of `phase`, entered at `since`.");
    let _ = writeln!(
        w,
        "    pub const fn new(phase: Phase, since: jiff::Timestamp) -> State {{\n        match phase {{"
    );
    for s in &t.states {
        let _ = writeln!(
            w,
            "            Phase::{} => State::{} {{ since }},",
            camel(&s.name),
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "}}\n");

    // ---- statig machine --------------------------------------------------------------------------
    let _ = writeln!(
        w,
        "/// The statig machine generated from the table. It has no shared storage and no"
    );
    let _ = writeln!(
        w,
        "/// entry or exit actions: [`decide`](super::decide) calls a state's handler through"
    );
    let _ = writeln!(
        w,
        "/// `statig::blocking::State::call_handler` and never runs statig's wrapper."
    );
    let _ = writeln!(w, "#[derive(Debug, Default)]");
    let _ = writeln!(w, "pub(crate) struct {machine_ty};\n");
    let _ = writeln!(
        w,
        "#[statig::state_machine(\n    initial = \"State::{} {{ since: jiff::Timestamp::UNIX_EPOCH }}\",\n    state(custom, name = \"State\"),\n    superstate(name = \"Superstate\"),\n    visibility = \"pub(crate)\"\n)]",
        camel(&t.initial)
    );
    let _ = writeln!(w, "impl {machine_ty} {{");
    for s in &t.states {
        let _ = writeln!(w, "    #[doc = {}]", lit(&s.doc));
        let _ = writeln!(w, "    #[state]");
        let _ = writeln!(
            w,
            "    #[allow(unused_variables)] // the final state reads nothing"
        );
        let _ = writeln!(
            w,
            "    fn {}(since: &jiff::Timestamp, event: &Event, context: &mut DecideCtx) -> statig::Outcome<State> {{",
            s.name
        );
        let _ = writeln!(w, "        match event {{");
        for (i, row) in t.transitions.iter().enumerate().filter(|(_, r)| r.from == s.name) {
            // A self-transition keeps `since` (its timer keeps running) unless it re-enters.
            let since = if row.to == row.from && !row.reenter {
                "*since"
            } else {
                "context.now()"
            };
            let guard = if row.guard.is_empty() {
                String::new()
            } else {
                format!(" if context.holds({})", literals(&row.guard))
            };
            let _ = writeln!(w, "            // {}: {}", row_label(i, row), row.note);
            let _ = writeln!(w, "            Event::{}{guard} => {{", camel(&row.on));
            let _ = writeln!(w, "                context.matched(&ROWS[{i}]);");
            let _ = writeln!(
                w,
                "                statig::Outcome::Transition(State::{} {{ since: {since} }})",
                camel(&row.to)
            );
            let _ = writeln!(w, "            }}");
        }
        if !s.ignore.is_empty() {
            let pats: Vec<String> = s.ignore.iter().map(|e| format!("Event::{}", camel(e))).collect();
            let _ = writeln!(w, "            // ignore: no effect, no audit entry.");
            let _ = writeln!(
                w,
                "            {} => statig::Outcome::Handled,",
                pats.join("\n            | ")
            );
        }
        if !s.invalid.is_empty() {
            let pats: Vec<String> = s.invalid.iter().map(|e| format!("Event::{}", camel(e))).collect();
            let _ = writeln!(
                w,
                "            // invalid: cannot happen here; `Super` (no superstate) means invalid."
            );
            let _ = writeln!(
                w,
                "            {} => statig::Outcome::Super,",
                pats.join("\n            | ")
            );
        }
        let _ = writeln!(w, "        }}\n    }}\n");
    }
    let _ = writeln!(w, "}}\n");

    // ---- metadata --------------------------------------------------------------------------------
    let _ = writeln!(
        w,
        "/// Every transition row, in table order (`ROWS[i].index == i`)."
    );
    let _ = writeln!(w, "pub static ROWS: [Row; {}] = [", t.transitions.len());
    for (i, row) in t.transitions.iter().enumerate() {
        let effects: Vec<String> = row
            .effects
            .iter()
            .map(|e| format!("EffectKind::{}", camel(e)))
            .collect();
        let _ = writeln!(
            w,
            "    Row {{ index: {i}, from: Phase::{}, on: Event::{}, guard: {}, to: Phase::{}, reenter: {}, effects: &[{}], reason: reason::{}, note: {} }},",
            camel(&row.from),
            camel(&row.on),
            literals(&row.guard),
            camel(&row.to),
            row.reenter,
            effects.join(", "),
            shouty(&row.reason),
            lit(&row.note)
        );
    }
    let _ = writeln!(w, "];\n");

    let _ = writeln!(
        w,
        "/// Per event, in priority order: the facts that raise it and the effects that raise it."
    );
    let _ = writeln!(w, "pub static EVENTS: [EventInfo; {}] = [", t.events.len());
    for e in &t.events {
        let raised: Vec<String> = e
            .raised_by
            .iter()
            .map(|x| format!("EffectKind::{}", camel(x)))
            .collect();
        let _ = writeln!(
            w,
            "    EventInfo {{ event: Event::{}, when: {}, raised_by: &[{}] }},",
            camel(&e.name),
            literals(&e.when),
            raised.join(", ")
        );
    }
    let _ = writeln!(w, "];\n");

    let _ = writeln!(
        w,
        "/// Per state: the events it ignores and the events that are invalid there."
    );
    let _ = writeln!(w, "pub static STATES: [StateInfo; {}] = [", t.states.len());
    for s in &t.states {
        let ev = |names: &[String]| {
            names
                .iter()
                .map(|e| format!("Event::{}", camel(e)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            w,
            "    StateInfo {{ phase: Phase::{}, ignore: &[{}], invalid: &[{}] }},",
            camel(&s.name),
            ev(&s.ignore),
            ev(&s.invalid)
        );
    }
    let _ = writeln!(w, "];\n");

    let _ = writeln!(
        w,
        "/// The effects section of the table; `kind` makes an unknown name fail to compile."
    );
    let _ = writeln!(w, "pub static EFFECTS: [EffectInfo; {}] = [", t.effects.len());
    for e in &t.effects {
        let _ = writeln!(
            w,
            "    EffectInfo {{ kind: EffectKind::{}, name: {}, doc: {} }},",
            camel(&e.name),
            lit(&e.name),
            lit(&e.doc)
        );
    }
    let _ = writeln!(w, "];");

    o
}
