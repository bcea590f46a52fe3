//! Orphan garbage collection: deletes provider instances whose owning Proxy is gone.
//!
//! An instance is collected only if all of these hold:
//! - its provider reports it as its own (each provider lists only what it made, so another
//!   provider type's instances are never seen);
//! - its persisted owner is known (an instance without a readable owner is never touched);
//! - no live Proxy has the owner's UID, as the source of truth says *now* (the API server in
//!   cluster mode, not a cache that may lag a create);
//! - it is older than the grace period, so an instance whose create is in flight (its Proxy may
//!   not be visible yet) is spared;
//! - in namespace-restricted mode, its owner lived in the watched namespace: instances of other
//!   namespaces are invisible to us and therefore never judged.

use std::{
    collections::{BTreeMap, HashSet},
    future::Future,
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::{info, warn};

use crate::{
    provider::{Instance, ProviderRegistry},
    telemetry::Metrics,
};

/// Where the live owners come from.
#[async_trait]
pub trait LiveOwners: Send + Sync {
    /// UIDs of every live Proxy (in `namespace`, if restricted), read from the source of truth.
    async fn live_uids(&self, namespace: Option<&str>) -> Result<HashSet<String>, String>;
}

/// GC settings.
#[derive(Clone, Debug)]
pub struct GcConfig {
    /// Instances younger than this are never collected.
    pub grace: Duration,
    /// Only log what would be deleted.
    pub dry_run: bool,
    /// Restrict to owners in this namespace (namespace-restricted mode with GC allowed).
    pub namespace: Option<String>,
}

/// What one GC pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Provider IDs deleted (or, in dry-run, that would have been).
    pub collected: Vec<String>,
    /// Orphans spared because they are younger than the grace period.
    pub spared_young: Vec<String>,
    /// Instances without a readable owner (never touched).
    pub unknown_owner: Vec<String>,
    /// Providers that could not be listed.
    pub failed_providers: Vec<String>,
    /// Instances actually deleted, per provider instance name (none in dry-run).
    pub deleted: BTreeMap<String, u64>,
}

/// Whether GC may run at all, given the operator's scope. Namespace-restricted mode cannot see
/// every Proxy, so it disables GC unless explicitly allowed.
pub fn gc_enabled(namespace: Option<&str>, allow_namespaced: bool) -> bool {
    namespace.is_none() || allow_namespaced
}

/// One GC pass over every provider.
pub async fn collect(
    providers: &ProviderRegistry,
    owners: &dyn LiveOwners,
    config: &GcConfig,
    now: Timestamp,
) -> GcReport {
    let mut report = GcReport::default();
    let live = match owners.live_uids(config.namespace.as_deref()).await {
        Ok(live) => live,
        Err(err) => {
            // Without the truth about live Proxies, every instance would look orphaned.
            warn!(error = %err, "listing live Proxies failed; skipping this GC pass");
            return report;
        }
    };
    for (name, provider) in providers.iter() {
        let instances = match provider.list().await {
            Ok(instances) => instances,
            Err(err) => {
                warn!(provider = name, error = %err, "listing instances failed; skipping this provider");
                report.failed_providers.push(name.to_owned());
                continue;
            }
        };
        for instance in instances {
            let id = instance.id.to_string();
            match verdict(&instance, &live, config, now) {
                Verdict::Keep => {}
                Verdict::UnknownOwner => report.unknown_owner.push(id),
                Verdict::Young => report.spared_young.push(id),
                Verdict::Collect if config.dry_run => {
                    info!(instance = %id, "dry run: would delete orphaned instance");
                    report.collected.push(id);
                }
                Verdict::Collect => match provider.delete(&instance.id.native_id).await {
                    Ok(()) => {
                        info!(instance = %id, owner = ?instance.owner, "deleted orphaned instance");
                        report.collected.push(id);
                        *report.deleted.entry(name.to_owned()).or_insert(0) += 1;
                    }
                    Err(err) => warn!(instance = %id, error = %err, "deleting orphaned instance failed"),
                },
            }
        }
    }
    report
}

/// Runs a GC pass every `interval` (the first one an interval after the start) until
/// `shutdown` resolves, counting deletions in `epo_gc_deletions_total`.
pub async fn run(
    providers: ProviderRegistry,
    owners: impl LiveOwners,
    config: GcConfig,
    interval: Duration,
    metrics: Option<Arc<Metrics>>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let report = collect(&providers, &owners, &config, Timestamp::now()).await;
        if let Some(metrics) = &metrics {
            for (provider, deleted) in &report.deleted {
                metrics.observe_gc_deletions(provider, *deleted);
            }
        }
        if !report.collected.is_empty() {
            info!(
                collected = ?report.collected,
                dry_run = config.dry_run,
                spared_young = report.spared_young.len(),
                unknown_owner = report.unknown_owner.len(),
                "orphan GC pass"
            );
        }
    }
}

enum Verdict {
    Keep,
    UnknownOwner,
    Young,
    Collect,
}

fn verdict(instance: &Instance, live: &HashSet<String>, config: &GcConfig, now: Timestamp) -> Verdict {
    let Some(owner) = &instance.owner else {
        return Verdict::UnknownOwner;
    };
    if let Some(namespace) = &config.namespace
        && &owner.namespace != namespace
    {
        return Verdict::Keep;
    }
    if live.contains(&owner.uid) {
        return Verdict::Keep;
    }
    let age = now.duration_since(instance.created_at);
    if age.is_negative() || age.unsigned_abs() < config.grace {
        return Verdict::Young;
    }
    Verdict::Collect
}

/// Live owners read from the API server with a fresh list (not a cache that may lag a create).
pub struct KubeLiveOwners {
    client: kube::Client,
}

impl KubeLiveOwners {
    /// Lists through `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

#[async_trait]
impl LiveOwners for KubeLiveOwners {
    async fn live_uids(&self, namespace: Option<&str>) -> Result<HashSet<String>, String> {
        use kube::{Api, api::ListParams};

        let api: Api<crate::api::Proxy> = match namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        };
        let list = api
            .list_metadata(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(list.items.into_iter().filter_map(|p| p.metadata.uid).collect())
    }
}

#[cfg(test)]
mod tests;
