//! Renders docs/machines.md from the compiled table (what `egress-proxies-operator machines` prints).
//!
//! The document is derived, never edited: a Mermaid state diagram of every row, one-line tables of
//! facts, states (with their timers), events (with what raises them, in priority order), effects
//! and timers (with their defaults), the rows with their notes, and the full state × event matrix.
//! A test compares docs/machines.md with [`render_markdown`] so the two cannot drift.

use std::fmt::Write as _;

use super::table::{self, Coverage, EFFECTS, EVENTS, Fact, Phase, ROWS, TimerKind, format_literals};

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
         time, so this page, the running code and the tests agree by construction.",
        table::SOURCE
    );
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "One reconcile runs rounds of **observe** (the facts below, from the world and the status) → \
         **derive** (the first event in priority order whose facts all hold and that the state does \
         not ignore) → **decide** (the first row whose guard facts hold) → **plan** (the row's effects \
         with their parameters) → **execute** (one executor per effect; failures come back as the \
         events listed as raised by that effect, decided next). Rounds repeat until no event is \
         derived; the status is then written once, only if it changed. An event a state does not \
         list as a transition is either *ignored* (no change, no effect, no audit entry; derive \
         moves on to the next event) or *invalid* (it cannot happen there: only effect-raised events \
         can be invalid, and the engine returns `InvalidTransition`)."
    );
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "Every state records `since`, when it was entered (kept on a self-transition unless the row \
         re-enters, which restarts the state's timer). Failed provider calls are counted in \
         `status.retryAttempts`; `schedule_retry` sets `status.nextAttemptTime` with an exponential \
         backoff (default 10 s doubling to 5 min, up to 10 % jitter; a rejected create waits the cap \
         at once), `schedule_check` sets it one first backoff step ahead without counting (a \
         terminating instance is no failure), an attempt that runs clears it, and `retry_due` holds \
         once that time has come, the user edited the spec, or the credentials Secret was rotated \
         again after a failed update. How far the delete of a leaving instance got \
         (`delete_attempted`, `delete_accepted`) is kept as the reason of `Provisioned=False`. After \
         a reconcile the operator looks again at the nearest time ahead (a timer, a retry, the poll \
         of a state that waits for the world, the resync), never sooner than 1 s. Pool \
         budgets (defaults: `maxUnavailable` 25 %, `maxUnhealthy` 40 %) are computed per provider \
         instance; see docs/operations.md for the flags."
    );
    let _ = writeln!(w);

    // Diagram.
    let _ = writeln!(w, "```mermaid");
    let _ = writeln!(w, "stateDiagram-v2");
    let _ = writeln!(w, "    [*] --> {}", Phase::INITIAL);
    for row in &ROWS {
        let label = if row.guard.is_empty() {
            row.on.to_string()
        } else {
            format!("{} [{}]", row.on, format_literals(row.guard))
        };
        let _ = writeln!(w, "    {} --> {}: {label}", row.from, row.to);
    }
    for phase in Phase::ALL.iter().filter(|p| p.is_final()) {
        let _ = writeln!(w, "    {phase} --> [*]");
    }
    let _ = writeln!(w, "```");
    let _ = writeln!(w);

    // States.
    heading(w, "States");
    columns(w, &["State", "Timer", "Meaning"]);
    for phase in Phase::ALL {
        let data = phase
            .timer()
            .map(|t| format!("`{t}`", t = t.as_str()))
            .unwrap_or_default();
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

    // Facts.
    heading(w, "Facts");
    columns(w, &["Fact", "Holds when"]);
    for fact in Fact::ALL {
        let _ = writeln!(w, "| `{fact}` | {} |", fact.doc());
    }
    let _ = writeln!(w);

    // Events.
    heading(w, "Events (in priority order)");
    columns(w, &["#", "Event", "Derived when", "Raised by", "Meaning"]);
    for (i, info) in EVENTS.iter().enumerate() {
        let raised: Vec<String> = info.raised_by.iter().map(|e| format!("`{e}`")).collect();
        let when = if info.when.is_empty() {
            String::new()
        } else {
            format!("`{}`", format_literals(info.when))
        };
        let _ = writeln!(
            w,
            "| {} | `{}` | {when} | {} | {} |",
            i + 1,
            info.event,
            raised.join(", "),
            info.event.doc()
        );
    }
    let _ = writeln!(w);

    // Timers.
    heading(w, "Timers");
    columns(w, &["Timer", "Default", "Flag", "Meaning"]);
    for timer in TimerKind::ALL {
        let _ = writeln!(
            w,
            "| `{}` | {} s | `--{}` | {} |",
            timer.as_str(),
            timer.default_duration().as_secs(),
            timer.as_str().replace('_', "-"),
            timer.doc()
        );
    }
    let _ = writeln!(w);

    // Effects.
    heading(w, "Effects");
    columns(w, &["Effect", "Meaning"]);
    for effect in &EFFECTS {
        let _ = writeln!(w, "| `{}` | {} |", effect.name, effect.doc);
    }
    let _ = writeln!(w);

    // Rows.
    heading(w, "Transitions");
    let _ = writeln!(
        w,
        "Rows for the same state and event are tried in order; a guard is a list of facts that must \
         all hold; the last row has no guard. *Re-enters* restarts the state's timer."
    );
    let _ = writeln!(w);
    columns(w, &["From", "Event", "Guard", "To", "Effects", "Reason", "Why"]);
    for row in &ROWS {
        let mut guard = if row.guard.is_empty() {
            String::new()
        } else {
            format!("`{}`", format_literals(row.guard))
        };
        if row.reenter {
            guard.push_str(" (re-enters)");
        }
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
    heading(w, "State × event matrix");
    let _ = writeln!(
        w,
        "A target state (with its guard when rows are guarded), `·` for ignored, **invalid** for invalid."
    );
    let _ = writeln!(w);
    let phases: Vec<String> = Phase::ALL.iter().map(|p| format!("`{p}`")).collect();
    let header: Vec<&str> = std::iter::once("Event")
        .chain(phases.iter().map(String::as_str))
        .collect();
    columns(w, &header);
    for event in table::Event::ALL {
        let cells: Vec<String> = Phase::ALL
            .iter()
            .map(|&phase| match table::coverage(phase, event) {
                Coverage::Rows(rows) => rows
                    .iter()
                    .map(|r| {
                        if !r.guard.is_empty() {
                            format!("{} if {}", r.to, format_literals(r.guard))
                        } else if rows.len() > 1 {
                            format!("else {}", r.to)
                        } else {
                            r.to.to_string()
                        }
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

/// A `###` heading and the blank line after it.
fn heading(w: &mut String, title: &str) {
    let _ = writeln!(w, "### {title}\n");
}

/// A Markdown table's header row and separator.
fn columns(w: &mut String, names: &[&str]) {
    let _ = writeln!(w, "| {} |", names.join(" | "));
    let _ = writeln!(w, "|{}", "---|".repeat(names.len()));
}

/// Where the rendered document lives, relative to the repository root.
pub const DOC_PATH: &str = "docs/machines.md";

/// docs/machines.md does not match the table.
#[derive(Debug, thiserror::Error)]
pub enum DocsError {
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        cause: std::io::Error,
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
    let current = std::fs::read_to_string(path).map_err(|cause| DocsError::Io {
        path: path.to_owned(),
        cause,
    })?;
    if current == render_markdown() {
        Ok(())
    } else {
        Err(DocsError::Drift {
            path: path.to_owned(),
        })
    }
}
