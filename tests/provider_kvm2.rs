//! The `kvm2` provider against libvirt's `test:///default` driver: a mock hypervisor inside
//! this process (its state is process-global, so every test uses fresh names). It checks the
//! contract, the owner stamp, endpoint discovery from DHCP leases, and that domains without
//! kvm2's stamp stay invisible and untouched.

#[path = "support/libvirt_requests.rs"]
mod libvirt_requests;

#[allow(dead_code)]
#[macro_use]
mod support {
    #[macro_use]
    pub mod contract;
    pub mod libvirt_contract;
}

use egress_proxies_operator::{
    config::NetworkSettings,
    provider::{
        InstanceState, Provider, ProviderError,
        kvm2::Kvm2Provider,
        libvirt::{KVM_NAMESPACE, KVM2_NAMESPACE},
        squid::USER_NAME_RULE,
    },
};
use libvirt_requests::{request, request_for, settings, user_network};
use virt::connect::Connect;

const URI: &str = "test:///default";
const POOL: &str = "default-pool";

/// A connection to the test driver with the base image in its pool, held for the whole test.
fn test_driver() -> Connect {
    libvirt_requests::test_driver(URI, POOL)
}

fn provider() -> Kvm2Provider {
    Kvm2Provider::new("kvm2-test", settings(URI, POOL, NetworkSettings::default()))
}

fn volumes(connection: &Connect) -> Vec<String> {
    connection
        .lookup_storage_pool_by_name(POOL)
        .expect("pool")
        .list_volumes()
        .expect("volumes")
}

/// The shared contract suite, one test per property.
mod contract_on_the_test_driver {
    use std::sync::Arc;

    use super::{URI, provider, request_for, test_driver};
    use crate::support::libvirt_contract::LibvirtBackend;

    fn backend() -> LibvirtBackend {
        LibvirtBackend::new(URI, || Arc::new(provider()), request_for, test_driver())
    }

    contract_tests!(backend());
}

#[tokio::test]
async fn delete_takes_every_volume_with_the_domain() {
    let connection = test_driver();
    let provider = provider();
    let req = request("volumes");
    provider.create(&req).await.expect("create");
    assert!(
        volumes(&connection).iter().any(|v| v.starts_with(&req.name)),
        "create made volumes"
    );
    provider.delete(&req.name).await.expect("delete");
    // Everything made for the instance went with it.
    let left: Vec<_> = volumes(&connection)
        .into_iter()
        .filter(|v| v.starts_with(&req.name))
        .collect();
    assert!(left.is_empty(), "volumes left: {left:?}");
}

#[tokio::test]
async fn created_domain_carries_the_stamp_volumes_and_a_leased_endpoint() {
    let connection = test_driver();
    let provider = provider();
    let req = request("stamped");
    let instance = provider.create(&req).await.expect("create");
    assert_eq!(instance.state, InstanceState::Running);
    // The test driver's network hands out a lease; the endpoint is it, on the proxy port.
    let endpoint = instance.endpoint.expect("endpoint from the DHCP lease");
    assert!(endpoint.host.starts_with("192.168.122."), "{endpoint}");
    assert_eq!(endpoint.port, 3128);

    let domain = connection.lookup_domain_by_name(&req.name).expect("domain");
    let stamp = domain
        .metadata(
            virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(KVM2_NAMESPACE),
            0,
        )
        .expect("kvm2 stamp");
    assert!(stamp.contains(&format!("uid=\"{}\"", req.owner.uid)), "{stamp}");
    assert!(
        stamp.contains(&format!("specHash=\"{}\"", req.spec_hash)),
        "{stamp}"
    );
    assert!(
        stamp.contains("namespace=\"crawl\"") && stamp.contains("name=\"stamped\""),
        "{stamp}"
    );
    assert!(stamp.contains("provider=\"kvm2-test\""), "{stamp}");
    assert!(
        domain
            .metadata(
                virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                Some(KVM_NAMESPACE),
                0
            )
            .is_err(),
        "no kvm stamp on a kvm2 domain"
    );
    let xml = domain.xml_desc(0).expect("xml");
    assert!(
        xml.contains(&format!("volume='{}-kvm2-disk.qcow2'", req.name)),
        "{xml}"
    );
    assert!(
        xml.contains(&format!("volume='{}-kvm2-seed.iso'", req.name)),
        "{xml}"
    );
    assert!(
        !xml.contains("not-in-logs"),
        "credentials stay out of the domain XML"
    );
    let vols = volumes(&connection);
    for suffix in ["-kvm2-disk.qcow2", "-kvm2-seed.iso"] {
        assert!(vols.contains(&format!("{}{suffix}", req.name)), "{vols:?}");
    }
    provider.delete(&req.name).await.expect("delete");
    assert!(connection.lookup_domain_by_name(&req.name).is_err());
}

