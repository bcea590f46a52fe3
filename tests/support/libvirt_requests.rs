//! Fixtures for the libvirt provider tests: settings, unique requests, and contract checks
//! that every libvirt provider must pass.
//!
//! Include with `#[path = "support/libvirt_requests.rs"] mod libvirt_requests;`.

#![allow(dead_code)]

use egress_proxies_operator::{
    api::Placement,
    config::{BootSettings, DomainType, KvmSettings, NetworkSettings, PortRange},
    provider::{
        Credentials, Instance, InstanceRequest, Owner, Provider, ProviderError, UserData, instance_name,
    },
};

/// Settings for `uri` and `pool` with a `base.qcow2` base image, type `qemu`, small guests.
pub fn settings(uri: &str, pool: &str, network: NetworkSettings) -> KvmSettings {
    KvmSettings {
        uri: uri.to_owned(),
        pool: pool.to_owned(),
        base_image: "base.qcow2".to_owned(),
        network,
        boot: BootSettings::Disk {},
        memory_mib: 64,
        vcpus: 1,
        domain_type: DomainType::Qemu,
        timeout_seconds: 30,
        console_log_dir: None,
    }
}

/// User-mode networking with forwards from `first..first+99` on 127.0.0.1 (each test file
/// takes its own range, so parallel tests never race for a port).
pub fn user_network(first: u16) -> NetworkSettings {
    NetworkSettings::User {
        host_forward_address: std::net::Ipv4Addr::LOCALHOST,
        host_forward_ports: PortRange {
            first,
            last: first + 99,
        },
    }
}

/// A request for a Proxy `name` with a fresh UID, so names never collide between tests that
/// share a process-global backend.
pub fn request(name: &str) -> InstanceRequest {
    let uid = format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        fastrand::u32(..),
        fastrand::u16(..),
        fastrand::u16(..0x1000),
        fastrand::u16(..0x1000),
        fastrand::u64(..1 << 48)
    );
    InstanceRequest {
        name: instance_name("crawl", name, &uid),
        owner: Owner {
            uid,
            namespace: "crawl".to_owned(),
            name: name.to_owned(),
        },
        spec_hash: format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..)),
        placement: Placement::default(),
        port: 3128,
        user_data: Some(UserData(
            "#cloud-config\nruncmd:\n  - [sh, -c, 'echo user part ran > /run/user-part']\n".to_owned(),
        )),
        credentials: Some(Credentials {
            username: "crawler".to_owned(),
            password: "not-in-logs".to_owned(),
        }),
    }
}

/// Asserts `instance` is `request`'s, on `provider`.
pub fn assert_owned_by(instance: &Instance, provider: &dyn Provider, request: &InstanceRequest) {
    assert_eq!(instance.id, provider.id_for(&request.name));
    assert_eq!(
        instance.id.to_string(),
        format!(
            "{}/{}/{}",
            provider.provider_type(),
            provider.instance(),
            request.name
        )
    );
    assert_eq!(instance.owner.as_ref(), Some(&request.owner));
    assert_eq!(instance.spec_hash.as_deref(), Some(request.spec_hash.as_str()));
}

/// The contract every provider keeps, checked on `provider` with `request` (a fresh name);
/// `restarted` builds a new provider object on the same backend, as an operator that crashed
/// and came back would. Leaves the instance deleted.
pub async fn check_contract(
    provider: &dyn Provider,
    restarted: &dyn Fn() -> Box<dyn Provider>,
    request: &InstanceRequest,
) {
    let name = &request.name;
    // Truthful NotFound before anything exists.
    match provider.get(name).await {
        Err(ProviderError::NotFound(missing)) => assert_eq!(&missing, name),
        other => panic!("get of a missing instance: {other:?}"),
    }
    let before = jiff::Timestamp::now();
    let created = provider.create(request).await.expect("create");
    let after = jiff::Timestamp::now();
    assert_owned_by(&created, provider, request);
    // The stamp keeps the creation time to the nanosecond.
    assert!(
        created.created_at >= before && created.created_at <= after,
        "created_at {} not within [{before}, {after}]",
        created.created_at
    );

    // Idempotent create: the same instance, not a second one.
    let again = provider.create(request).await.expect("second create");
    assert_eq!(again.id, created.id);
    assert_eq!(
        again.created_at, created.created_at,
        "a second create must not remake the instance"
    );

    let got = provider.get(name).await.expect("get");
    assert_owned_by(&got, provider, request);
    assert_eq!(got.created_at, created.created_at);

    // List carries owner UID and creation time.
    let listed = provider.list().await.expect("list");
    let mine: Vec<_> = listed.iter().filter(|i| i.id.native_id == *name).collect();
    assert_eq!(mine.len(), 1, "listed: {listed:?}");
    assert_eq!(
        mine[0].owner.as_ref().map(|o| o.uid.as_str()),
        Some(request.owner.uid.as_str())
    );
    assert_eq!(mine[0].created_at, created.created_at);

    // After a crash: a new provider object finds the instance instead of making another.
    let fresh = restarted();
    let found = fresh.create(request).await.expect("create after restart");
    assert_eq!(found.id, created.id);
    assert_eq!(found.created_at, created.created_at);

    // Idempotent delete and truthful NotFound afterwards.
    provider.delete(name).await.expect("delete");
    match provider.get(name).await {
        Err(ProviderError::NotFound(_)) => {}
        other => panic!("get after delete: {other:?}"),
    }
    provider.delete(name).await.expect("second delete");
    fresh
        .delete(name)
        .await
        .expect("delete from the restarted provider");
    let listed = provider.list().await.expect("list after delete");
    assert!(
        listed.iter().all(|i| i.id.native_id != *name),
        "still listed: {listed:?}"
    );
}
