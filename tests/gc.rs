//! Orphan GC on real backends, with the live owners read from a real kube-apiserver:
//!
//! - `kvm2` on a private libvirtd (real QEMU driver, guests that run firmware only): a true
//!   orphan's domain and volumes go; an instance whose create is in flight, an instance whose
//!   owner lives, one of unknown ownership and a `kvm` domain on the same daemon stay.
//! - `local` (real Squid): a true orphan's Squid stops and its folder goes; the others stay.
//! - two installations (two clusters, each with its own API server) sharing one backend —
//!   `kvm2` on libvirt's test driver, `local` on one stateDir with real Squid — run GC side by
//!   side: each collects its own orphans, neither deletes, adopts, returns or supervises the
//!   other's instances, and a legacy-stamped instance is adopted only by the installation
//!   where its owner lives.
//! - the `run` binary in namespace-restricted mode: GC is off and says so; with
//!   `--gc-allow-namespaced` it judges only the watched namespace; `--gc-dry-run` only logs.

#[allow(dead_code)]
mod support {
    pub mod contract;
    pub mod control_plane;
    pub mod local;
    pub mod ports;
    pub mod process;
    pub mod wait;
}
#[path = "support/libvirt_requests.rs"]
mod libvirt_requests;
#[path = "support/libvirtd.rs"]
mod libvirtd;

use std::{
    collections::{BTreeMap, HashSet},
    path::Path,
    process::Command,
    sync::Arc,
    time::Duration,
};

use egress_proxies_operator::{
    api::Proxy,
    cluster::{KubeLiveOwners, cluster_identity},
    gc::{GcConfig, GcReport, collect, gc_enabled},
    provider::{
        Installation, Instance, InstanceRequest, Owner, Provider, ProviderError, ProviderRegistry,
        instance_name,
        kvm::KvmProvider,
        kvm2::Kvm2Provider,
        libvirt::{KVM_NAMESPACE, KVM2_NAMESPACE},
        local::LocalProvider,
    },
};
use jiff::{SignedDuration, Timestamp};
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use libvirt_requests::{request, settings, test_driver, user_network};
use libvirtd::PrivateLibvirtd;
use serde_json::json;
use support::{
    contract::plain_request,
    control_plane::ControlPlane,
    local::{StateDir, create_on_a_free_port, free_port},
    process::GroupChild,
    process::{kill, squids},
    wait::holds_within,
};

const GRACE: Duration = Duration::from_secs(300);
const DEADLINE: Duration = Duration::from_secs(30);

/// A cluster: etcd and kube-apiserver with the CRDs and namespaces `crawl` and `other`, and an
/// admin client.
struct Cluster {
    plane: ControlPlane,
    client: kube::Client,
}

impl Cluster {
    async fn start() -> Self {
        let (plane, client) = ControlPlane::with_crds(&["crawl", "other"]).await;
        Self { plane, client }
    }

    fn client(&self) -> kube::Client {
        self.client.clone()
    }
}

/// A Proxy object in the API server (nothing reconciles it here); returns its UID.
async fn live_proxy(server: &Cluster, namespace: &str, name: &str, provider: &str) -> String {
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"provider": provider},
    }))
    .expect("valid Proxy");
    Api::<Proxy>::namespaced(server.client(), namespace)
        .create(&PostParams::default(), &proxy)
        .await
        .expect("created")
        .metadata
        .uid
        .expect("the server sets a UID")
}

/// `request` re-owned by `owner` (the instance name follows the owner, as the reconciler's).
fn owned_by(mut request: InstanceRequest, owner: Owner) -> InstanceRequest {
    request.name = instance_name(&owner.namespace, &owner.name, &owner.uid);
    request.owner = owner;
    request
}

fn config(dry_run: bool) -> GcConfig {
    GcConfig {
        grace: GRACE,
        dry_run,
        namespace: None,
    }
}

/// A pass time at which `old` is exactly `GRACE` old (collectable) and `young`, created after
/// it, is younger than `GRACE` (an in-flight create).
fn judgement_time(old: &Instance, young: &Instance) -> Timestamp {
    assert!(
        young.created_at > old.created_at,
        "the young instance was created after the old one"
    );
    old.created_at + SignedDuration::try_from(GRACE).expect("small")
}

