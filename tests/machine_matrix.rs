//! The whole state × event matrix as the running engine decides it (an insta snapshot), and the
//! agreement between the generated handlers, the row metadata and the persisted form.

use egress_proxies_operator::machine::scenario::EPOCH;
use egress_proxies_operator::machine::table::{EFFECTS, GUARDS, ROWS, STATES};
use egress_proxies_operator::machine::{
    Coverage, EffectKind, Event, GuardInput, Outcome, Phase, State, StateRecord, coverage, decide,
};

const MAX: u32 = GuardInput::DEFAULT_MAX_CREATE_ATTEMPTS;

/// Every combination that flips a guard: attempts left or not, leases active or not.
fn variants(phase: Phase) -> Vec<(State, GuardInput)> {
    let mut out = Vec::new();
    for attempts in [1, MAX] {
        for active_leases in [0, 2] {
            out.push((
                State::from_parts(phase, EPOCH, attempts),
                GuardInput {
                    max_create_attempts: MAX,
                    active_leases,
                },
            ));
        }
    }
    out
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
        for event in Event::ALL {
            // Distinct outcomes over the guard variants, in row order.
            let mut cells: Vec<(usize, String)> = Vec::new();
            for (state, input) in variants(phase) {
                let cell = match decide(&state, event, &input, now()) {
                    Ok(d) if d.outcome == Outcome::Ignored => (usize::MAX, "ignored".to_owned()),
                    Ok(d) => {
                        let row = d.row.expect("a transition has a row");
                        let when = match row.guard {
                            Some(g) => format!("if {g}: "),
                            None if matches!(coverage(phase, event), Coverage::Rows(ref r) if r.len() > 1) => {
                                "else: ".to_owned()
                            }
                            None => String::new(),
                        };
                        (
                            row.index,
                            format!(
                                "{when}-> {}  [{}]  ({})",
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
        for event in Event::ALL {
            for (state, input) in variants(phase) {
                let decision = decide(&state, event, &input, now());
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
                        assert!(
                            rows.contains(&row),
                            "{phase}/{event}: row #{} is not one of the pair's",
                            row.index
                        );
                        assert_eq!(d.outcome, Outcome::Transitioned);
                        assert_eq!(d.to.phase(), row.to);
                        assert_eq!(d.effects, row.effects);
                        // The first row whose guard holds wins; the unguarded last row otherwise.
                        let expected = rows
                            .iter()
                            .find(|r| match r.guard {
                                Some(g) => {
                                    let guard = GUARDS.iter().find(|x| x.name == g).expect("known guard");
                                    (guard.check)(&input, &state.data())
                                }
                                None => true,
                            })
                            .expect("a fallback row exists");
                        assert_eq!(row.index, expected.index, "{phase}/{event}");
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
        let taken = variants(row.from).into_iter().any(|(state, input)| {
            decide(&state, row.on, &input, now()).is_ok_and(|d| d.row.is_some_and(|r| r.index == i))
        });
        assert!(
            taken,
            "row #{i} ({} --{}--> {}) is never taken",
            row.from, row.on, row.to
        );
    }
}

/// Data rules: a new state starts `since` now with attempts from its create; a self-transition
/// keeps `since` and counts its create.
#[test]
fn state_data_follows_the_rules() {
    for phase in Phase::ALL {
        for event in Event::ALL {
            for (state, input) in variants(phase) {
                let Ok(d) = decide(&state, event, &input, now()) else {
                    continue;
                };
                if d.outcome == Outcome::Ignored {
                    continue;
                }
                let creates = u32::from(d.effects.contains(&EffectKind::CreateInstance));
                let (before, after) = (state.data(), d.to.data());
                if d.to.phase() == phase {
                    assert_eq!(after.since, before.since, "{phase}/{event}: self keeps since");
                    assert_eq!(after.attempts, before.attempts + creates, "{phase}/{event}");
                } else {
                    if d.to.phase().data_fields().contains(&"since") {
                        assert_eq!(after.since, Some(now()), "{phase}/{event}: new state starts now");
                    }
                    if d.to.phase().data_fields().contains(&"attempts") {
                        assert_eq!(after.attempts, creates, "{phase}/{event}");
                    }
                }
            }
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
fn names_round_trip() {
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
    assert_eq!(Event::from_name("nope"), None);
}

/// The status form: flat, lossless, strict about missing data.
#[test]
fn state_persists_flat() {
    let state = State::Provisioning {
        since: EPOCH,
        attempts: 2,
    };
    let json = serde_json::to_value(&state).expect("serializes");
    assert_eq!(
        json,
        serde_json::json!({"phase": "provisioning", "since": "2025-01-01T00:00:00Z", "attempts": 2})
    );
    assert_eq!(
        serde_json::to_value(State::Pending).expect("json"),
        serde_json::json!({"phase": "pending"})
    );
    assert_eq!(
        serde_json::to_value(State::Healthy { since: EPOCH }).expect("json"),
        serde_json::json!({"phase": "healthy", "since": "2025-01-01T00:00:00Z"})
    );
    for phase in Phase::ALL {
        let state = State::from_parts(phase, EPOCH, 3);
        let back: State = serde_json::from_value(serde_json::to_value(&state).expect("json")).expect("back");
        assert_eq!(back, state);
        let record = StateRecord::from(state.clone());
        assert_eq!(State::try_from(record).expect("record converts"), state);
    }
    let err = serde_json::from_value::<State>(
        serde_json::json!({"phase": "provisioning", "since": "2025-01-01T00:00:00Z"}),
    )
    .expect_err("attempts missing");
    assert!(err.to_string().contains("attempts"), "{err}");
    assert!(serde_json::from_value::<State>(serde_json::json!({"phase": "exploded"})).is_err());
}

/// The schema a CRD status embeds is a flat object (structural for Kubernetes).
#[test]
fn state_schema_is_flat() {
    let schema = serde_json::to_value(schemars::schema_for!(State)).expect("schema json");
    let props = schema["properties"].as_object().expect("properties");
    assert_eq!(
        props.keys().cloned().collect::<Vec<_>>(),
        vec!["attempts".to_owned(), "phase".to_owned(), "since".to_owned()]
    );
    assert!(schema.get("oneOf").is_none() && schema.get("anyOf").is_none());
}