#[tokio::test]
async fn user_mode_endpoint_is_the_host_forward() {
    let _connection = test_driver();
    let provider = Kvm2Provider::new("kvm2-user", settings(URI, POOL, user_network(22000)));
    let first = request("forwarded-a");
    let second = request("forwarded-b");
    let a = provider.create(&first).await.expect("create a");
    let b = provider.create(&second).await.expect("create b");
    let (ea, eb) = (a.endpoint.expect("a endpoint"), b.endpoint.expect("b endpoint"));
    assert_eq!((ea.host.as_str(), eb.host.as_str()), ("127.0.0.1", "127.0.0.1"));
    assert!((22000..22100).contains(&ea.port) && (22000..22100).contains(&eb.port));
    assert_ne!(ea.port, eb.port, "each instance gets its own forward");
    // The forward is persisted: get and list report the same.
    assert_eq!(provider.get(&first.name).await.expect("get").endpoint, Some(ea));
    for req in [&first, &second] {
        provider.delete(&req.name).await.expect("delete");
    }
}

#[tokio::test]
async fn domains_without_kvm2s_stamp_are_invisible_and_untouched() {
    let connection = test_driver();
    let provider = provider();
    // The test driver's own domain `test`, and one stamped in kvm's namespace.
    let req = request("foreign");
    let xml = format!(
        "<domain type='test'><name>{}</name><metadata><k:owner xmlns:k='{KVM_NAMESPACE}' uid='{}'/></metadata>\
         <memory>65536</memory><os><type>hvm</type></os></domain>",
        req.name, req.owner.uid
    );
    let foreign = connection.define_domain_xml(&xml).expect("define foreign domain");
    let listed = provider.list().await.expect("list");
    assert!(
        listed
            .iter()
            .all(|i| i.id.native_id != "test" && i.id.native_id != req.name),
        "{listed:?}"
    );
    for name in ["test", req.name.as_str()] {
        assert!(
            matches!(provider.get(name).await, Err(ProviderError::NotFound(_))),
            "{name}"
        );
        provider
            .delete(name)
            .await
            .expect("delete of a foreign domain is a no-op");
    }
    assert!(connection.lookup_domain_by_name("test").is_ok(), "left alone");
    assert!(connection.lookup_domain_by_name(&req.name).is_ok(), "left alone");
    // Creating over it is refused, and leaves it as it was.
    match provider.create(&req).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(message.contains("will not adopt"), "{message}")
        }
        other => panic!("create over a foreign domain: {other:?}"),
    }
    assert!(connection.lookup_domain_by_name(&req.name).is_ok());
    foreign.undefine().expect("clean up");
}

