//! Renders docs/machines.md from the compiled table (what `egress-proxies-operator machines` prints).
//!
//! The document is derived, never edited: a Mermaid state diagram of every row, one-line tables of
//! states, events, effects and guards, the rows with their notes, and the full state × event
//! matrix. A test compares docs/machines.md with [`render_markdown`] so the two cannot drift.

use std::fmt::Write as _;

use super::table::{self, Coverage, EFFECTS, Event, GUARDS, Phase, ROWS};

/// The whole of docs/machines.md.
pub fn render_markdown() -> String {
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(
        w,
        "<!-- Generated from {} by `egress-proxies-operator machines`. Do not edit:",
        table::SOURCE
    );
    let _ = writeln!(
        w,
        "     change the table, then run `cargo run -- machines > docs/machines.md`. -->"
    );
    let _ = writeln!(w);
    let _ = writeln!(w, "# Lifecycle machines");
    let _ = writeln!(w);
    let _ = writeln!(w, "## Proxy");
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "The Proxy lifecycle, from `{}`. The operator's engine is generated from that table at build \
         time, so this page, the running code and the tests agree by construction. An event a state \
         does not list as a transition is either *ignored* (no change, no effect, no audit entry) or \
         *invalid* (the engine returns `InvalidTransition` and the state is unchanged).",
        table::SOURCE
    );
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "State data: `since` is set on entering a state and kept on self-transitions; `attempts` counts the `create_instance` effects issued since entering `provisioning`."
    );
    let _ = writeln!(w);

    // Diagram.
    let _ = writeln!(w, "```mermaid");
    let _ = writeln!(w, "stateDiagram-v2");
    let _ = writeln!(w, "    [*] --> {}", Phase::INITIAL);
    for row in &ROWS {
        let label = match row.guard {
            Some(guard) => format!("{} [{guard}]", row.on),
            None => row.on.to_string(),
        };
        let _ = writeln!(w, "    {} --> {}: {label}", row.from, row.to);
    }
    for phase in Phase::ALL.iter().filter(|p| p.is_final()) {
        let _ = writeln!(w, "    {phase} --> [*]");
    }
    let _ = writeln!(w, "```");
    let _ = writeln!(w);

    // States.
    let _ = writeln!(w, "### States");
    let _ = writeln!(w);
    let _ = writeln!(w, "| State | Data | Meaning |");
    let _ = writeln!(w, "|---|---|---|");
    for phase in Phase::ALL {
        let data = phase.data_fields().join(", ");
        let marker = if phase.is_final() {
            " (final)"
        } else if phase == Phase::INITIAL {
            " (initial)"
        } else {
            ""
        };
        let _ = writeln!(w, "| `{phase}`{marker} | {data} | {} |", phase.doc());
    }
    let _ = writeln!(w);

    // Events.
    let _ = writeln!(w, "### Events");
    let _ = writeln!(w);
    let _ = writeln!(w, "| Event | Meaning |");
    let _ = writeln!(w, "|---|---|");
    for event in Event::ALL {
        let _ = writeln!(w, "| `{event}` | {} |", event.doc());
    }
    let _ = writeln!(w);

    // Effects.
    let _ = writeln!(w, "### Effects");
    let _ = writeln!(w);
    let _ = writeln!(w, "| Effect | Meaning |");
    let _ = writeln!(w, "|---|---|");
    for effect in &EFFECTS {
        let _ = writeln!(w, "| `{}` | {} |", effect.name, effect.doc);
    }
    let _ = writeln!(w);

    // Guards.
    let _ = writeln!(w, "### Guards");
    let _ = writeln!(w);
    let _ = writeln!(w, "| Guard | Holds when |");
    let _ = writeln!(w, "|---|---|");
    for guard in &GUARDS {
        let _ = writeln!(w, "| `{}` | {} |", guard.name, guard.doc);
    }
    let _ = writeln!(w);

    // Rows.
    let _ = writeln!(w, "### Transitions");
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "Rows for the same state and event are tried in order; the last one has no guard."
    );
    let _ = writeln!(w);
    let _ = writeln!(w, "| From | Event | Guard | To | Effects | Reason | Why |");
    let _ = writeln!(w, "|---|---|---|---|---|---|---|");
    for row in &ROWS {
        let guard = row.guard.map(|g| format!("`{g}`")).unwrap_or_default();
        let effects: Vec<String> = row.effects.iter().map(|e| format!("`{e}`")).collect();
        let _ = writeln!(
            w,
            "| `{}` | `{}` | {guard} | `{}` | {} | {} | {} |",
            row.from,
            row.on,
            row.to,
            effects.join(", "),
            row.reason,
            row.note
        );
    }
    let _ = writeln!(w);

    // Matrix.
    let _ = writeln!(w, "### State × event matrix");
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "A target state (with its guard when rows are guarded), `·` for ignored, **invalid** for invalid."
    );
    let _ = writeln!(w);
    let header: Vec<String> = Phase::ALL.iter().map(|p| format!("`{p}`")).collect();
    let _ = writeln!(w, "| Event | {} |", header.join(" | "));
    let _ = writeln!(w, "|---|{}", "---|".repeat(Phase::ALL.len()));
    for event in Event::ALL {
        let cells: Vec<String> = Phase::ALL
            .iter()
            .map(|&phase| match table::coverage(phase, event) {
                Coverage::Rows(rows) => rows
                    .iter()
                    .map(|r| match r.guard {
                        Some(g) => format!("{} if {g}", r.to),
                        None if rows.len() > 1 => format!("else {}", r.to),
                        None => r.to.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
                Coverage::Ignored => "·".to_owned(),
                Coverage::Invalid => "**invalid**".to_owned(),
            })
            .collect();
        let _ = writeln!(w, "| `{event}` | {} |", cells.join(" | "));
    }
    o
}

/// Where the rendered document lives, relative to the repository root.
pub const DOC_PATH: &str = "docs/machines.md";

/// docs/machines.md does not match the table.
#[derive(Debug, thiserror::Error)]
pub enum DocsError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file differs from the render.
    #[error("{path} is out of date with the transition table: run `cargo run -- machines > {DOC_PATH}`")]
    Drift {
        /// The file.
        path: std::path::PathBuf,
    },
}

/// Check that the file at `path` equals [`render_markdown`] (`machines --check`).
pub fn check_markdown(path: &std::path::Path) -> Result<(), DocsError> {
    let current = std::fs::read_to_string(path).map_err(|source| DocsError::Io {
        path: path.to_owned(),
        source,
    })?;
    if current == render_markdown() {
        Ok(())
    } else {
        Err(DocsError::Drift {
            path: path.to_owned(),
        })
    }
}
