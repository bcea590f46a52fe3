//! Fixtures for the libvirt provider tests: settings and unique requests (the contract checks
//! are the shared suite's, through `libvirt_contract.rs`).
//!
//! Include with `#[path = "support/libvirt_requests.rs"] mod libvirt_requests;`.

#![allow(dead_code)]

use egress_proxies_operator::{
    api::Placement,
    config::{BootSettings, DomainType, KvmSettings, NetworkSettings, PortRange},
    provider::{Credentials, Instance, InstanceRequest, Owner, Provider, UserData, instance_name},
};

/// A connection to libvirt's test driver (`test:///default`) with a `base.qcow2` base image in
/// its `pool`. Hold it for the whole test: the driver's state is process-global and lives only
/// while some connection is open, and the providers' own connections come and go with each call.
pub fn test_driver(uri: &str, pool: &str) -> virt::connect::Connect {
    virt::error::clear_error_callback();
    let connection = virt::connect::Connect::open(Some(uri)).expect("test driver");
    let pool = connection.lookup_storage_pool_by_name(pool).expect("the pool");
    if pool.lookup_storage_vol_by_name("base.qcow2").is_err() {
        // Another test may add it at the same moment; either copy does.
        let _ = virt::storage_vol::StorageVol::create_xml(
            &pool,
            "<volume><name>base.qcow2</name><capacity unit='bytes'>16777216</capacity>\
             <target><format type='qcow2'/></target></volume>",
            0,
        );
    }
    connection
}

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
    request_for(&Owner {
        uid,
        namespace: "crawl".to_owned(),
        name: name.to_owned(),
    })
}

/// The request for `owner`'s Proxy: the same owner always gives the same request (the spec
/// hash derives from the UID), with user-data and credentials to seed.
pub fn request_for(owner: &Owner) -> InstanceRequest {
    InstanceRequest {
        name: instance_name(&owner.namespace, &owner.name, &owner.uid),
        owner: owner.clone(),
        spec_hash: format!("spec-{}", owner.uid),
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
