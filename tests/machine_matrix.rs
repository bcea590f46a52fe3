//! The whole state × event matrix as the running engine decides it (an insta snapshot), and the
//! agreement between the generated handlers, the row metadata and the persisted form.

use egress_proxies_operator::machine::table::{EFFECTS, ROWS, STATES};
use egress_proxies_operator::machine::{
    Coverage, EffectKind, Event, Fact, Facts, Outcome, Phase, State, StateRecord, coverage, decide, reason,
};

const EPOCH: jiff::Timestamp = jiff::Timestamp::constant(1_735_689_600, 0);

/// The facts any guard reads.
fn guard_facts() -> Vec<Fact> {
    let mut facts: Vec<Fact> = ROWS.iter().flat_map(|r| r.guard.iter().map(|l| l.fact)).collect();
    facts.sort();
    facts.dedup();
    facts
}

/// Every combination of the guard facts.
fn variants() -> Vec<Facts> {
    let facts = guard_facts();
    (0..1u32 << facts.len())
        .map(|bits| {
            facts.iter().enumerate().fold(Facts::NONE, |acc, (i, fact)| {
                acc.with(*fact, bits & (1 << i) != 0)
            })
        })
        .collect()
}

fn now() -> jiff::Timestamp {
    EPOCH + jiff::SignedDuration::from_secs(60)
}

fn effects(list: &[EffectKind]) -> String {
    list.iter().map(|e| e.as_str()).collect::<Vec<_>>().join(", ")
}

