//! What docs/operations.md promises, read from the document itself so tests keep it true.

use std::collections::BTreeSet;

/// Metric names listed in docs/operations.md's metrics table.
pub fn documented_metrics() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .expect("docs/operations.md");
    doc.lines()
        .filter_map(|line| line.strip_prefix("| `epo_"))
        .filter_map(|rest| Some(format!("epo_{}", rest.split_once('`')?.0)))
        .collect()
}
