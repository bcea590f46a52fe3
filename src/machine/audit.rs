//! The audit trail: one entry per transition (from, event, to, effects, reason).
//!
//! The recorder step of the pipeline turns each [`Decision`] that transitioned into an
//! [`AuditEntry`] (ignored events leave no entry: they change nothing). [`Audit`] collects entries
//! and renders them one line each, with times relative to a start, e.g.
//! `+45s  provisioning --health_passed--> healthy  [enable_leases, set_conditions, record_event]  (Healthy)`,
//! followed by `       cause: ...` when the event came with one (the error a failed effect
//! returned, the provider's reason for being down, what is wrong with the spec).

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::effects::EffectKind;
use super::table::{Event, Phase};
use super::{Decision, Outcome};

/// One transition, as recorded.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When the transition was decided.
    pub at: Timestamp,
    /// Phase before.
    pub from: Phase,
    /// The event.
    pub event: Event,
    /// Phase after.
    pub to: Phase,
    /// The guard literals that selected the row (empty: unguarded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guard: Vec<String>,
    /// Effects requested, in order.
    pub effects: Vec<EffectKind>,
    /// The row's bounded CamelCase reason.
    pub reason: String,
    /// The row's note (why).
    pub note: String,
    /// What caused the event, when more than its name says: a failed effect's error, the
    /// provider's reason for being down, what is wrong with the spec. Never secret content.
    pub cause: Option<String>,
}

impl AuditEntry {
    /// The entry for `decision`, caused by `cause`, or `None` if the event was ignored.
    pub fn from_decision(decision: &Decision, at: Timestamp, cause: Option<&str>) -> Option<AuditEntry> {
        let row = match (decision.outcome, decision.row) {
            (Outcome::Transitioned, Some(row)) => row,
            _ => return None,
        };
        Some(AuditEntry {
            at,
            from: decision.from.phase(),
            event: decision.event,
            to: decision.to.phase(),
            guard: row.guard.iter().map(ToString::to_string).collect(),
            effects: decision.effects.clone(),
            reason: row.reason.to_owned(),
            note: row.note.to_owned(),
            cause: cause.map(str::to_owned),
        })
    }

    /// The transition part of a line: `from --event [guard]--> to`.
    pub fn arrow(&self) -> String {
        arrow(self.from, self.event, &self.guard.join(", "), self.to.as_str())
    }
}

/// An ordered audit trail.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// Entries in the order the transitions were decided.
    pub entries: Vec<AuditEntry>,
}

impl Audit {
    /// An empty trail.
    pub fn new() -> Self {
        Audit::default()
    }

    /// Record `decision` at `at`; returns the new entry, or `None` if the event was ignored.
    pub fn record(&mut self, decision: &Decision, at: Timestamp, cause: Option<&str>) -> Option<&AuditEntry> {
        let entry = AuditEntry::from_decision(decision, at, cause)?;
        self.entries.push(entry);
        self.entries.last()
    }

    /// One line per entry, times relative to `start`.
    pub fn render(&self, start: Timestamp) -> String {
        let lines: Vec<Line> = self
            .entries
            .iter()
            .map(|e| Line {
                offset: format_offset(e.at.duration_since(start).as_secs()),
                arrow: e.arrow(),
                effects: format_effects(&e.effects),
                reason: format!("({})", e.reason),
                cause: e.cause.clone(),
            })
            .collect();
        render_lines(&lines)
    }
}

/// `from --event [guard]--> to` (an empty guard prints none).
pub(crate) fn arrow(from: Phase, event: Event, guard: &str, to: &str) -> String {
    if guard.is_empty() {
        format!("{from} --{event}--> {to}")
    } else {
        format!("{from} --{event} [{guard}]--> {to}")
    }
}

/// `[a, b, c]`, or empty for no effects.
pub(crate) fn format_effects(effects: &[EffectKind]) -> String {
    if effects.is_empty() {
        return String::new();
    }
    let names: Vec<&str> = effects.iter().map(|e| e.as_str()).collect();
    format!("[{}]", names.join(", "))
}

/// A relative time: `+0s`, `+45s`, `+2m05s`, `+1h00m00s` (negative offsets print with `-`).
pub fn format_offset(secs: i64) -> String {
    let sign = if secs < 0 { '-' } else { '+' };
    let secs = secs.unsigned_abs();
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    if h > 0 {
        format!("{sign}{h}h{m:02}m{s:02}s")
    } else if m > 0 {
        format!("{sign}{m}m{s:02}s")
    } else {
        format!("{sign}{s}s")
    }
}

/// One rendered line, split in columns that [`render_lines`] aligns.
pub(crate) struct Line {
    pub offset: String,
    pub arrow: String,
    pub effects: String,
    pub reason: String,
    /// Printed on its own indented line under the entry.
    pub cause: Option<String>,
}

/// Align the columns so a trail reads as a table.
pub(crate) fn render_lines(lines: &[Line]) -> String {
    let offset_w = lines.iter().map(|l| l.offset.len()).max().unwrap_or(0);
    let arrow_w = lines.iter().map(|l| l.arrow.len()).max().unwrap_or(0);
    let effects_w = lines.iter().map(|l| l.effects.len()).max().unwrap_or(0);
    let mut out = String::new();
    for l in lines {
        let line = format!(
            "{:<offset_w$}  {:<arrow_w$}  {:<effects_w$}  {}",
            l.offset, l.arrow, l.effects, l.reason
        );
        out.push_str(line.trim_end());
        out.push('\n');
        if let Some(cause) = &l.cause {
            out.push_str(&format!("{:offset_w$}  cause: {cause}\n", ""));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_read_naturally() {
        assert_eq!(format_offset(0), "+0s");
        assert_eq!(format_offset(45), "+45s");
        assert_eq!(format_offset(125), "+2m05s");
        assert_eq!(format_offset(3600), "+1h00m00s");
        assert_eq!(format_offset(-5), "-5s");
    }
}