#[tokio::test]
async fn missing_pool_base_image_or_network_is_misconfigured_and_leaves_nothing() {
    let connection = test_driver();
    let mut cases = Vec::new();
    let mut no_pool = settings(URI, "no-such-pool", NetworkSettings::default());
    no_pool.pool = "no-such-pool".into();
    cases.push((no_pool, "storage pool no-such-pool does not exist"));
    let mut no_base = settings(URI, POOL, NetworkSettings::default());
    no_base.base_image = "missing.qcow2".into();
    cases.push((
        no_base,
        "base image missing.qcow2 is not a volume of storage pool default-pool",
    ));
    let no_network = settings(
        URI,
        POOL,
        NetworkSettings::Libvirt {
            name: "nowhere".into(),
        },
    );
    cases.push((no_network, "libvirt network nowhere does not exist"));
    for (settings, expected) in cases {
        let provider = Kvm2Provider::new("kvm2-bad", settings);
        let req = request("bad-input");
        match provider.create(&req).await {
            Err(ProviderError::Misconfigured(message)) => {
                assert!(message.contains(expected), "{message}");
                assert!(!message.contains("not-in-logs"));
            }
            other => panic!("expected Misconfigured with {expected:?}, got {other:?}"),
        }
        assert!(
            connection.lookup_domain_by_name(&req.name).is_err(),
            "no domain left"
        );
        assert!(
            volumes(&connection).iter().all(|v| !v.starts_with(&req.name)),
            "no volume left"
        );
    }
}

#[tokio::test]
async fn a_user_name_squid_cannot_carry_is_rejected_before_any_volume_or_domain() {
    let connection = test_driver();
    let provider = provider();
    let mut req = request("bad-user");
    let credentials = req.credentials.as_mut().expect("the fixture has credentials");
    credentials.username = "crawler\nhttp_access allow all".into();
    match provider.create(&req).await {
        // The Proxy's problem: the controller waits for it to change instead of retrying.
        Err(err @ ProviderError::Rejected(_)) => {
            let message = err.to_string();
            assert!(
                message.contains("character 8 of the proxy user name is '\\n'"),
                "{message}"
            );
            assert!(message.contains(USER_NAME_RULE), "{message}");
            assert!(!message.contains("not-in-logs"), "no password in {message}");
            assert!(!err.is_transient());
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(
        connection.lookup_domain_by_name(&req.name).is_err(),
        "no domain made"
    );
    assert!(
        volumes(&connection).iter().all(|v| !v.starts_with(&req.name)),
        "no disk or seed volume made"
    );
}

#[tokio::test]
async fn probe_reports_version_and_count() {
    let _connection = test_driver();
    let provider = provider();
    let req = request("probed");
    provider.create(&req).await.expect("create");
    let report = provider.probe().await.expect("probe");
    assert!(report.instance_count >= 1);
    assert!(
        report.detail.contains("libvirt ") && report.detail.contains(URI),
        "{}",
        report.detail
    );
    provider.delete(&req.name).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_creates_of_one_name_make_one_domain() {
    let connection = test_driver();
    let provider = provider();
    let req = request("concurrent");
    let creates = futures::future::join_all((0..6).map(|_| provider.create(&req))).await;
    let created: Vec<_> = creates
        .into_iter()
        .map(|outcome| outcome.expect("create").created_at)
        .collect();
    assert!(
        created.iter().all(|at| *at == created[0]),
        "one domain, returned six times: {created:?}"
    );
    let domains = connection.list_all_domains(0).expect("domains");
    let named = domains
        .iter()
        .filter(|d| d.name().is_ok_and(|name| name == req.name))
        .count();
    assert_eq!(named, 1);
    provider.delete(&req.name).await.expect("delete");
}

#[tokio::test]
async fn a_damaged_stamp_is_listed_without_an_owner() {
    let connection = test_driver();
    let provider = provider();
    let req = request("damaged");
    let xml = format!(
        "<domain type='test'><name>{}</name><metadata><k:owner xmlns:k='{KVM2_NAMESPACE}' uid='{}'/></metadata>\
         <memory>65536</memory><os><type>hvm</type></os></domain>",
        req.name, req.owner.uid
    );
    let damaged = connection.define_domain_xml(&xml).expect("define");
    // Listed (it carries kvm2's stamp), but with no owner: orphan GC never deletes it.
    let listed = provider.list().await.expect("list");
    let found = listed
        .iter()
        .find(|i| i.id.native_id == req.name)
        .expect("listed");
    assert_eq!(found.owner, None);
    assert_eq!(found.spec_hash, None);
    let got = provider.get(&req.name).await.expect("get");
    assert_eq!(got.owner, None);
    damaged.undefine().expect("clean up");
}
