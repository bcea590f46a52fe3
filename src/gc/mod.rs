//! Orphan garbage collection: deletes provider instances whose owning Proxy is gone, and
//! adopts legacy-stamped instances whose owner lives here. The live owners come from a mode
//! ([`LiveOwners`]: `cluster::owners`, `standalone::owners`); this module names neither.
//!
//! An instance is collected only if all of these hold:
//! - its provider reports it as its own (each provider lists only what it made, so another
//!   provider type's instances are never seen);
//! - it carries this installation's identity ([`crate::provider::Installation`]): another
//!   installation's instances (another cluster, or another operator in this one, sharing the
//!   backend) are left alone and counted (`epo_gc_foreign_instances`, one log line per
//!   instance);
//! - a *legacy* instance (stamped before installations were recorded) is never collected:
//!   if its owner is live here, this installation adopts it (restamps it with its identity,
//!   once), after which it is judged like any other; if not, it may be another installation's
//!   and is left alone and counted as `legacy`;
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
    provider::{Claim, Installation, Instance, ProviderRegistry},
    telemetry::Metrics,
};

/// Where the live owners come from.
#[async_trait]
pub trait LiveOwners: Send + Sync {
    /// UIDs of every live Proxy (in `namespace`, if restricted), read from the source of truth.
    async fn live_uids(&self, namespace: Option<&str>) -> Result<HashSet<String>, String>;
}

