//! Standalone mode's path for the gateway rules' recycle requests ([`RecycleRequests`]). The
//! manifests are the user's files, so the gateway does not write them: the request goes to the
//! runner, which records it in the Proxy's record in the embedded store
//! ([`super::store::GatewayRecycle`]); the Proxy the reconciler sees carries it as its recycle
//! annotation ([`super::proxy_of`]) until the manifest's own annotation changes (a later
//! request of the user's wins, as a later `kubectl annotate --overwrite` would in a cluster).

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use super::store::ProxyRecord;
use crate::{
    api::{ProxyKey, RECYCLE_ANNOTATION},
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

/// Takes the manifest's `annotations` into `record`; a gateway recycle request stands until
/// the manifest's own recycle annotation changes (the user's later request wins).
pub(super) fn take_annotations(
    record: &mut ProxyRecord,
    annotations: &std::collections::BTreeMap<String, String>,
) {
    if record
        .gateway_recycle
        .as_ref()
        .is_some_and(|g| annotations.get(RECYCLE_ANNOTATION) != g.over.as_ref())
    {
        record.gateway_recycle = None;
    }
    record.annotations = annotations.clone();
}

/// The annotations the Proxy of `record` carries: the manifest's, with a gateway recycle
/// request as its recycle annotation.
pub(super) fn annotations_of(record: &ProxyRecord) -> Option<std::collections::BTreeMap<String, String>> {
    let mut annotations = record.annotations.clone();
    if let Some(request) = &record.gateway_recycle {
        annotations.insert(RECYCLE_ANNOTATION.to_owned(), request.value.clone());
    }
    (!annotations.is_empty()).then_some(annotations)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::standalone::store::GatewayRecycle;

    fn manifest(recycle: Option<&str>) -> BTreeMap<String, String> {
        let mut annotations = BTreeMap::from([("team".to_owned(), "crawl".to_owned())]);
        if let Some(value) = recycle {
            annotations.insert(RECYCLE_ANNOTATION.to_owned(), value.to_owned());
        }
        annotations
    }

    fn recycle_of(record: &ProxyRecord) -> Option<String> {
        annotations_of(record)?.get(RECYCLE_ANNOTATION).cloned()
    }

    #[test]
    fn a_gateway_request_stands_until_the_manifests_own_request_changes() {
        let mut record = ProxyRecord::default();
        take_annotations(&mut record, &manifest(Some("user-1")));
        assert_eq!(recycle_of(&record).as_deref(), Some("user-1"));
        record.gateway_recycle = Some(GatewayRecycle {
            value: "gateway rule r 2026-12-04T16:00:00Z #1".into(),
            over: Some("user-1".into()),
        });
        assert_eq!(
            recycle_of(&record).as_deref(),
            Some("gateway rule r 2026-12-04T16:00:00Z #1")
        );
        // Another annotation's edit leaves it standing.
        let mut edited = manifest(Some("user-1"));
        edited.insert("team".into(), "search".into());
        take_annotations(&mut record, &edited);
        assert!(record.gateway_recycle.is_some());
        assert_eq!(annotations_of(&record).expect("some")["team"], "search");
        // The user's next request wins.
        take_annotations(&mut record, &manifest(Some("user-2")));
        assert_eq!(record.gateway_recycle, None);
        assert_eq!(recycle_of(&record).as_deref(), Some("user-2"));
        // Without any annotation, the gateway's request alone.
        let mut bare = ProxyRecord {
            gateway_recycle: Some(GatewayRecycle {
                value: "gateway rule r x #2".into(),
                over: None,
            }),
            ..ProxyRecord::default()
        };
        assert_eq!(recycle_of(&bare).as_deref(), Some("gateway rule r x #2"));
        take_annotations(&mut bare, &BTreeMap::new());
        assert!(
            bare.gateway_recycle.is_some(),
            "the manifest still has no request of its own"
        );
    }
}
