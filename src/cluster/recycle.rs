//! Cluster mode's path for the gateway rules' recycle requests ([`RecycleRequests`]): a merge
//! patch of the Proxy's recycle annotation, as `kubectl annotate --overwrite` would make it.
//! The controller's watch sees the change (an annotation moves no generation, but the
//! controller's trigger hashes the request) and the lifecycle acts on it.

use async_trait::async_trait;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;

use crate::{
    api::{Proxy, ProxyKey, RECYCLE_ANNOTATION},
    gateway::rules::{RecycleError, RecycleRequests},
};

/// The field manager of the gateway's patches.
const FIELD_MANAGER: &str = "egress-proxies-operator-gateway";

/// Patches recycle requests onto Proxy objects.
pub struct KubeRecycle {
    client: Client,
}

impl KubeRecycle {
    /// Patches through `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

#[async_trait]
impl RecycleRequests for KubeRecycle {
    async fn request(&self, key: &ProxyKey, value: &str) -> Result<(), RecycleError> {
        let proxies: Api<Proxy> = Api::namespaced(self.client.clone(), key.namespace());
        let patch = json!({"metadata": {"annotations": {RECYCLE_ANNOTATION: value}}});
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        match proxies.patch(key.name(), &params, &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Err(RecycleError::Gone(key.clone())),
            Err(error) => Err(RecycleError::Failed {
                key: key.clone(),
                reason: error.to_string(),
            }),
        }
    }
}
