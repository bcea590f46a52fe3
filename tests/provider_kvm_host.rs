//! Opt-in: the `kvm2` and `kvm` providers against a real libvirt host you name (a KVM
//! hypervisor, local or over `qemu+ssh://`). Skipped unless the URIs are set; see
//! docs/providers-existing.md ("Testing against a real KVM host") for the variables:
//!
//! - `EPO_KVM2_TEST_URI`, `EPO_KVM_TEST_URI`: libvirt URIs; each enables its provider's test.
//! - `EPO_KVM_TEST_POOL` (default `default`), `EPO_KVM_TEST_BASE_IMAGE` (required): an active
//!   storage pool and a volume in it to overlay.
//! - `EPO_KVM_TEST_NETWORK` (default `default`): the libvirt network guests join, or
//!   `bridge:NAME` for a host bridge, or `user` for user-mode networking with forwards from
//!   127.0.0.1:20000-20999.
//! - `EPO_KVM_TEST_DOMAIN_TYPE` (`kvm` by default, or `qemu`).
//!
//! Each runs the shared provider contract suite (tests/support/contract.rs); the domains it
//! creates and deletes are named `epo-contract-...`, and nothing is left behind when it passes.

#[path = "support/libvirt_requests.rs"]
mod libvirt_requests;

#[allow(dead_code)]
#[macro_use]
mod support {
    #[macro_use]
    pub mod contract;
    pub mod libvirt_contract;
}

use std::sync::Arc;

use egress_proxies_operator::{
    config::{DomainType, KvmSettings, NetworkSettings},
    provider::{Provider, ProviderError, kvm::KvmProvider, kvm2::Kvm2Provider},
};
use libvirt_requests::request_for;
use support::{contract::run_contract_suite, libvirt_contract::LibvirtBackend};

fn host_settings(uri_variable: &str) -> Option<KvmSettings> {
    let uri = std::env::var(uri_variable).ok().filter(|uri| !uri.is_empty())?;
    let variable = |name: &str, default: Option<&str>| {
        std::env::var(name)
            .ok()
            .or(default.map(str::to_owned))
            .unwrap_or_else(|| panic!("{uri_variable} is set, so {name} must be too"))
    };
    let network = variable("EPO_KVM_TEST_NETWORK", Some("default"));
    let network = match network.split_once(':') {
        _ if network == "user" => NetworkSettings::User {
            host_forward_address: std::net::Ipv4Addr::LOCALHOST,
            host_forward_ports: Default::default(),
        },
        Some(("bridge", name)) => NetworkSettings::Bridge {
            name: name.to_owned(),
        },
        _ => NetworkSettings::Libvirt { name: network },
    };
    let mut settings =
        libvirt_requests::settings(&uri, &variable("EPO_KVM_TEST_POOL", Some("default")), network);
    settings.base_image = variable("EPO_KVM_TEST_BASE_IMAGE", None);
    settings.memory_mib = 256;
    settings.domain_type = match variable("EPO_KVM_TEST_DOMAIN_TYPE", Some("kvm")).as_str() {
        "qemu" => DomainType::Qemu,
        _ => DomainType::Kvm,
    };
    Some(settings)
}

async fn contract_on_host(settings: KvmSettings, open: fn(KvmSettings) -> Arc<dyn Provider>) {
    let provider = open(settings.clone());
    let report = provider.probe().await.expect("probe the host");
    eprintln!("{}: {}", provider.provider_type(), report.detail);
    let uri = settings.uri.clone();
    run_contract_suite(&LibvirtBackend::new(
        &uri,
        move || open(settings.clone()),
        request_for,
        (),
    ))
    .await;
    assert!(matches!(
        provider.get("epo-contract-none").await,
        Err(ProviderError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm2_keeps_the_contract_on_a_real_host() {
    let Some(settings) = host_settings("EPO_KVM2_TEST_URI") else {
        eprintln!("skipped: set EPO_KVM2_TEST_URI (see docs/providers-existing.md)");
        return;
    };
    contract_on_host(settings, |s| Arc::new(Kvm2Provider::new("kvm2-host", s))).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm_keeps_the_contract_on_a_real_host() {
    let Some(settings) = host_settings("EPO_KVM_TEST_URI") else {
        eprintln!("skipped: set EPO_KVM_TEST_URI (see docs/providers-existing.md)");
        return;
    };
    contract_on_host(settings, |s| Arc::new(KvmProvider::new("kvm-host", s))).await;
}
