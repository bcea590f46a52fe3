//! Live progress on the terminal: proxies per phase and the most recent transitions, printed to
//! stderr whenever they change (besides the structured logs).

use std::{
    collections::{BTreeMap, VecDeque},
    io::Write,
    sync::Mutex,
};

use crate::{api::ProxyKey, machine::AuditEntry};

/// How many recent transitions the summary shows.
const RECENT: usize = 3;

/// The progress view.
#[derive(Default)]
pub struct Progress {
    state: Mutex<View>,
}

#[derive(Default, PartialEq)]
struct View {
    phases: BTreeMap<String, usize>,
    recent: VecDeque<String>,
    invalid_files: usize,
    printed: String,
    muted: bool,
}

impl Progress {
    /// Notes a transition.
    pub fn transition(&self, key: &ProxyKey, entry: &AuditEntry) {
        let mut view = crate::sync::lock(&self.state);
        view.recent
            .push_back(format!("{key} {} -> {} ({})", entry.from, entry.to, entry.reason));
        while view.recent.len() > RECENT {
            view.recent.pop_front();
        }
    }

    /// Sets the counts of proxies per phase and of manifest files with problems.
    pub fn set_counts(&self, phases: BTreeMap<String, usize>, invalid_files: usize) {
        let mut view = crate::sync::lock(&self.state);
        view.phases = phases;
        view.invalid_files = invalid_files;
    }

    /// How many proxies are in `phase`.
    pub fn count(&self, phase: &str) -> usize {
        crate::sync::lock(&self.state)
            .phases
            .get(phase)
            .copied()
            .unwrap_or(0)
    }

    /// The summary line.
    pub fn line(&self) -> String {
        let view = crate::sync::lock(&self.state);
        render(&view)
    }

    /// Never print again: stderr carries JSON log lines only (`--json-logs`), which a plain
    /// text line would break for the programs that parse them.
    pub fn mute(&self) {
        crate::sync::lock(&self.state).muted = true;
    }

    /// Prints the summary to stderr if it changed since the last print (unless muted).
    pub fn print_if_changed(&self) {
        let mut view = crate::sync::lock(&self.state);
        let line = render(&view);
        if line != view.printed && !view.muted {
            // The terminal is a user interface here, not a log: write it directly.
            let _ = writeln!(std::io::stderr(), "{line}");
            view.printed = line;
        }
    }
}

fn render(view: &View) -> String {
    let total: usize = view.phases.values().sum();
    let phases: Vec<String> = view
        .phases
        .iter()
        .map(|(phase, n)| format!("{phase} {n}"))
        .collect();
    let mut line = format!("[standalone] {total} proxies ({})", phases.join(", "));
    if view.invalid_files > 0 {
        line.push_str(&format!(
            " | {} manifest file(s) with problems",
            view.invalid_files
        ));
    }
    if !view.recent.is_empty() {
        line.push_str(" | recent: ");
        line.push_str(&view.recent.iter().cloned().collect::<Vec<_>>().join("; "));
    }
    line
}
