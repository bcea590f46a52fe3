//! What docs/operations.md promises, read from the document itself so tests keep it true.

#![allow(dead_code)] // Each test binary uses a different part of the support code.

use std::collections::BTreeSet;

/// Metric names listed in docs/operations.md's metrics table that every mode exposes (rows
/// marked "standalone mode only" are left out: [`standalone_only_metrics`]).
pub fn documented_metrics() -> BTreeSet<String> {
    metric_rows(false)
}

/// Metric names of the rows of docs/operations.md's metrics table marked "standalone mode only".
pub fn standalone_only_metrics() -> BTreeSet<String> {
    metric_rows(true)
}

fn metric_rows(standalone_only: bool) -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .expect("docs/operations.md");
    doc.lines()
        .filter(|line| line.contains("standalone mode only") == standalone_only)
        .filter_map(|line| line.strip_prefix("| `epo_"))
        .filter_map(|rest| Some(format!("epo_{}", rest.split_once('`')?.0)))
        .collect()
}
