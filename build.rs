//! Build script: generates the typed lifecycle machines from `machines/*.yaml`.
//!
//! Each table becomes `$OUT_DIR/<machine>_machine.rs` (included by `src/machine/table.rs`): the
//! `Phase`, `Event` and `State` enums, a `#[statig::state_machine]` impl whose state handlers are a
//! `match event` built from the rows, and static metadata (rows, docs, ignore / invalid lists) used
//! by the docs renderer and the tests. The table is validated first and the build fails with a
//! message naming the offending row on an unknown name, an uncovered or doubly covered
//! (state, event) pair, or guarded rows without an unguarded fallback. Effect and guard names are
//! emitted as `EffectKind::CreateInstance` / `guards::attempts_left`, so a name the Rust code lacks
//! also fails compilation.
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
    states: Vec<StateDef>,
    events: Vec<Named>,
    effects: Vec<Named>,
    guards: Vec<Named>,
    transitions: Vec<Row>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateDef {
    name: String,
    doc: String,
    #[serde(default)]
    data: Vec<String>,
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
struct Row {
    from: String,
    on: String,
    #[serde(default)]
    guard: Option<String>,
    to: String,
    effects: Vec<String>,
    reason: String,
    note: String,
}

/// State-local data fields the generator knows how to maintain (see the data rules in the table).
const DATA_FIELDS: &[(&str, &str, &str)] = &[
    (
        "since",
        "jiff::Timestamp",
        "When this state was entered (kept on self-transitions).",
    ),
    (
        "attempts",
        "u32",
        "`create_instance` effects issued since this state was entered.",
    ),
];

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
    match &row.guard {
        Some(g) => format!(
            "transition #{index} ({} --{} [{g}]--> {})",
            row.from, row.on, row.to
        ),
        None => format!("transition #{index} ({} --{}--> {})", row.from, row.on, row.to),
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
    let guards = check_names(
        "guard",
        t.guards
            .iter()
            .map(|s| (s.name.as_str(), s.doc.as_str()))
            .collect(),
    );
    let list = |set: &BTreeSet<String>| set.iter().cloned().collect::<Vec<_>>().join(", ");

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

    // (state, event) -> where it is covered.
    let mut coverage: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for s in &t.states {
        let mut seen_fields = BTreeSet::new();
        for field in &s.data {
            if !DATA_FIELDS.iter().any(|(name, _, _)| name == field) {
                errors.push(format!(
                    "state `{}`: unknown data field `{field}`; known: {}",
                    s.name,
                    DATA_FIELDS.iter().map(|f| f.0).collect::<Vec<_>>().join(", ")
                ));
            }
            if !seen_fields.insert(field) {
                errors.push(format!("state `{}`: data field `{field}` listed twice", s.name));
            }
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
    }

    let mut used_events = BTreeSet::new();
    let mut used_effects = BTreeSet::new();
    let mut used_guards = BTreeSet::new();
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
        if let Some(g) = &row.guard {
            if !guards.contains(g) {
                errors.push(format!("{label}: unknown guard `{g}`; guards: {}", list(&guards)));
            }
            used_guards.insert(g.clone());
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
        if t.transitions[*last].guard.is_some() {
            errors.push(format!(
                "{}: guarded rows for ({from}, {on}) must end with an unguarded fallback row",
                row_label(*last, &t.transitions[*last])
            ));
        }
        let mut seen_guards = BTreeSet::new();
        for i in guarded {
            let row = &t.transitions[*i];
            match &row.guard {
                None => errors.push(format!(
                    "{}: only the last row for ({from}, {on}) may be unguarded; rows after it are unreachable",
                    row_label(*i, row)
                )),
                Some(g) if !seen_guards.insert(g) => errors.push(format!(
                    "{}: guard `{g}` repeated for ({from}, {on}); the later row is unreachable",
                    row_label(*i, row)
                )),
                Some(_) => {}
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

    for (kind, declared, used) in [
        ("event", &events, &used_events),
        ("effect", &effects, &used_effects),
        ("guard", &guards, &used_guards),
    ] {
        for name in declared.difference(used) {
            errors.push(format!(
                "{kind} `{name}` is declared but no transition row uses it"
            ));
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

/// A Rust string literal for `s` (Debug escaping yields valid Rust).
fn lit(s: &str) -> String {
    format!("{s:?}")
}

fn data_type(field: &str) -> &'static str {
    DATA_FIELDS
        .iter()
        .find(|f| f.0 == field)
        .map(|f| f.1)
        .expect("validated data field")
}

fn data_doc(field: &str) -> &'static str {
    DATA_FIELDS
        .iter()
        .find(|f| f.0 == field)
        .map(|f| f.2)
        .expect("validated data field")
}

fn generate(t: &Table, source: &str) -> String {
    let mut o = String::new();
    let machine_ty = format!("{}Machine", camel(&t.machine));
    let state_of = |name: &str| t.states.iter().find(|s| s.name == name).expect("validated state");

    let w = &mut o;
    let _ = writeln!(
        w,
        "// @generated by build.rs from {source}. Do not edit: change the table instead."
    );
    let _ = writeln!(w);
    let _ = writeln!(w, "/// Name of the machine, as in `machine:` of the table.");
    let _ = writeln!(w, "pub const MACHINE: &str = {};", lit(&t.machine));
    let _ = writeln!(w, "/// Path of the table this code was generated from.");
    let _ = writeln!(w, "pub const SOURCE: &str = {};", lit(source));
    let _ = writeln!(w);

    // ---- Phase --------------------------------------------------------------------------------
    let _ = writeln!(w, "/// A lifecycle phase: the state without its data.");
    let _ = writeln!(
        w,
        "#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]"
    );
    let _ = writeln!(w, "#[serde(rename_all = \"snake_case\")]");
    let _ = writeln!(w, "pub enum Phase {{");
    for s in &t.states {
        let _ = writeln!(w, "    #[doc = {}]", lit(&s.doc));
        let _ = writeln!(w, "    {},", camel(&s.name));
    }
    let _ = writeln!(w, "}}\n");
    let _ = writeln!(w, "impl Phase {{");
    let _ = writeln!(w, "    /// Every phase, in table order.");
    let _ = writeln!(w, "    pub const ALL: [Phase; {}] = [", t.states.len());
    for s in &t.states {
        let _ = writeln!(w, "        Phase::{},", camel(&s.name));
    }
    let _ = writeln!(w, "    ];");
    let _ = writeln!(w, "    /// The phase a new object starts in.");
    let _ = writeln!(w, "    pub const INITIAL: Phase = Phase::{};", camel(&t.initial));
    let _ = writeln!(
        w,
        "    /// The snake_case name used in the table, status and audit."
    );
    let _ = writeln!(w, "    pub const fn as_str(self) -> &'static str {{");
    let _ = writeln!(w, "        match self {{");
    for s in &t.states {
        let _ = writeln!(w, "            Phase::{} => {},", camel(&s.name), lit(&s.name));
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "    /// The one-line doc from the table.");
    let _ = writeln!(w, "    pub const fn doc(self) -> &'static str {{");
    let _ = writeln!(w, "        match self {{");
    for s in &t.states {
        let _ = writeln!(w, "            Phase::{} => {},", camel(&s.name), lit(&s.doc));
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(
        w,
        "    /// Whether this is a final state (every event is ignored there)."
    );
    let _ = writeln!(w, "    pub const fn is_final(self) -> bool {{");
    let finals: Vec<String> = t
        .states
        .iter()
        .filter(|s| s.is_final)
        .map(|s| format!("Phase::{}", camel(&s.name)))
        .collect();
    let _ = writeln!(w, "        matches!(self, {})", finals.join(" | "));
    let _ = writeln!(w, "    }}");
    let _ = writeln!(w, "    /// The state-local data fields of this phase.");
    let _ = writeln!(
        w,
        "    pub const fn data_fields(self) -> &'static [&'static str] {{"
    );
    let _ = writeln!(w, "        match self {{");
    for s in &t.states {
        let fields: Vec<String> = s.data.iter().map(|f| lit(f)).collect();
        let _ = writeln!(
            w,
            "            Phase::{} => &[{}],",
            camel(&s.name),
            fields.join(", ")
        );
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "    /// Parse a snake_case phase name.");
    let _ = writeln!(w, "    pub fn from_name(name: &str) -> Option<Phase> {{");
    let _ = writeln!(w, "        match name {{");
    for s in &t.states {
        let _ = writeln!(
            w,
            "            {} => Some(Phase::{}),",
            lit(&s.name),
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "            _ => None,");
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "}}\n");

    // ---- Event --------------------------------------------------------------------------------
    let _ = writeln!(
        w,
        "/// An observation the controller derives from its snapshot of the world."
    );
    let _ = writeln!(
        w,
        "#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]"
    );
    let _ = writeln!(w, "#[serde(rename_all = \"snake_case\")]");
    let _ = writeln!(w, "pub enum Event {{");
    for e in &t.events {
        let _ = writeln!(w, "    #[doc = {}]", lit(&e.doc));
        let _ = writeln!(w, "    {},", camel(&e.name));
    }
    let _ = writeln!(w, "}}\n");
    let _ = writeln!(w, "impl Event {{");
    let _ = writeln!(w, "    /// Every event, in table order.");
    let _ = writeln!(w, "    pub const ALL: [Event; {}] = [", t.events.len());
    for e in &t.events {
        let _ = writeln!(w, "        Event::{},", camel(&e.name));
    }
    let _ = writeln!(w, "    ];");
    let _ = writeln!(
        w,
        "    /// The snake_case name used in the table, scenarios and audit."
    );
    let _ = writeln!(w, "    pub const fn as_str(self) -> &'static str {{");
    let _ = writeln!(w, "        match self {{");
    for e in &t.events {
        let _ = writeln!(w, "            Event::{} => {},", camel(&e.name), lit(&e.name));
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "    /// The one-line doc from the table.");
    let _ = writeln!(w, "    pub const fn doc(self) -> &'static str {{");
    let _ = writeln!(w, "        match self {{");
    for e in &t.events {
        let _ = writeln!(w, "            Event::{} => {},", camel(&e.name), lit(&e.doc));
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "    /// Parse a snake_case event name.");
    let _ = writeln!(w, "    pub fn from_name(name: &str) -> Option<Event> {{");
    let _ = writeln!(w, "        match name {{");
    for e in &t.events {
        let _ = writeln!(
            w,
            "            {} => Some(Event::{}),",
            lit(&e.name),
            camel(&e.name)
        );
    }
    let _ = writeln!(w, "            _ => None,");
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "}}\n");

    // ---- State --------------------------------------------------------------------------------
    let _ = writeln!(
        w,
        "/// A lifecycle state with its state-local data; persisted in the Proxy status."
    );
    let _ = writeln!(w, "///");
    let _ = writeln!(
        w,
        "/// Serialized flat through [`StateRecord`] (`{{\"phase\": ..., \"since\": ..., \"attempts\": ...}}`),"
    );
    let _ = writeln!(w, "/// which keeps the Kubernetes schema structural.");
    let _ = writeln!(
        w,
        "#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]"
    );
    let _ = writeln!(w, "#[serde(try_from = \"StateRecord\", into = \"StateRecord\")]");
    let _ = writeln!(w, "pub enum State {{");
    for s in &t.states {
        let _ = writeln!(w, "    #[doc = {}]", lit(&s.doc));
        if s.data.is_empty() {
            let _ = writeln!(w, "    {},", camel(&s.name));
        } else {
            let _ = writeln!(w, "    {} {{", camel(&s.name));
            for f in &s.data {
                let _ = writeln!(w, "        #[doc = {}]", lit(data_doc(f)));
                let _ = writeln!(w, "        {f}: {},", data_type(f));
            }
            let _ = writeln!(w, "    }},");
        }
    }
    let _ = writeln!(w, "}}\n");
    let _ = writeln!(w, "impl State {{");
    let _ = writeln!(w, "    /// The phase of this state.");
    let _ = writeln!(w, "    pub const fn phase(&self) -> Phase {{");
    let _ = writeln!(w, "        match self {{");
    for s in &t.states {
        let pat = if s.data.is_empty() {
            String::new()
        } else {
            " { .. }".to_owned()
        };
        let _ = writeln!(
            w,
            "            State::{}{pat} => Phase::{},",
            camel(&s.name),
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(
        w,
        "    /// The state-local data as a uniform view (absent fields: `None` / 0)."
    );
    let _ = writeln!(w, "    pub fn data(&self) -> StateData {{");
    let _ = writeln!(w, "        match self {{");
    for s in &t.states {
        let has_since = s.data.iter().any(|f| f == "since");
        let has_attempts = s.data.iter().any(|f| f == "attempts");
        let pat = if s.data.is_empty() {
            String::new()
        } else {
            format!(" {{ {} }}", s.data.join(", "))
        };
        let since = if has_since { "Some(*since)" } else { "None" };
        let attempts = if has_attempts { "*attempts" } else { "0" };
        let _ = writeln!(
            w,
            "            State::{}{pat} => StateData {{ since: {since}, attempts: {attempts} }},",
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(
        w,
        "    /// Build the state of `phase` from data; fields the phase lacks are dropped."
    );
    let _ = writeln!(
        w,
        "    pub fn from_parts(phase: Phase, since: jiff::Timestamp, attempts: u32) -> State {{"
    );
    let _ = writeln!(w, "        match phase {{");
    for s in &t.states {
        let ctor = if s.data.is_empty() {
            String::new()
        } else {
            format!(" {{ {} }}", s.data.join(", "))
        };
        let _ = writeln!(
            w,
            "            Phase::{} => State::{}{ctor},",
            camel(&s.name),
            camel(&s.name)
        );
    }
    let _ = writeln!(w, "        }}\n    }}");
    let _ = writeln!(w, "}}\n");

    let _ = writeln!(w, "impl From<State> for StateRecord {{");
    let _ = writeln!(w, "    fn from(state: State) -> StateRecord {{");
    let _ = writeln!(w, "        let data = state.data();");
    let _ = writeln!(w, "        let phase = state.phase();");
    let _ = writeln!(w, "        StateRecord {{");
    let _ = writeln!(w, "            phase,");
    let _ = writeln!(w, "            since: data.since,");
    let _ = writeln!(
        w,
        "            attempts: phase.data_fields().contains(&\"attempts\").then_some(data.attempts),"
    );
    let _ = writeln!(w, "        }}\n    }}\n}}\n");

    let _ = writeln!(w, "impl TryFrom<StateRecord> for State {{");
    let _ = writeln!(w, "    type Error = StateRecordError;");
    let _ = writeln!(
        w,
        "    fn try_from(record: StateRecord) -> Result<State, StateRecordError> {{"
    );
    let _ = writeln!(w, "        let phase = record.phase;");
    let _ = writeln!(w, "        Ok(match phase {{");
    for s in &t.states {
        if s.data.is_empty() {
            let _ = writeln!(
                w,
                "            Phase::{} => State::{},",
                camel(&s.name),
                camel(&s.name)
            );
            continue;
        }
        let _ = writeln!(
            w,
            "            Phase::{} => State::{} {{",
            camel(&s.name),
            camel(&s.name)
        );
        for f in &s.data {
            let _ = writeln!(
                w,
                "                {f}: record.{f}.ok_or(StateRecordError::MissingField {{ phase, field: {} }})?,",
                lit(f)
            );
        }
        let _ = writeln!(w, "            }},");
    }
    let _ = writeln!(w, "        }})\n    }}\n}}\n");

    // ---- statig machine -----------------------------------------------------------------------
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
        "#[statig::state_machine(\n    initial = \"State::{}\",\n    state(custom, name = \"State\"),\n    superstate(name = \"Superstate\"),\n    visibility = \"pub(crate)\"\n)]",
        camel(&t.initial)
    );
    let _ = writeln!(w, "impl {machine_ty} {{");
    for s in &t.states {
        let rows: Vec<(usize, &Row)> = t
            .transitions
            .iter()
            .enumerate()
            .filter(|(_, r)| r.from == s.name)
            .collect();
        let has_guards = rows.iter().any(|(_, r)| r.guard.is_some());
        let mut params: Vec<String> = s.data.iter().map(|f| format!("{f}: &{}", data_type(f))).collect();
        params.push("event: &Event".to_owned());
        params.push("context: &mut DecideCtx".to_owned());
        let _ = writeln!(w, "    #[doc = {}]", lit(&s.doc));
        let _ = writeln!(w, "    #[state]");
        let _ = writeln!(
            w,
            "    #[allow(unused_variables)] // a handler reads only what its rows need"
        );
        let _ = writeln!(
            w,
            "    fn {}({}) -> statig::Outcome<State> {{",
            s.name,
            params.join(", ")
        );
        if has_guards {
            let since = if s.data.iter().any(|f| f == "since") {
                "Some(*since)"
            } else {
                "None"
            };
            let attempts = if s.data.iter().any(|f| f == "attempts") {
                "*attempts"
            } else {
                "0"
            };
            let _ = writeln!(
                w,
                "        let data = StateData {{ since: {since}, attempts: {attempts} }};"
            );
        }
        let _ = writeln!(w, "        match event {{");
        for (i, row) in &rows {
            let to = state_of(&row.to);
            let creates = row.effects.iter().any(|e| e == "create_instance");
            let self_transition = row.to == row.from;
            let fields: Vec<String> = to
                .data
                .iter()
                .map(|f| {
                    let value = match (f.as_str(), self_transition, creates) {
                        ("since", true, _) => "*since".to_owned(),
                        ("since", false, _) => "context.now()".to_owned(),
                        ("attempts", true, true) => "attempts.saturating_add(1)".to_owned(),
                        ("attempts", true, false) => "*attempts".to_owned(),
                        ("attempts", false, true) => "1".to_owned(),
                        ("attempts", false, false) => "0".to_owned(),
                        _ => unreachable!("validated data field"),
                    };
                    format!("{f}: {value}")
                })
                .collect();
            let target = if fields.is_empty() {
                format!("State::{}", camel(&to.name))
            } else {
                format!("State::{} {{ {} }}", camel(&to.name), fields.join(", "))
            };
            let guard = match &row.guard {
                Some(g) => format!(" if guards::{g}(context.input(), &data)"),
                None => String::new(),
            };
            let _ = writeln!(w, "            // {}: {}", row_label(*i, row), row.note);
            let _ = writeln!(w, "            Event::{}{guard} => {{", camel(&row.on));
            let _ = writeln!(w, "                context.matched(&ROWS[{i}]);");
            let _ = writeln!(w, "                statig::Outcome::Transition({target})");
            let _ = writeln!(w, "            }}");
        }
        if !s.ignore.is_empty() {
            let pats: Vec<String> = s.ignore.iter().map(|e| format!("Event::{}", camel(e))).collect();
            let _ = writeln!(
                w,
                "            // ignore: stale or repeated observations; no effect, no audit entry."
            );
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
                "            // invalid: never derived in this state; `Super` (no superstate) means invalid."
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

    // ---- metadata -----------------------------------------------------------------------------
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
        let guard = match &row.guard {
            Some(g) => format!("Some({})", lit(g)),
            None => "None".to_owned(),
        };
        let _ = writeln!(w, "    Row {{");
        let _ = writeln!(w, "        index: {i},");
        let _ = writeln!(w, "        from: Phase::{},", camel(&row.from));
        let _ = writeln!(w, "        on: Event::{},", camel(&row.on));
        let _ = writeln!(w, "        guard: {guard},");
        let _ = writeln!(w, "        to: Phase::{},", camel(&row.to));
        let _ = writeln!(w, "        effects: &[{}],", effects.join(", "));
        let _ = writeln!(w, "        reason: {},", lit(&row.reason));
        let _ = writeln!(w, "        note: {},", lit(&row.note));
        let _ = writeln!(w, "    }},");
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
        let _ = writeln!(w, "    StateInfo {{");
        let _ = writeln!(w, "        phase: Phase::{},", camel(&s.name));
        let _ = writeln!(w, "        ignore: &[{}],", ev(&s.ignore));
        let _ = writeln!(w, "        invalid: &[{}],", ev(&s.invalid));
        let _ = writeln!(w, "    }},");
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
    let _ = writeln!(w, "];\n");

    let _ = writeln!(
        w,
        "/// The guards section of the table; `check` makes an unknown name fail to compile."
    );
    let _ = writeln!(w, "pub static GUARDS: [GuardInfo; {}] = [", t.guards.len());
    for g in &t.guards {
        let _ = writeln!(
            w,
            "    GuardInfo {{ name: {}, doc: {}, check: guards::{} }},",
            lit(&g.name),
            lit(&g.doc),
            g.name
        );
    }
    let _ = writeln!(w, "];");

    o
}
