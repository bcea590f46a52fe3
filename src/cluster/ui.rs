//! Cluster mode's part of the status page ([`crate::ui`]): the Proxies from the controller's reflector cache
//! (no extra watch) and the last audit entries per Proxy, recorded in memory as the controller
//! reconciles (cluster mode's audit otherwise lives only in Events and logs).

use std::sync::{Arc, OnceLock};

use kube::{ResourceExt, runtime::reflector};

use crate::{
    api::Proxy,
    machine::audit::AuditEntry,
    ui::{AuditLog, AuditRow, ProxySource, ProxyState, UiError},
};

/// What the controller shares with the page; cheap to clone.
#[derive(Clone, Default)]
pub struct ClusterFeed {
    proxies: Arc<OnceLock<reflector::Store<Proxy>>>,
    audit: AuditLog,
}

impl ClusterFeed {
    /// The controller's Proxy cache (set once, when the controller starts).
    pub fn set_proxies(&self, store: reflector::Store<Proxy>) {
        let _ = self.proxies.set(store);
    }

    /// Puts rows from before this process (earlier leaders' Events) in front of each Proxy's
    /// trail.
    pub fn seed(&self, rows: impl IntoIterator<Item = (String, String, AuditRow)>) {
        let mut per_proxy: std::collections::HashMap<(String, String), Vec<AuditRow>> =
            std::collections::HashMap::new();
        for (namespace, name, row) in rows {
            per_proxy.entry((namespace, name)).or_default().push(row);
        }
        for ((namespace, name), rows) in per_proxy {
            self.audit.seed(&namespace, &name, rows);
        }
    }

    /// Records the audit entries of one reconcile of `proxy`.
    pub fn record(&self, proxy: &Proxy, entries: &[AuditEntry]) {
        if !entries.is_empty() {
            self.audit
                .record(&proxy.namespace().unwrap_or_default(), &proxy.name_any(), entries);
        }
    }
}

impl ProxySource for ClusterFeed {
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError> {
        let store = self
            .proxies
            .get()
            .ok_or_else(|| UiError::Source("the controller has not started".to_owned()))?;
        let proxies: Vec<ProxyState> = store
            .state()
            .iter()
            .map(|p| {
                ProxyState::from_status(
                    &p.namespace().unwrap_or_default(),
                    &p.name_any(),
                    &p.spec.provider,
                    p.status.as_ref(),
                    p.metadata.deletion_timestamp.is_some(),
                    p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                )
            })
            .collect();
        // Trails of Proxies that are gone are dropped here, so the log stays bounded.
        self.audit
            .retain(|namespace, name| proxies.iter().any(|p| p.namespace == namespace && p.name == name));
        Ok(proxies)
    }

    fn audit(&self, namespace: &str, name: &str, n: usize) -> Vec<AuditRow> {
        self.audit.last(namespace, name, n)
    }

    fn mode(&self) -> &'static str {
        "cluster"
    }
}