/// The ports test programs are told (the control plane's, Squids') never come from the range
/// user-mode guests forward from: qemu binds a guest's forward only when the guest starts,
/// after the provider found it free, so a port handed out meanwhile broke a create (CI: "Could
/// not set up host forwarding rule 'tcp:127.0.0.1:24430-:3128'" while this binary's control
/// plane took ports from the same span).
#[test]
fn test_ports_stay_out_of_the_guests_forward_range() {
    for _ in 0..30_000 {
        let port = u32::from(support::ports::free_port());
        assert!(
            !support::ports::GUEST_FORWARDS.contains(&port),
            "port {port} was handed out from the guests' forward range"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_on_a_real_libvirt_driver_deletes_only_true_orphans() {
    virt::error::clear_error_callback();
    let daemon = PrivateLibvirtd::start();
    daemon.dir_pool_with_base("epo", "base.qcow2");
    let kvm2 = Arc::new(Kvm2Provider::new(
        "kvm2-gc",
        settings(daemon.uri(), "epo", user_network(24400)),
    ));
    let kvm = KvmProvider::new("kvm-gc", settings(daemon.uri(), "epo", user_network(24500)));
    let mut server = Cluster::start().await;

    let alive_uid = live_proxy(&server, "crawl", "alive", "kvm2-gc").await;
    let alive_request = owned_by(
        request("alive"),
        Owner {
            uid: alive_uid,
            namespace: "crawl".into(),
            name: "alive".into(),
        },
    );
    let alive = kvm2.create(&alive_request).await.expect("create alive");
    // Owners of these were never in the API server.
    let orphan = kvm2.create(&request("orphan")).await.expect("create orphan");
    let young = kvm2.create(&request("in-flight")).await.expect("create young");
    let kvm_orphan = kvm.create(&request("kvm-orphan")).await.expect("create kvm");
    // A domain carrying kvm2's stamp without a readable owner.
    let damaged = format!("crawl-damaged-{:08x}", fastrand::u32(..));
    let xml_file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        xml_file.path(),
        format!(
            "<domain type='qemu'><name>{damaged}</name><memory unit='MiB'>64</memory>\
             <os><type arch='x86_64'>hvm</type></os>\
             <metadata><k:owner xmlns:k='{KVM2_NAMESPACE}' uid='no-name-no-time'/></metadata></domain>"
        ),
    )
    .expect("domain XML");
    daemon.virsh_ok(&["define", xml_file.path().to_str().expect("UTF-8")]);

    let mut registry = ProviderRegistry::new();
    registry.insert(kvm2.clone());
    let owners = KubeLiveOwners::new(server.client());
    let now = judgement_time(&orphan, &young);
    let id = |i: &Instance| i.id.to_string();
    let orphan_volumes = || {
        daemon
            .volumes("epo")
            .into_iter()
            .filter(|v| v.starts_with(&orphan.id.native_id))
            .count()
    };
    assert_eq!(orphan_volumes(), 2, "disk and seed");

    // Dry run: reports, deletes nothing.
    let dry = collect(&registry, &owners, &config(true), now).await;
    assert_eq!(dry.collected, [id(&orphan)]);
    assert!(dry.deleted.is_empty());
    assert!(daemon.domains().contains(&orphan.id.native_id));

    // Without the truth about live Proxies nothing is judged.
    server.plane.stop_apiserver().await;
    assert_eq!(
        collect(&registry, &owners, &config(false), now).await,
        GcReport::default()
    );
    server.plane.start_apiserver_again().await;

    let report = collect(&registry, &owners, &config(false), now).await;
    assert_eq!(report.collected, [id(&orphan)], "{report:?}");
    assert_eq!(report.spared_young, [id(&young)], "{report:?}");
    assert_eq!(report.unknown_owner, [format!("kvm2/kvm2-gc/{damaged}")]);
    assert_eq!(report.deleted, BTreeMap::from([("kvm2-gc".to_owned(), 1)]));
    let domains: HashSet<String> = daemon.domains().into_iter().collect();
    assert!(!domains.contains(&orphan.id.native_id), "orphan undefined");
    assert_eq!(orphan_volumes(), 0, "orphan's volumes removed");
    for kept in [
        &alive.id.native_id,
        &young.id.native_id,
        &kvm_orphan.id.native_id,
        &damaged,
    ] {
        assert!(domains.contains(kept), "{kept} must stay: {domains:?}");
    }

    // The owners are read from the API server on every pass, not from a cache: once the
    // Proxy is gone, its instance is an orphan at the next pass.
    Api::<Proxy>::namespaced(server.client(), "crawl")
        .delete("alive", &DeleteParams::default())
        .await
        .expect("delete Proxy");
    let report = collect(&registry, &owners, &config(false), now).await;
    assert_eq!(report.collected, [id(&alive)]);
    assert!(!daemon.domains().contains(&alive.id.native_id));

    kvm2.delete(&young.id.native_id).await.expect("clean up");
    kvm.delete(&kvm_orphan.id.native_id).await.expect("clean up");
    daemon.virsh_ok(&["undefine", "--domain", &damaged]);
}

fn local_owner(namespace: &str, name: &str) -> Owner {
    Owner {
        uid: format!("{:016x}-{name}", fastrand::u64(..)),
        namespace: namespace.into(),
        name: name.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_on_the_local_provider_stops_and_removes_only_true_orphans() {
    let state = StateDir::new();
    let other_state = StateDir::new();
    let local = Arc::new(LocalProvider::new("local", state.settings()).expect("settings"));
    let other = LocalProvider::new("local-other", other_state.settings()).expect("settings");
    let server = Cluster::start().await;

    let alive_owner = Owner {
        uid: live_proxy(&server, "crawl", "alive", "local").await,
        namespace: "crawl".into(),
        name: "alive".into(),
    };
    let alive = create_on_a_free_port(&local, plain_request(alive_owner, free_port())).await;
    let orphan =
        create_on_a_free_port(&local, plain_request(local_owner("crawl", "orphan"), free_port())).await;
    let young = create_on_a_free_port(
        &local,
        plain_request(local_owner("crawl", "in-flight"), free_port()),
    )
    .await;
    let unreadable = create_on_a_free_port(
        &local,
        plain_request(local_owner("crawl", "unreadable"), free_port()),
    )
    .await;
    std::fs::write(
        local.instance_dir(&unreadable.id.native_id).join("owner.json"),
        b"{ damaged",
    )
    .expect("damage the owner record");
    // Another provider instance's orphan (not in this GC's registry).
    let foreign = create_on_a_free_port(
        &other,
        plain_request(local_owner("crawl", "foreign"), free_port()),
    )
    .await;

    let mut registry = ProviderRegistry::new();
    registry.insert(local.clone());
    let owners = KubeLiveOwners::new(server.client());
    let now = judgement_time(&orphan, &young);
    let orphan_dir = local.instance_dir(&orphan.id.native_id);
    assert_eq!(squids(&orphan_dir).len(), 1);

    let dry = collect(&registry, &owners, &config(true), now).await;
    assert_eq!(dry.collected, [orphan.id.to_string()]);
    assert_eq!(squids(&orphan_dir).len(), 1, "dry run stops nothing");

    let report = collect(&registry, &owners, &config(false), now).await;
    assert_eq!(report.collected, [orphan.id.to_string()], "{report:?}");
    assert_eq!(report.spared_young, [young.id.to_string()]);
    assert_eq!(report.unknown_owner, [unreadable.id.to_string()]);
    assert_eq!(report.deleted, BTreeMap::from([("local".to_owned(), 1)]));
    assert!(!orphan_dir.exists(), "the orphan's folder is removed");
    assert!(
        holds_within(DEADLINE, async || squids(&orphan_dir).is_empty()).await,
        "the orphan's Squid is stopped"
    );
    for (provider, kept) in [
        (&*local, &alive),
        (&*local, &young),
        (&*local, &unreadable),
        (&other, &foreign),
    ] {
        assert_eq!(
            squids(&provider.instance_dir(&kept.id.native_id)).len(),
            1,
            "{} keeps running",
            kept.id
        );
    }

    for instance in [&alive, &young, &unreadable] {
        local.delete(&instance.id.native_id).await.expect("clean up");
    }
    other.delete(&foreign.id.native_id).await.expect("clean up");
}

// --- two installations sharing one backend -------------------------------------------------------

/// Two clusters' installations: distinct cluster IDs (as two kube-system UIDs would be).
fn installations() -> (Installation, Installation) {
    let cluster = || format!("{:016x}", fastrand::u64(..));
    (
        Installation::new(cluster(), "egress-proxies-system"),
        Installation::new(cluster(), "egress-proxies-system"),
    )
}

/// A pass time at which every one of `instances` is older than `GRACE`.
fn after_grace(instances: &[&Instance]) -> Timestamp {
    let newest = instances
        .iter()
        .map(|i| i.created_at)
        .max()
        .expect("some instances");
    newest + SignedDuration::try_from(GRACE).expect("small")
}

/// Two installations' orphan GC over one backend: each with a registry of its own provider
/// object and the live owners of its own cluster.
struct SideBySide {
    prod: (ProviderRegistry, KubeLiveOwners),
    staging: (ProviderRegistry, KubeLiveOwners),
}

impl SideBySide {
    fn new(prod: (Arc<dyn Provider>, &Cluster), staging: (Arc<dyn Provider>, &Cluster)) -> Self {
        let half = |(provider, cluster): (Arc<dyn Provider>, &Cluster)| {
            let mut registry = ProviderRegistry::new();
            registry.insert(provider);
            (registry, KubeLiveOwners::new(cluster.client()))
        };
        Self {
            prod: half(prod),
            staging: half(staging),
        }
    }

    /// One pass of each at `now`, run concurrently; asserts that each collected exactly its
    /// own orphan of `orphans` (prod's, staging's) or, with `None`, nothing.
    async fn pass(&self, now: Timestamp, orphans: Option<(&Instance, &Instance)>) -> (GcReport, GcReport) {
        let gc = config(false);
        let (prod, staging) = tokio::join!(
            collect(&self.prod.0, &self.prod.1, &gc, now),
            collect(&self.staging.0, &self.staging.1, &gc, now),
        );
        let expected =
            |orphan: Option<&Instance>| orphan.map(|o| o.id.to_string()).into_iter().collect::<Vec<_>>();
        assert_eq!(prod.collected, expected(orphans.map(|o| o.0)), "prod: {prod:?}");
        assert_eq!(
            staging.collected,
            expected(orphans.map(|o| o.1)),
            "staging: {staging:?}"
        );
        (prod, staging)
    }
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installations_on_one_libvirt_run_gc_side_by_side_and_touch_only_their_own() {
    const URI: &str = "test:///default";
    const POOL: &str = "default-pool";
    let connection = test_driver(URI, POOL);
    let (prod_id, staging_id) = installations();
    // The same providers config in both clusters: the same provider instance name.
    let prod = Arc::new(
        Kvm2Provider::new("kvm2", settings(URI, POOL, Default::default())).with_installation(prod_id.clone()),
    );
    let staging = Arc::new(
        Kvm2Provider::new("kvm2", settings(URI, POOL, Default::default()))
            .with_installation(staging_id.clone()),
    );
    let prod_cluster = Cluster::start().await;
    let staging_cluster = Cluster::start().await;

    let live = async |server: &Cluster, name: &str| Owner {
        uid: live_proxy(server, "crawl", name, "kvm2").await,
        namespace: "crawl".into(),
        name: name.into(),
    };
    let prod_alive = prod
        .create(&owned_by(
            request("p-alive"),
            live(&prod_cluster, "p-alive").await,
        ))
        .await
        .expect("create");
    let prod_orphan = prod.create(&request("p-orphan")).await.expect("create");
    let staging_alive = staging
        .create(&owned_by(
            request("s-alive"),
            live(&staging_cluster, "s-alive").await,
        ))
        .await
        .expect("create");
    let staging_orphan = staging.create(&request("s-orphan")).await.expect("create");
    for (instance, installation) in [
        (&prod_alive, &prod_id),
        (&prod_orphan, &prod_id),
        (&staging_alive, &staging_id),
        (&staging_orphan, &staging_id),
    ] {
        assert_eq!(
            instance.installation.as_ref(),
            Some(installation),
            "stamped on create"
        );
    }

    // Domains stamped in today's format (no installation): one whose owner lives in prod, one
    // whose owner lives nowhere.
    let legacy_owner = live(&prod_cluster, "legacy").await;
    let legacy = instance_name(&legacy_owner.namespace, &legacy_owner.name, &legacy_owner.uid);
    let legacy_orphan = format!("epo-crawl-legacy-orphan-{:08x}", fastrand::u32(..));
    let stamp_created = prod_orphan.created_at - SignedDuration::from_hours(1);
    for (name, uid, proxy) in [
        (&legacy, legacy_owner.uid.as_str(), "legacy"),
        (&legacy_orphan, "never-lived", "legacy-orphan"),
    ] {
        connection
            .define_domain_xml(&format!(
                "<domain type='test'><name>{name}</name><memory unit='MiB'>64</memory>\
                 <os><type arch='x86_64'>hvm</type></os><metadata>\
                 <epo:owner xmlns:epo='{KVM2_NAMESPACE}' provider='kvm2' uid='{uid}' \
                 namespace='crawl' name='{proxy}' specHash='h' createdAt='{stamp_created}' port='3128'/>\
                 </metadata></domain>"
            ))
            .expect("define a legacy-stamped domain");
    }
    let id = |name: &str| format!("kvm2/kvm2/{name}");

    let now = after_grace(&[&prod_alive, &prod_orphan, &staging_alive, &staging_orphan]);
    let gc = SideBySide::new((prod.clone(), &prod_cluster), (staging.clone(), &staging_cluster));
    let (prod_report, staging_report) = gc.pass(now, Some((&prod_orphan, &staging_orphan))).await;
    assert!(staging_report.foreign.contains(&prod_alive.id.to_string()));
    assert!(prod_report.foreign.contains(&staging_alive.id.to_string()));
    assert_eq!(
        prod_report.adopted,
        [id(&legacy)],
        "prod, where its owner lives, adopts it"
    );
    assert_eq!(prod_report.legacy, [id(&legacy_orphan)]);
    assert!(staging_report.adopted.is_empty());
    assert!(staging_report.legacy.contains(&id(&legacy_orphan)));
    // The passes ran side by side: staging listed the legacy domain either before prod's
    // adoption (legacy, owner not live in staging) or after it (prod's): never collected.
    assert!(
        staging_report.legacy.contains(&id(&legacy)) || staging_report.foreign.contains(&id(&legacy)),
        "{staging_report:?}"
    );

    let domains: HashSet<String> = connection
        .list_all_domains(0)
        .expect("domains")
        .iter()
        .map(|d| d.name().expect("name"))
        .collect();
    assert!(!domains.contains(&prod_orphan.id.native_id));
    assert!(!domains.contains(&staging_orphan.id.native_id));
    for kept in [
        &prod_alive.id.native_id,
        &staging_alive.id.native_id,
        &legacy,
        &legacy_orphan,
    ] {
        assert!(domains.contains(kept), "{kept} must stay: {domains:?}");
    }
    let adopted = prod.get(&legacy).await.expect("prod's now");
    assert_eq!(adopted.installation, Some(prod_id.clone()), "restamped");

    // A second pass: the adopted domain is prod's like any other; staging now counts it as
    // foreign; still nobody touches anything live-owned.
    let (prod_report, staging_report) = gc.pass(now, None).await;
    assert!(prod_report.adopted.is_empty(), "adopted once");
    assert_eq!(
        sorted(staging_report.foreign),
        sorted(vec![prod_alive.id.to_string(), id(&legacy)])
    );
    assert_eq!(prod_report.foreign, [staging_alive.id.to_string()]);

    // Neither installation returns, adopts, re-creates or deletes the other's instances.
    assert!(matches!(
        staging.get(&prod_alive.id.native_id).await,
        Err(ProviderError::NotFound(_))
    ));
    let prod_request = owned_by(request("p-alive"), prod_alive.owner.clone().expect("owner"));
    match staging.create(&prod_request).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(message.contains("belongs to installation"), "{message}")
        }
        other => panic!("staging must not take over prod's domain: {other:?}"),
    }
    assert!(staging.adopt(&legacy).await.is_err(), "already prod's");
    staging
        .delete(&prod_alive.id.native_id)
        .await
        .expect("nothing of staging's to delete");
    assert_eq!(
        prod.get(&prod_alive.id.native_id)
            .await
            .expect("still there")
            .installation,
        Some(prod_id)
    );

    for name in [&prod_alive.id.native_id, &legacy, &legacy_orphan] {
        prod.delete(name).await.expect("clean up");
    }
    staging
        .delete(&staging_alive.id.native_id)
        .await
        .expect("clean up");
    // The legacy orphan carried no installation, so prod could delete it explicitly.
    assert!(connection.lookup_domain_by_name(&legacy_orphan).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installations_on_a_real_libvirtd_through_virsh_keep_apart_and_adopt_a_running_legacy_domain() {
    let daemon = PrivateLibvirtd::start();
    daemon.dir_pool_with_base("epo", "base.qcow2");
    let (prod_id, staging_id) = installations();
    let kvm = |installation: &Installation| {
        Arc::new(
            KvmProvider::new("kvm", settings(daemon.uri(), "epo", user_network(24600)))
                .with_installation(installation.clone()),
        )
    };
    let (prod, staging) = (kvm(&prod_id), kvm(&staging_id));
    let prod_cluster = Cluster::start().await;
    let staging_cluster = Cluster::start().await;

    let prod_orphan = prod.create(&request("p-orphan")).await.expect("create");
    let staging_orphan = staging.create(&request("s-orphan")).await.expect("create");
    // A running domain in today's stamp format, whose owner lives in prod.
    let owner = Owner {
        uid: live_proxy(&prod_cluster, "crawl", "legacy", "kvm").await,
        namespace: "crawl".into(),
        name: "legacy".into(),
    };
    let legacy = instance_name(&owner.namespace, &owner.name, &owner.uid);
    let xml_file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        xml_file.path(),
        format!(
            "<domain type='qemu'><name>{legacy}</name><memory unit='MiB'>32</memory>\
             <os><type arch='x86_64'>hvm</type></os><metadata>\
             <epo:owner xmlns:epo='{KVM_NAMESPACE}' provider='kvm' uid='{}' namespace='crawl' \
             name='legacy' specHash='h' createdAt='{}' port='3128'/></metadata></domain>",
            owner.uid,
            prod_orphan.created_at - SignedDuration::from_hours(1)
        ),
    )
    .expect("domain XML");
    daemon.virsh_ok(&["define", xml_file.path().to_str().expect("UTF-8")]);
    daemon.virsh_ok(&["start", &legacy]);

    let now = after_grace(&[&prod_orphan, &staging_orphan]);
    let gc = SideBySide::new((prod.clone(), &prod_cluster), (staging.clone(), &staging_cluster));
    let (prod_report, staging_report) = gc.pass(now, Some((&prod_orphan, &staging_orphan))).await;
    assert_eq!(
        prod_report.adopted,
        [format!("kvm/kvm/{legacy}")],
        "{prod_report:?}"
    );
    assert!(staging_report.adopted.is_empty());
    let domains = daemon.domains();
    assert!(!domains.contains(&prod_orphan.id.native_id) && !domains.contains(&staging_orphan.id.native_id));
    assert!(domains.contains(&legacy), "{domains:?}");

    // Restamped in the running definition and the persistent one.
    let cluster = format!("cluster=\"{}\"", prod_id.cluster_id);
    let live = daemon.virsh_ok(&["metadata", "--domain", &legacy, "--uri", KVM_NAMESPACE, "--live"]);
    let config = daemon.virsh_ok(&[
        "metadata",
        "--domain",
        &legacy,
        "--uri",
        KVM_NAMESPACE,
        "--config",
    ]);
    assert!(
        live.contains(&cluster) && config.contains(&cluster),
        "{live}\n{config}"
    );
    assert_eq!(
        prod.get(&legacy).await.expect("prod's").installation,
        Some(prod_id)
    );
    assert!(matches!(
        staging.get(&legacy).await,
        Err(ProviderError::NotFound(_))
    ));
    staging.delete(&legacy).await.expect("not staging's to delete");
    assert!(daemon.domains().contains(&legacy));
    prod.delete(&legacy).await.expect("clean up");
    assert!(!daemon.domains().contains(&legacy));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installations_sharing_a_local_state_dir_collect_only_their_own_squids() {
    let state = StateDir::new();
    let (prod_id, staging_id) = installations();
    let prod = Arc::new(
        LocalProvider::for_installation(prod_id.clone(), "local", state.settings()).expect("settings"),
    );
    let staging = Arc::new(
        LocalProvider::for_installation(staging_id.clone(), "local", state.settings()).expect("settings"),
    );
    let prod_cluster = Cluster::start().await;
    let staging_cluster = Cluster::start().await;
    let live = async |server: &Cluster, name: &str| Owner {
        uid: live_proxy(server, "crawl", name, "local").await,
        namespace: "crawl".into(),
        name: name.into(),
    };

    let prod_alive = create_on_a_free_port(
        &prod,
        plain_request(live(&prod_cluster, "p-alive").await, free_port()),
    )
    .await;
    let prod_orphan = create_on_a_free_port(
        &prod,
        plain_request(local_owner("crawl", "p-orphan"), free_port()),
    )
    .await;
    let staging_alive = create_on_a_free_port(
        &staging,
        plain_request(live(&staging_cluster, "s-alive").await, free_port()),
    )
    .await;
    let staging_orphan = create_on_a_free_port(
        &staging,
        plain_request(local_owner("crawl", "s-orphan"), free_port()),
    )
    .await;
    // Made before installations were recorded: its owner record names none. Its owner lives
    // in staging.
    let legacy = create_on_a_free_port(
        &staging,
        plain_request(live(&staging_cluster, "legacy").await, free_port()),
    )
    .await;
    let owner_file = staging.instance_dir(&legacy.id.native_id).join("owner.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&owner_file).expect("owner record")).expect("JSON");
    record.as_object_mut().expect("object").remove("installation");
    std::fs::write(&owner_file, serde_json::to_vec(&record).expect("JSON")).expect("legacy record");
    assert_eq!(
        staging
            .get(&legacy.id.native_id)
            .await
            .expect("legacy")
            .installation,
        None
    );

    let now = after_grace(&[
        &prod_alive,
        &prod_orphan,
        &staging_alive,
        &staging_orphan,
        &legacy,
    ]);
    let gc = SideBySide::new((prod.clone(), &prod_cluster), (staging.clone(), &staging_cluster));
    let (prod_report, staging_report) = gc.pass(now, Some((&prod_orphan, &staging_orphan))).await;
    assert_eq!(staging_report.adopted, [legacy.id.to_string()]);
    assert!(prod_report.adopted.is_empty(), "its owner does not live in prod");
    assert!(prod_report.foreign.contains(&staging_alive.id.to_string()));
    assert!(staging_report.foreign.contains(&prod_alive.id.to_string()));
    assert_eq!(
        staging
            .get(&legacy.id.native_id)
            .await
            .expect("adopted")
            .installation,
        Some(staging_id)
    );

    for gone in [&prod_orphan, &staging_orphan] {
        let dir = state.path().join(&gone.id.native_id);
        assert!(!dir.exists(), "{} removed", gone.id);
        assert!(
            holds_within(DEADLINE, async || squids(&dir).is_empty()).await,
            "{}'s Squid is stopped",
            gone.id
        );
    }
    for kept in [&prod_alive, &staging_alive, &legacy] {
        assert_eq!(
            squids(&state.path().join(&kept.id.native_id)).len(),
            1,
            "{} keeps running",
            kept.id
        );
    }

    // Neither returns, re-creates or deletes the other's; nor restarts the other's dead Squid.
    assert!(matches!(
        prod.get(&staging_alive.id.native_id).await,
        Err(ProviderError::NotFound(_))
    ));
    let staging_request = plain_request(staging_alive.owner.clone().expect("owner"), free_port());
    assert!(matches!(
        prod.create(&staging_request).await,
        Err(ProviderError::Misconfigured(_))
    ));
    prod.delete(&staging_alive.id.native_id)
        .await
        .expect("nothing of prod's");
    assert_eq!(squids(&state.path().join(&staging_alive.id.native_id)).len(), 1);
    let listed: Vec<String> = prod
        .list()
        .await
        .expect("list")
        .into_iter()
        .map(|i| i.id.native_id)
        .collect();
    assert!(
        listed.contains(&staging_alive.id.native_id),
        "list reports every instance: {listed:?}"
    );

    prod.delete(&prod_alive.id.native_id).await.expect("clean up");
    for instance in [&staging_alive, &legacy] {
        staging.delete(&instance.id.native_id).await.expect("clean up");
    }

    // A dead Squid is restarted by its own installation's supervision only. (With no prod
    // provider object left, only the supervision passes below can restart anything.)
    drop(gc);
    drop(prod);
    let prod_provider =
        || LocalProvider::for_installation(prod_id.clone(), "local", state.settings()).expect("settings");
    let dead = create_on_a_free_port(
        &prod_provider(),
        plain_request(local_owner("crawl", "dead"), free_port()),
    )
    .await;
    let dead_dir = state.path().join(&dead.id.native_id);
    for pid in squids(&dead_dir) {
        kill(pid);
    }
    assert!(holds_within(DEADLINE, async || squids(&dead_dir).is_empty()).await);
    staging.supervise_now().await;
    assert!(
        squids(&dead_dir).is_empty(),
        "staging never restarts prod's Squid"
    );
    assert!(staging.supervision(&dead.id.native_id).is_none());
    let prod = prod_provider();
    prod.supervise_now().await;
    assert!(
        holds_within(DEADLINE, async || squids(&dead_dir).len() == 1).await,
        "prod restarts its own"
    );
    prod.delete(&dead.id.native_id).await.expect("clean up");
}

// --- the binary in namespace-restricted mode ---------------------------------------------------

const BIN: &str = env!("CARGO_BIN_EXE_egress-proxies-operator");

/// `egress-proxies-operator run` against the API server of the kubeconfig in `dir`, in
/// its own process group (killed on Drop), logging to `{run}.log`.
struct Operator(GroupChild);

impl Operator {
    fn start(dir: &Path, run: &str, args: &[&str]) -> Operator {
        Operator(GroupChild::spawn(
            Command::new(BIN)
                .current_dir(dir)
                .args(["run", "--providers-config", "providers.yaml"])
                .args(["--tokens", "tokens", "--lease-signing-key", "key"])
                .args([
                    "--admin-listen",
                    "127.0.0.1:0",
                    "--discovery-listen",
                    "127.0.0.1:0",
                ])
                .args(["--identity", "gc-test", "--installation-name", "gc-test"])
                .args(["--gc-grace-seconds", "0"])
                .args(["--gc-interval-seconds", "1"])
                .args(args)
                .env_remove("KUBERNETES_SERVICE_HOST")
                .env("KUBECONFIG", dir.join("kubeconfig"))
                .env("RUST_LOG", "info")
                // Plain text, so lines can be matched field by field.
                .env("NO_COLOR", "1"),
            &dir.join(format!("{run}.log")),
        ))
    }

    fn log(&self) -> String {
        self.0.log()
    }

    async fn wait_log(&self, what: &str, line: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Some(found) = self.log().lines().find(|l| line(l)) {
                return found.to_owned();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no log line {what}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM; waits for a clean exit.
    async fn stop(mut self) {
        match self.0.terminate_async(DEADLINE).await {
            Some(status) => assert!(status.success(), "operator exited with {status}:\n{}", self.log()),
            None => panic!("operator did not stop on SIGTERM:\n{}", self.log()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_mode_keeps_gc_off_unless_allowed_and_then_judges_only_its_namespace() {
    assert!(!gc_enabled(Some("crawl"), false));
    assert!(gc_enabled(Some("crawl"), true));
    assert!(gc_enabled(None, false));

    let server = Cluster::start().await;
    let state = StateDir::new();
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(server.plane.admin_kubeconfig(), dir.path().join("kubeconfig")).expect("kubeconfig");
    std::fs::write(
        dir.path().join("providers.yaml"),
        format!(
            "providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: {}\n",
            state.path().display()
        ),
    )
    .expect("providers");
    std::fs::write(dir.path().join("tokens"), "gc-test-token-0123456789\n").expect("tokens");
    std::fs::write(dir.path().join("key"), "0123456789abcdef0123456789abcdef").expect("key");

    // Orphans in the watched namespace and in another one, made by this installation (the
    // operator's: the API server's kube-system UID and `--installation-name`) before the
    // operator runs; the provider object is dropped so only the operator's supervises them.
    let this_installation = Installation::new(
        cluster_identity(&server.client())
            .await
            .expect("the cluster identity"),
        "gc-test",
    );
    let ours_provider = || {
        LocalProvider::for_installation(this_installation.clone(), "local", state.settings())
            .expect("settings")
    };
    // And an orphan of another installation of this cluster sharing the stateDir.
    let foreign = {
        let other = Installation::new(this_installation.cluster_id.clone(), "another");
        let local = LocalProvider::for_installation(other, "local", state.settings()).expect("settings");
        create_on_a_free_port(
            &local,
            plain_request(local_owner("crawl", "foreign"), free_port()),
        )
        .await
        .id
        .native_id
    };
    let (ours, theirs) = {
        let local = ours_provider();
        let ours =
            create_on_a_free_port(&local, plain_request(local_owner("crawl", "ours"), free_port())).await;
        let theirs =
            create_on_a_free_port(&local, plain_request(local_owner("other", "theirs"), free_port())).await;
        (ours.id.native_id, theirs.id.native_id)
    };
    let running = |name: &str| squids(&state.path().join(name)).len() == 1;

    // Namespace mode: GC is off, and the operator says so.
    let operator = Operator::start(dir.path(), "restricted", &["--namespace", "crawl"]);
    operator
        .wait_log("saying GC is disabled", |l| {
            l.contains("orphan GC is disabled in namespace-restricted mode")
        })
        .await;
    operator
        .wait_log("the caches synced", |l| l.contains("caches synced"))
        .await;
    assert!(!operator.log().contains("orphan GC enabled"));
    assert!(running(&ours) && running(&theirs));
    operator.stop().await;

    // Allowed, dry run: only the watched namespace's orphan would be deleted.
    let operator = Operator::start(
        dir.path(),
        "dry-run",
        &["--namespace", "crawl", "--gc-allow-namespaced", "--gc-dry-run"],
    );
    let enabled = operator
        .wait_log("saying GC is enabled", |l| l.contains("orphan GC enabled"))
        .await;
    assert!(
        enabled.contains("namespace=crawl") && enabled.contains("dry_run=true"),
        "{enabled}"
    );
    operator
        .wait_log("a dry-run verdict", |l| {
            l.contains("dry run: would delete orphaned instance") && l.contains(&ours)
        })
        .await;
    assert!(
        !operator.log().contains(&theirs),
        "another namespace's instance is never judged:\n{}",
        operator.log()
    );
    assert!(running(&ours) && running(&theirs), "a dry run deletes nothing");
    operator.stop().await;

    // Allowed: the watched namespace's orphan goes; the other namespace's stays.
    let operator = Operator::start(
        dir.path(),
        "allowed",
        &["--namespace", "crawl", "--gc-allow-namespaced"],
    );
    operator
        .wait_log("the orphan's deletion", |l| {
            l.contains("deleted orphaned instance") && l.contains(&ours)
        })
        .await;
    assert!(!state.path().join(&ours).exists(), "its folder is removed");
    assert!(
        holds_within(DEADLINE, async || squids(&state.path().join(&ours)).is_empty()).await,
        "its Squid is stopped"
    );
    // The pass that deleted ours listed theirs too and left it.
    assert!(running(&theirs), "{}", operator.log());
    assert!(!operator.log().contains(&theirs));
    // Another installation's orphan is left alone, and said so once, not at every pass: a
    // second orphan of ours planted now is collected by a later pass.
    let left_alone =
        |l: &str| l.contains("leaves alone an instance of another installation") && l.contains(&foreign);
    operator
        .wait_log("the foreign instance left alone", left_alone)
        .await;
    let ours_again = create_on_a_free_port(
        &ours_provider(),
        plain_request(local_owner("crawl", "ours-again"), free_port()),
    )
    .await
    .id
    .native_id;
    operator
        .wait_log("the second orphan's deletion", |l| {
            l.contains("deleted orphaned instance") && l.contains(&ours_again)
        })
        .await;
    assert_eq!(
        operator.log().lines().filter(|l| left_alone(l)).count(),
        1,
        "{}",
        operator.log()
    );
    assert!(running(&foreign), "another installation's instance keeps running");
    operator.stop().await;

    ours_provider().delete(&theirs).await.expect("clean up");
    let other = Installation::new(this_installation.cluster_id.clone(), "another");
    LocalProvider::for_installation(other, "local", state.settings())
        .expect("settings")
        .delete(&foreign)
        .await
        .expect("clean up");
}