/// A mode hands its live owners over as a trait object.
#[async_trait]
impl<T: LiveOwners + ?Sized> LiveOwners for Arc<T> {
    async fn live_uids(&self, namespace: Option<&str>) -> Result<HashSet<String>, String> {
        (**self).live_uids(namespace).await
    }
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
    /// Instances stamped by another installation (never touched).
    pub foreign: Vec<String>,
    /// Legacy-stamped instances whose owner is not live here (never touched: they may be
    /// another installation's).
    pub legacy: Vec<String>,
    /// Legacy-stamped instances whose owner is live here, restamped with this installation
    /// (or, in dry-run, that would have been).
    pub adopted: Vec<String>,
    /// Foreign and legacy instances left alone, per provider instance name and kind
    /// (`foreign`, `legacy`); every listed provider has both kinds, zero included.
    pub left_alone: BTreeMap<(String, &'static str), u64>,
    /// Instances actually adopted, per provider instance name (none in dry-run).
    pub adoptions: BTreeMap<String, u64>,
    /// Providers that could not be listed.
    pub failed_providers: Vec<String>,
    /// Why each of `failed_providers` could not be listed (what the log says, kept with the
    /// report so a caller, or a failing test, can tell).
    pub listing_errors: BTreeMap<String, String>,
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
                report.listing_errors.insert(name.to_owned(), err.to_string());
                continue;
            }
        };
        for kind in [FOREIGN, LEGACY] {
            report.left_alone.insert((name.to_owned(), kind), 0);
        }
        for instance in instances {
            let id = instance.id.to_string();
            match disposition(provider.installation(), &instance, &live, config, now) {
                Disposition::Keep => {}
                Disposition::UnknownOwner => report.unknown_owner.push(id),
                Disposition::Foreign => {
                    *report.left_alone.entry((name.to_owned(), FOREIGN)).or_insert(0) += 1;
                    report.foreign.push(id);
                }
                Disposition::Legacy => {
                    *report.left_alone.entry((name.to_owned(), LEGACY)).or_insert(0) += 1;
                    report.legacy.push(id);
                }
                Disposition::Adopt if config.dry_run => {
                    info!(instance = %id, "dry run: would adopt legacy-stamped instance");
                    report.adopted.push(id);
                }
                Disposition::Adopt => match provider.adopt(&instance.id.native_id).await {
                    Ok(_) => {
                        info!(
                            instance = %id,
                            installation = %provider.installation(),
                            "adopted legacy-stamped instance (its owner is live here)"
                        );
                        report.adopted.push(id);
                        *report.adoptions.entry(name.to_owned()).or_insert(0) += 1;
                    }
                    Err(err) => {
                        warn!(instance = %id, error = %err, "adopting legacy-stamped instance failed")
                    }
                },
                Disposition::Young => report.spared_young.push(id),
                Disposition::Collect if config.dry_run => {
                    info!(instance = %id, "dry run: would delete orphaned instance");
                    report.collected.push(id);
                }
                Disposition::Collect => match provider.delete(&instance.id.native_id).await {
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
    let mut left_alone = LeftAloneLog::default();
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let report = collect(&providers, &owners, &config, Timestamp::now()).await;
        left_alone.log_new(&report);
        if let Some(metrics) = &metrics {
            for (provider, deleted) in &report.deleted {
                metrics.observe_gc_deletions(provider, *deleted);
            }
            for ((provider, kind), count) in &report.left_alone {
                metrics.set_gc_left_alone(provider, kind, *count);
                if *kind == FOREIGN {
                    // Every listed provider's counter shows, zero included.
                    let adopted = report.adoptions.get(provider).copied().unwrap_or(0);
                    metrics.observe_gc_adoptions(provider, adopted);
                }
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

/// `kind` label of instances stamped by another installation.
const FOREIGN: &str = "foreign";
/// `kind` label of legacy-stamped instances whose owner is not live here.
const LEGACY: &str = "legacy";

/// Remembers which left-alone instances were logged, so each gets one log line (when first
/// seen, and again only if it went away and came back), not one per pass.
#[derive(Debug, Default)]
pub struct LeftAloneLog {
    seen: HashSet<String>,
}

impl LeftAloneLog {
    /// The foreign and legacy instances of `report` not logged before, logged now; forgets
    /// the ones `report` no longer lists. A pass that listed nothing (live owners unreadable)
    /// forgets nothing.
    pub fn log_new(&mut self, report: &GcReport) -> Vec<String> {
        if report == &GcReport::default() {
            return Vec::new();
        }
        let mut new = Vec::new();
        for (ids, kind) in [(&report.foreign, FOREIGN), (&report.legacy, LEGACY)] {
            for id in ids {
                if self.seen.insert(id.clone()) {
                    match kind {
                        FOREIGN => {
                            info!(instance = %id, "orphan GC leaves alone an instance of another installation")
                        }
                        _ => info!(
                            instance = %id,
                            "orphan GC leaves alone a legacy-stamped instance whose owner is not live here \
                             (it may be another installation's)"
                        ),
                    }
                    new.push(id.clone());
                }
            }
        }
        // Forget what is gone, except for providers that could not be listed this pass.
        self.seen.retain(|id| {
            report.foreign.contains(id)
                || report.legacy.contains(id)
                || report
                    .failed_providers
                    .iter()
                    .any(|provider| id.split('/').nth(1) == Some(provider.as_str()))
        });
        new
    }
}

/// What one sweep does with one provider instance (a GC decision, not a health verdict).
enum Disposition {
    Keep,
    UnknownOwner,
    Foreign,
    Legacy,
    Adopt,
    Young,
    Collect,
}

fn disposition(
    installation: &Installation,
    instance: &Instance,
    live: &HashSet<String>,
    config: &GcConfig,
    now: Timestamp,
) -> Disposition {
    let Some(owner) = &instance.owner else {
        return Disposition::UnknownOwner;
    };
    let claim = installation.claim(instance.installation.as_ref());
    if claim == Claim::Foreign {
        return Disposition::Foreign;
    }
    if let Some(namespace) = &config.namespace
        && &owner.namespace != namespace
    {
        return Disposition::Keep;
    }
    let live = live.contains(&owner.uid);
    match (claim, live) {
        (Claim::Legacy, true) => return Disposition::Adopt,
        (Claim::Legacy, false) => return Disposition::Legacy,
        (_, true) => return Disposition::Keep,
        (_, false) => {}
    }
    let age = now.duration_since(instance.created_at);
    if age.is_negative() || age.unsigned_abs() < config.grace {
        return Disposition::Young;
    }
    Disposition::Collect
}

#[cfg(test)]
mod tests;
