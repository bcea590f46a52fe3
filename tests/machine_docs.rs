//! docs/machines.md is exactly what the table renders, and explains every name in one line.

use egress_proxies_operator::machine::docs::render_markdown;
use egress_proxies_operator::machine::table::EFFECTS;
use egress_proxies_operator::machine::{Event, Fact, Phase, TimerKind};

#[test]
fn docs_machines_md_matches_the_table() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/machines.md");
    let on_disk = std::fs::read_to_string(&path).expect("docs/machines.md exists");
    assert!(
        on_disk == render_markdown(),
        "docs/machines.md drifted from machines/proxy.yaml: run `cargo run -- machines > docs/machines.md` and commit"
    );
}

#[test]
fn every_name_is_explained_in_one_line() {
    let doc = render_markdown();
    for phase in Phase::ALL {
        assert!(doc.contains(phase.doc()), "state {phase}");
    }
    for event in Event::ALL {
        assert!(
            doc.contains(&format!("`{event}` |")) && doc.contains(event.doc()),
            "event {event}"
        );
    }
    for effect in &EFFECTS {
        assert!(
            doc.contains(&format!("| `{}` | {} |", effect.name, effect.doc)),
            "effect {}",
            effect.name
        );
    }
    for fact in Fact::ALL {
        assert!(
            doc.contains(&format!("| `{fact}` | {} |", fact.doc())),
            "fact {fact}"
        );
    }
    for timer in TimerKind::ALL {
        assert!(doc.contains(timer.doc()), "timer {}", timer.as_str());
    }
    assert!(doc.contains("```mermaid\nstateDiagram-v2\n"));
}
