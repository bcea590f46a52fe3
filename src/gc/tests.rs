use std::sync::Arc;

use super::*;
use crate::{
    api::Placement,
    provider::{Installation, InstanceRequest, Owner, Provider, ProviderError, memory::MemoryProvider},
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

/// The provider "mem" whose instances are all created at `t(0)`.
fn memory_at_zero() -> MemoryProvider {
    MemoryProvider::new("mem").with_clock(created_at_zero)
}

/// `provider`, shared with a registry that holds it alone (what GC passes read).
fn registered(provider: MemoryProvider) -> (Arc<MemoryProvider>, ProviderRegistry) {
    let provider = Arc::new(provider);
    let mut registry = ProviderRegistry::new();
    registry.insert(provider.clone());
    (provider, registry)
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
    let (provider, registry) = registered(memory_at_zero());
    let live = instance(&provider, "live-uid", "crawl").await;
    let orphan = instance(&provider, "gone-uid", "crawl").await;
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
    let (provider, registry) = registered(memory_at_zero());
    let orphan = instance(&provider, "gone-uid", "crawl").await;
    let mut unowned = provider.get(&orphan).await.expect("exists");
    unowned.owner = None;
    unowned.id.native_id = "foreign".into();
    provider.insert_raw(unowned);
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
    let (provider, registry) = registered(memory_at_zero());
    let ours = instance(&provider, "gone-1", "crawl").await;
    let theirs = instance(&provider, "gone-2", "other").await;
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

fn prod() -> Installation {
    Installation::new("cluster-a", "prod")
}

fn staging() -> Installation {
    Installation::new("cluster-b", "staging")
}

/// `uid`'s instance on `provider`, restamped with `installation` (`None`: legacy).
async fn stamped(provider: &MemoryProvider, uid: &str, installation: Option<Installation>) -> String {
    let name = instance(provider, uid, "crawl").await;
    let mut raw = provider.get(&name).await.expect("exists");
    raw.installation = installation;
    provider.insert_raw(raw);
    name
}

#[tokio::test]
async fn acts_only_on_its_own_installation_and_adopts_live_owned_legacy_instances() {
    let (provider, registry) = registered(memory_at_zero().with_installation(prod()));
    let own_orphan = stamped(&provider, "gone-1", Some(prod())).await;
    let foreign_orphan = stamped(&provider, "gone-2", Some(staging())).await;
    let foreign_same_cluster =
        stamped(&provider, "gone-3", Some(Installation::new("cluster-a", "other"))).await;
    let legacy_live = stamped(&provider, "live-legacy", None).await;
    let legacy_orphan = stamped(&provider, "gone-legacy", None).await;
    let owners = Owners(HashSet::from(["live-legacy".to_owned()]));
    let id = |name: &str| format!("memory/mem/{name}");

    // Dry run: reports the adoption, writes nothing.
    let dry = GcConfig {
        dry_run: true,
        ..config(0)
    };
    let report = collect(&registry, &owners, &dry, t(600)).await;
    assert_eq!(report.adopted, [id(&legacy_live)]);
    assert!(report.adoptions.is_empty());
    assert_eq!(
        provider.get(&legacy_live).await.expect("exists").installation,
        None
    );

    let report = collect(&registry, &owners, &config(0), t(600)).await;
    assert_eq!(report.collected, [id(&own_orphan)], "{report:?}");
    let mut foreign = vec![id(&foreign_orphan), id(&foreign_same_cluster)];
    foreign.sort();
    assert_eq!(report.foreign, foreign);
    assert_eq!(report.legacy, [id(&legacy_orphan)]);
    assert_eq!(report.adopted, [id(&legacy_live)]);
    assert_eq!(report.adoptions, BTreeMap::from([("mem".to_owned(), 1)]));
    assert_eq!(
        report.left_alone,
        BTreeMap::from([
            (("mem".to_owned(), "foreign"), 2),
            (("mem".to_owned(), "legacy"), 1)
        ])
    );
    let mut left = vec![
        foreign_orphan.clone(),
        foreign_same_cluster,
        legacy_live.clone(),
        legacy_orphan,
    ];
    left.sort();
    assert_eq!(provider.names(), left, "only its own orphan is gone");
    assert_eq!(
        provider.get(&legacy_live).await.expect("exists").installation,
        Some(prod()),
        "adopted: restamped with this installation"
    );

    // Adopted once: from now on it is judged as ours, so once its owner is gone it goes.
    let report = collect(&registry, &Owners(HashSet::new()), &config(0), t(600)).await;
    assert_eq!(report.collected, [id(&legacy_live)]);
    assert!(report.adopted.is_empty());

    // The other installation's instance is invisible to get, refused by create, kept by delete.
    assert!(matches!(
        provider.get(&foreign_orphan).await,
        Err(ProviderError::NotFound(_))
    ));
    provider.delete(&foreign_orphan).await.expect("nothing to delete");
    assert!(provider.names().contains(&foreign_orphan));
    let request = InstanceRequest {
        name: foreign_orphan.clone(),
        owner: Owner {
            uid: "gone-2".into(),
            namespace: "crawl".into(),
            name: "gone-2".into(),
        },
        spec_hash: "h".into(),
        placement: Placement::default(),
        port: 3128,
        user_data: None,
        credentials: None,
    };
    match provider.create(&request).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(
                message.contains("belongs to installation staging@cluster-b"),
                "{message}"
            )
        }
        other => panic!("create must refuse another installation's instance: {other:?}"),
    }
    assert!(provider.adopt(&foreign_orphan).await.is_err(), "never adopted");
}

#[tokio::test]
async fn each_left_alone_instance_is_logged_once_not_every_pass() {
    let (provider, registry) = registered(memory_at_zero().with_installation(prod()));
    let foreign = stamped(&provider, "gone-1", Some(staging())).await;
    let legacy = stamped(&provider, "gone-2", None).await;
    let owners = Owners(HashSet::new());
    let mut log = LeftAloneLog::default();

    let first = collect(&registry, &owners, &config(0), t(600)).await;
    let mut expected = vec![format!("memory/mem/{foreign}"), format!("memory/mem/{legacy}")];
    expected.sort();
    let mut logged = log.log_new(&first);
    logged.sort();
    assert_eq!(logged, expected);
    let second = collect(&registry, &owners, &config(0), t(700)).await;
    assert_eq!(second.foreign.len() + second.legacy.len(), 2);
    assert!(log.log_new(&second).is_empty(), "already logged");
    // A pass that judged nothing forgets nothing.
    assert!(log.log_new(&GcReport::default()).is_empty());
    assert!(log.log_new(&second).is_empty());

    // Gone and back: logged again.
    provider.vanish(&foreign);
    let third = collect(&registry, &owners, &config(0), t(800)).await;
    assert!(log.log_new(&third).is_empty());
    stamped(&provider, "gone-1", Some(staging())).await;
    let fourth = collect(&registry, &owners, &config(0), t(900)).await;
    assert_eq!(log.log_new(&fourth), [format!("memory/mem/{foreign}")]);
}
