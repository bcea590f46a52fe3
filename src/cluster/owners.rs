//! Live owners for orphan GC in cluster mode: the UIDs of the Proxies the API server holds now
//! (a fresh list, never the controller's cache, which may lag a create). Must not touch: the
//! verdicts (they are [`crate::gc`]'s).

use std::collections::HashSet;

use async_trait::async_trait;
use kube::{Api, api::ListParams};

use crate::{api::Proxy, gc::LiveOwners};

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
        let api: Api<Proxy> = match namespace {
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
