//! Standalone mode's path for the gateway rules' recycle requests ([`RecycleRequests`]). The
//! manifests are the user's files, so the gateway does not write them: the request goes to the
//! runner, which records it in the Proxy's record in the embedded store
//! ([`super::store::GatewayRecycle`]); the Proxy the reconciler sees carries it as its recycle
//! annotation ([`super::proxy_of`]) until the manifest's own annotation changes (a later
//! request of the user's wins, as a later `kubectl annotate --overwrite` would in a cluster).

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use crate::{
    api::ProxyKey,
    gateway::rules::{RecycleError, RecycleRequests},
};

/// One request for the runner: the Proxy, the value, and where to say whether it was recorded.
pub struct RecycleAsk {
    /// The Proxy.
    pub key: ProxyKey,
    /// The recycle request's value.
    pub value: String,
    /// Told once the record holds it (or why not).
    pub done: oneshot::Sender<Result<(), RecycleError>>,
}

/// Hands recycle requests to the runner ([`super::Standalone::with_recycle_requests`]).
pub struct StandaloneRecycle {
    asks: mpsc::Sender<RecycleAsk>,
}

impl StandaloneRecycle {
    /// A path and the runner's end of it.
    pub fn channel() -> (Self, mpsc::Receiver<RecycleAsk>) {
        // The gateway makes at most one request per proxy at a time: a small queue is plenty.
        let (asks, received) = mpsc::channel(64);
        (Self { asks }, received)
    }
}

#[async_trait]
impl RecycleRequests for StandaloneRecycle {
    async fn request(&self, key: &ProxyKey, value: &str) -> Result<(), RecycleError> {
        let stopped = || RecycleError::Failed {
            key: key.clone(),
            reason: "standalone mode is stopping".to_owned(),
        };
        let (done, answer) = oneshot::channel();
        let ask = RecycleAsk {
            key: key.clone(),
            value: value.to_owned(),
            done,
        };
        self.asks.send(ask).await.map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}
