//! The shared provider contract suite ([`super::contract`]) on a libvirt backend: a provider
//! made by a closure (kvm2 or kvm, on the test driver or a private daemon), its requests from
//! `libvirt_requests::request_for`, and its domains counted through libvirt's own API.
//!
//! Include next to `contract` in the test's `support` module.

use std::{any::Any, sync::Arc};

use async_trait::async_trait;
use egress_proxies_operator::provider::{InstanceRequest, Owner, Provider};

use super::contract::ContractBackend;

/// A libvirt backend for the contract suite.
pub struct LibvirtBackend {
    uri: String,
    open: Box<dyn Fn() -> Arc<dyn Provider> + Send + Sync>,
    request: fn(&Owner) -> InstanceRequest,
    /// What keeps the backend alive while the suite runs (a private daemon, or a connection
    /// to the test driver, whose state lives only while one is open).
    _keep: Box<dyn Any + Send + Sync>,
}

impl LibvirtBackend {
    /// A backend on `uri` whose providers `open` makes, with requests from `request`.
    pub fn new(
        uri: &str,
        open: impl Fn() -> Arc<dyn Provider> + Send + Sync + 'static,
        request: fn(&Owner) -> InstanceRequest,
        keep: impl Any + Send + Sync,
    ) -> Self {
        Self {
            uri: uri.to_owned(),
            open: Box::new(open),
            request,
            _keep: Box::new(keep),
        }
    }
}

#[async_trait]
impl ContractBackend for LibvirtBackend {
    async fn open(&self) -> Arc<dyn Provider> {
        (self.open)()
    }

    fn request(&self, owner: &Owner) -> InstanceRequest {
        (self.request)(owner)
    }

    async fn backend_objects(&self, name: &str) -> usize {
        let (uri, name) = (self.uri.clone(), name.to_owned());
        tokio::task::spawn_blocking(move || {
            let connection = virt::connect::Connect::open(Some(&uri)).expect("libvirt connection");
            let domains = connection.list_all_domains(0).expect("list domains");
            domains
                .iter()
                .filter(|d| d.name().is_ok_and(|n| n == name))
                .count()
        })
        .await
        .expect("counting domains")
    }
}
