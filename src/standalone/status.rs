//! `egress-proxies-operator status`: the proxies of a state folder as `kubectl get` would show
//! them, and one proxy's audit trail.

use std::fmt::Write as _;

use jiff::Timestamp;

use super::store::{ReadOnlyStore, StoreError};
use crate::{
    api::ProxyKey,
    ui::{age, phase_label},
};

/// A table of every proxy; `leases` gives the active leases of a proxy.
pub fn render_table(
    store: &ReadOnlyStore,
    now: Timestamp,
    leases: &dyn Fn(&ProxyKey) -> u32,
) -> Result<String, StoreError> {
    let mut rows = vec![[
        "NAMESPACE".to_owned(),
        "NAME".to_owned(),
        "PHASE".to_owned(),
        "PROVIDER".to_owned(),
        "ENDPOINT".to_owned(),
        "LEASES".to_owned(),
        "AGE".to_owned(),
    ]];
    for (key, record) in store.list()? {
        let status = record.status.unwrap_or_default();
        let provider = record
            .spec
            .get("provider")
            .and_then(|p| p.as_str())
            .unwrap_or("-")
            .to_owned();
        let phase = phase_label(status.phase.as_deref().unwrap_or("pending"), record.deleting);
        rows.push([
            key.namespace().to_owned(),
            key.name().to_owned(),
            phase,
            provider,
            status.endpoint.unwrap_or_else(|| "-".to_owned()),
            leases(&key).to_string(),
            age(now, record.created),
        ]);
    }
    Ok(align(&rows))
}

/// The audit trail of `key`, one line per transition (kept after the Proxy is deleted); `None`
/// if the state folder has neither a trail nor a record of it.
pub fn render_audit(store: &ReadOnlyStore, key: &ProxyKey) -> Result<Option<String>, StoreError> {
    let mut out = String::new();
    for line in store.audit(key)? {
        let entry = &line.entry;
        let _ = writeln!(
            out,
            "{}  {}  [{}]  ({}) {}",
            entry.at.strftime("%Y-%m-%d %H:%M:%S"),
            entry.arrow(),
            entry
                .effects
                .iter()
                .map(|e| e.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            entry.reason,
            line.message
        );
    }
    if out.is_empty() {
        if store.get(key)?.is_none() {
            return Ok(None);
        }
        out = format!("no transition of {key} yet\n");
    }
    Ok(Some(out))
}

fn align(rows: &[[String; 7]]) -> String {
    let mut widths = [0usize; 7];
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.len());
        }
    }
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = widths[i]))
            .collect();
        let _ = writeln!(out, "{}", cells.join("   ").trim_end());
    }
    out
}
