use std::sync::Arc;

use super::*;
use crate::{
    api::Placement,
    provider::{InstanceRequest, Owner, Provider, memory::MemoryProvider},
};

struct Owners(HashSet<String>);

#[async_trait]
impl LiveOwners for Owners {
    async fn live_uids(&self, _namespace: Option<&str>) -> Result<HashSet<String>, String> {
        Ok(self.0.clone())
    }
}

struct Unreachable;

#[async_trait]
impl LiveOwners for Unreachable {
    async fn live_uids(&self, _namespace: Option<&str>) -> Result<HashSet<String>, String> {
        Err("connection refused".into())
    }
}

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).expect("valid")
}

fn created_at_zero() -> Timestamp {
    t(0)
}

async fn instance(provider: &MemoryProvider, uid: &str, namespace: &str) -> String {
    let request = InstanceRequest {
        name: crate::provider::instance_name(namespace, uid, uid),
        owner: Owner {
            uid: uid.into(),
            namespace: namespace.into(),
            name: uid.into(),
        },
        spec_hash: "h".into(),
        placement: Placement::default(),
        port: 3128,
        user_data: None,
        credentials: None,
    };
    provider.create(&request).await.expect("created").id.native_id
}

fn config(grace_secs: u64) -> GcConfig {
    GcConfig {
        grace: Duration::from_secs(grace_secs),
        dry_run: false,
        namespace: None,
    }
}

#[tokio::test]
async fn deletes_true_orphans_only() {
    let provider = Arc::new(MemoryProvider::new("mem").with_clock(created_at_zero));
    let live = instance(&provider, "live-uid", "crawl").await;
    let orphan = instance(&provider, "gone-uid", "crawl").await;
    let mut registry = ProviderRegistry::new();
    registry.insert(provider.clone());
    let owners = Owners(HashSet::from(["live-uid".to_owned()]));

    // Inside the grace period the orphan may be an in-flight create: spared.
    let report = collect(&registry, &owners, &config(300), t(60)).await;
    assert!(report.collected.is_empty());
    assert_eq!(report.spared_young, [format!("memory/mem/{orphan}")]);

    let report = collect(&registry, &owners, &config(300), t(600)).await;
    assert_eq!(report.collected, [format!("memory/mem/{orphan}")]);
    assert_eq!(report.deleted, BTreeMap::from([("mem".to_owned(), 1)]));
    assert_eq!(provider.names(), [live]);
}

#[tokio::test]
async fn never_touches_unknown_owners_and_respects_dry_run() {
    let provider = Arc::new(MemoryProvider::new("mem").with_clock(created_at_zero));
    let orphan = instance(&provider, "gone-uid", "crawl").await;
    let mut unowned = provider.get(&orphan).await.expect("exists");
    unowned.owner = None;
    unowned.id.native_id = "foreign".into();
    provider.insert_raw(unowned);
    let mut registry = ProviderRegistry::new();
    registry.insert(provider.clone());
    let owners = Owners(HashSet::new());

    let dry = GcConfig {
        dry_run: true,
        ..config(0)
    };
    let report = collect(&registry, &owners, &dry, t(600)).await;
    assert_eq!(report.collected.len(), 1);
    assert_eq!(report.unknown_owner, ["memory/mem/foreign"]);
    assert_eq!(provider.names().len(), 2, "dry run deletes nothing");
    assert!(report.deleted.is_empty(), "dry run counts no deletion");

    collect(&registry, &owners, &config(0), t(600)).await;
    assert_eq!(
        provider.names(),
        ["foreign"],
        "the instance of unknown ownership stays"
    );
}

#[tokio::test]
async fn namespace_mode_judges_only_its_own_namespace_and_fails_safe() {
    let provider = Arc::new(MemoryProvider::new("mem").with_clock(created_at_zero));
    let ours = instance(&provider, "gone-1", "crawl").await;
    let theirs = instance(&provider, "gone-2", "other").await;
    let mut registry = ProviderRegistry::new();
    registry.insert(provider.clone());
    assert!(
        !gc_enabled(Some("crawl"), false),
        "namespace mode disables GC by default"
    );
    assert!(gc_enabled(Some("crawl"), true));
    assert!(gc_enabled(None, false));

    let namespaced = GcConfig {
        namespace: Some("crawl".into()),
        ..config(0)
    };
    let report = collect(&registry, &Owners(HashSet::new()), &namespaced, t(600)).await;
    assert_eq!(report.collected, [format!("memory/mem/{ours}")]);
    assert_eq!(provider.names(), [theirs]);

    // If the live Proxies can't be listed, nothing is collected.
    let report = collect(&registry, &Unreachable, &config(0), t(600)).await;
    assert_eq!(report, GcReport::default());
    assert_eq!(provider.names().len(), 1);
}
