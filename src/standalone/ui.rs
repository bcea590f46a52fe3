//! Standalone mode's part of the status page ([`crate::ui`]): the Proxies' records and audit
//! trails, read from the embedded store like `egress-proxies-operator status` does.

use std::path::{Path, PathBuf};

use super::store::{ReadOnlyStore, Store};
use crate::{
    api::ProxyKey,
    ui::{AuditRow, ProxySource, ProxyState, UiError},
};

/// Reads a state folder for the status page.
pub struct StoreSource(PathBuf);

impl StoreSource {
    /// The source of the state folder `state` (read at each view: the runner may create it
    /// after this).
    pub fn new(state: &Path) -> Self {
        Self(state.to_owned())
    }

    fn store(&self) -> Result<ReadOnlyStore, UiError> {
        Store::read_only(&self.0).map_err(|e| UiError::Source(e.to_string()))
    }
}

impl ProxySource for StoreSource {
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError> {
        let records = self.store()?.list().map_err(|e| UiError::Source(e.to_string()))?;
        Ok(records
            .into_iter()
            .map(|(key, record)| {
                let provider = record.provider().unwrap_or("-");
                ProxyState::from_status(
                    key.namespace(),
                    key.name(),
                    provider,
                    record.status.as_ref(),
                    record.deleting,
                    Some(record.created),
                )
            })
            .collect())
    }

    fn audit(&self, namespace: &str, name: &str, n: usize) -> Vec<AuditRow> {
        let key = ProxyKey::new(namespace, name);
        // An unreadable trail shows as empty; the page still renders the rest.
        let lines = self
            .store()
            .and_then(|store| store.audit(&key).map_err(|e| UiError::Source(e.to_string())))
            .unwrap_or_default();
        lines[lines.len().saturating_sub(n)..]
            .iter()
            .map(|line| AuditRow::from_entry(&line.entry, &line.message))
            .collect()
    }

    fn mode(&self) -> &'static str {
        "standalone"
    }
}