#[test]
fn whole_matrix() {
    let width = Event::ALL.iter().map(|e| e.as_str().len()).max().unwrap_or(0);
    let mut out = String::new();
    for phase in Phase::ALL {
        out.push_str(&format!("{phase}\n"));
        let state = State::new(phase, EPOCH);
        for event in Event::ALL {
            // Distinct outcomes over the guard variants, in row order.
            let mut cells: Vec<(usize, String)> = Vec::new();
            for facts in variants() {
                let cell = match decide(&state, event, facts, now()) {
                    Ok(d) if d.outcome == Outcome::Ignored => (usize::MAX, "ignored".to_owned()),
                    Ok(d) => {
                        let row = d.row.expect("a transition has a row");
                        let when = if !row.guard.is_empty() {
                            let guard: Vec<String> = row.guard.iter().map(ToString::to_string).collect();
                            format!("if {}: ", guard.join(", "))
                        } else if matches!(coverage(phase, event), Coverage::Rows(ref r) if r.len() > 1) {
                            "else: ".to_owned()
                        } else {
                            String::new()
                        };
                        let reenter = if row.reenter { " (re-enters)" } else { "" };
                        (
                            row.index,
                            format!(
                                "{when}-> {}{reenter}  [{}]  ({})",
                                d.to.phase(),
                                effects(&d.effects),
                                row.reason
                            ),
                        )
                    }
                    Err(_) => (usize::MAX, "INVALID".to_owned()),
                };
                if !cells.contains(&cell) {
                    cells.push(cell);
                }
            }
            cells.sort();
            for (i, (_, cell)) in cells.iter().enumerate() {
                let name = if i == 0 { event.as_str() } else { "" };
                out.push_str(&format!("  {name:<width$}  {cell}\n"));
            }
        }
    }
    insta::with_settings!(
        { snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"), omit_expression => true },
        { insta::assert_snapshot!("state_event_matrix", out) }
    );
}

/// `decide` agrees with the table's declared coverage for every pair and every guard variant.
#[test]
fn decide_follows_declared_coverage() {
    for phase in Phase::ALL {
        let state = State::new(phase, EPOCH);
        for event in Event::ALL {
            for facts in variants() {
                let decision = decide(&state, event, facts, now());
                match (coverage(phase, event), decision) {
                    (Coverage::Ignored, Ok(d)) => {
                        assert_eq!(d.outcome, Outcome::Ignored);
                        assert_eq!(d.to, state, "ignored keeps the state");
                        assert!(d.effects.is_empty());
                    }
                    (Coverage::Invalid, Err(e)) => {
                        assert_eq!((e.state, e.event), (state.clone(), event));
                    }
                    (Coverage::Rows(rows), Ok(d)) => {
                        let row = d.row.expect("row");
                        assert_eq!(d.outcome, Outcome::Transitioned);
                        assert_eq!(d.to.phase(), row.to);
                        assert_eq!(d.effects, row.effects);
                        // The first row whose guard holds wins; the unguarded last row otherwise.
                        let expected = rows
                            .iter()
                            .find(|r| facts.all(r.guard))
                            .expect("a fallback row exists");
                        assert_eq!(row.index, expected.index, "{phase}/{event} with {facts:?}");
                    }
                    (cov, d) => panic!("{phase}/{event}: coverage {cov:?} but decide gave {d:?}"),
                }
            }
        }
    }
}

/// Every row can be taken: the generated handlers and ROWS are the same table.
#[test]
fn every_row_is_reachable_through_decide() {
    for (i, row) in ROWS.iter().enumerate() {
        assert_eq!(row.index, i);
        let state = State::new(row.from, EPOCH);
        let taken = variants().into_iter().any(|facts| {
            decide(&state, row.on, facts, now()).is_ok_and(|d| d.row.is_some_and(|r| r.index == i))
        });
        assert!(
            taken,
            "row #{i} ({} --{}--> {}) is never taken",
            row.from, row.on, row.to
        );
    }
}

/// `since`: a new state starts now; a self-transition keeps it unless the row re-enters.
#[test]
fn since_follows_the_rules() {
    for row in &ROWS {
        let state = State::new(row.from, EPOCH);
        let facts = variants()
            .into_iter()
            .find(|f| f.all(row.guard))
            .expect("satisfiable guard");
        let Ok(d) = decide(&state, row.on, facts, now()) else {
            continue;
        };
        if d.row.map(|r| r.index) != Some(row.index) {
            continue;
        }
        if row.to == row.from && !row.reenter {
            assert_eq!(
                d.to.since(),
                EPOCH,
                "row #{}: a self-transition keeps since",
                row.index
            );
        } else {
            assert_eq!(
                d.to.since(),
                now(),
                "row #{}: a new (or re-entered) state starts now",
                row.index
            );
        }
    }
}

#[test]
fn effect_names_match_the_rust_enum() {
    let mut documented: Vec<EffectKind> = EFFECTS.iter().map(|e| e.kind).collect();
    for info in &EFFECTS {
        assert_eq!(info.kind.as_str(), info.name);
        let json = serde_json::to_string(&info.kind).expect("serializes");
        assert_eq!(json, format!("\"{}\"", info.name));
    }
    documented.sort();
    let mut all = EffectKind::ALL.to_vec();
    all.sort();
    assert_eq!(
        documented, all,
        "the table documents every EffectKind and nothing else"
    );
    assert_eq!(STATES.len(), Phase::ALL.len());
}

#[test]
fn names_round_trip_and_reasons_are_constants() {
    for phase in Phase::ALL {
        assert_eq!(Phase::from_name(phase.as_str()), Some(phase));
    }
    for event in Event::ALL {
        assert_eq!(Event::from_name(event.as_str()), Some(event));
        assert_eq!(
            serde_json::to_string(&event).expect("json"),
            format!("\"{event}\"")
        );
    }
    for fact in Fact::ALL {
        assert_eq!(Fact::from_name(fact.as_str()), Some(fact));
    }
    assert_eq!(Event::from_name("nope"), None);
    for row in &ROWS {
        assert!(
            reason::ALL.contains(&row.reason),
            "row #{} reason {} is a constant",
            row.index,
            row.reason
        );
    }
    assert_eq!(reason::SPEC_CHANGED, "SpecChanged");
}

/// The status form: flat and lossless.
#[test]
fn state_persists_flat() {
    let state = State::Provisioning { since: EPOCH };
    let json = serde_json::to_value(&state).expect("serializes");
    assert_eq!(
        json,
        serde_json::json!({"phase": "provisioning", "since": "2025-01-01T00:00:00Z"})
    );
    for phase in Phase::ALL {
        let state = State::new(phase, EPOCH);
        let back: State = serde_json::from_value(serde_json::to_value(&state).expect("json")).expect("back");
        assert_eq!(back, state);
        assert_eq!(State::from(StateRecord::from(state.clone())), state);
    }
    assert!(serde_json::from_value::<State>(serde_json::json!({"phase": "provisioning"})).is_err());
    assert!(
        serde_json::from_value::<State>(
            serde_json::json!({"phase": "exploded", "since": "2025-01-01T00:00:00Z"})
        )
        .is_err()
    );
}

/// The schema a CRD status embeds is a flat object (structural for Kubernetes).
#[test]
fn state_schema_is_flat() {
    let schema = serde_json::to_value(schemars::schema_for!(State)).expect("schema json");
    let props = schema["properties"].as_object().expect("properties");
    assert_eq!(
        props.keys().cloned().collect::<Vec<_>>(),
        vec!["phase".to_owned(), "since".to_owned()]
    );
    assert!(schema.get("oneOf").is_none() && schema.get("anyOf").is_none());
}
