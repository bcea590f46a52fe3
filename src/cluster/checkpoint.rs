//! The lease checkpoint in ConfigMaps (a part per lease-store shard) and the Events that say
//! on the leader Lease when saving it fails and recovers. Owns: the checkpoint's objects (their
//! names, label, layout). Must not touch: the lease store's contents (it saves what
//! [`crate::lease::checkpoint`] hands it).

use std::collections::BTreeMap;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
    runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter},
};
use tokio::sync::watch;
use tracing::warn;

use super::LEADER_LEASE;
use crate::lease::checkpoint::{
    Checkpoint, CheckpointError, CheckpointHealth, CheckpointStore, Written, decode, decode_chunks,
    encode_chunks,
};

/// The lease checkpoint in ConfigMaps: one or more per lease-store shard, named
/// `egress-proxies-operator-leases-<shard>-<part>` and labelled
/// [`CHECKPOINT_LABEL`]`=`[`LEADER_LEASE`], each holding a self-contained checkpoint of at most
/// [`CHECKPOINT_PART_BYTES`] (JSON in the `checkpoint.json` key). A save rewrites only the
/// changed shard's parts (one server-side apply each) and deletes parts it no longer needs; a
/// load lists them by label and joins them. Before this layout the checkpoint was one ConfigMap
/// named [`LEADER_LEASE`] (a key per chunk); it is read when no part exists.
pub struct ConfigMapCheckpoint {
    api: Api<ConfigMap>,
    /// Parts each shard has in the API, as last loaded or saved: what a save may delete.
    parts: std::sync::Mutex<BTreeMap<usize, usize>>,
}

/// Label on every lease checkpoint part.
pub const CHECKPOINT_LABEL: &str = "crawl.example.com/lease-checkpoint";
/// Most checkpoint JSON in one ConfigMap: half of the 1 MiB object limit, so the object (its
/// data JSON-escaped in the request) stays under it and under etcd's 1.5 MiB request limit.
pub const CHECKPOINT_PART_BYTES: usize = 512 * 1024;
const CHECKPOINT_KEY: &str = "checkpoint.json";
const SHARD_ANNOTATION: &str = "crawl.example.com/lease-checkpoint-shard";

fn part_name(shard: usize, part: usize) -> String {
    format!("{LEADER_LEASE}-leases-{shard:02}-{part}")
}

impl ConfigMapCheckpoint {
    /// In `namespace`.
    pub fn new(client: Client, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            parts: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    fn backend(error: kube::Error) -> CheckpointError {
        CheckpointError::Backend(error.to_string())
    }

    fn known_parts(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        self.parts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The layout before per-shard parts: one ConfigMap, a data key per chunk.
    async fn load_single(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        let found = self.api.get_opt(LEADER_LEASE).await.map_err(Self::backend)?;
        let chunks: Vec<String> = found
            .and_then(|cm| cm.data)
            .map(|d| d.into_values().collect())
            .unwrap_or_default();
        decode_chunks(&chunks)
    }
}

#[async_trait]
impl CheckpointStore for ConfigMapCheckpoint {
    async fn load(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        // Pages of a few parts: a 100,000-lease checkpoint is tens of MiB in all.
        let mut params = ListParams::default()
            .labels(&format!("{CHECKPOINT_LABEL}={LEADER_LEASE}"))
            .limit(8);
        let mut parts = Vec::new();
        let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
        loop {
            let page = self.api.list(&params).await.map_err(Self::backend)?;
            for cm in page.items {
                let shard = cm
                    .annotations()
                    .get(SHARD_ANNOTATION)
                    .and_then(|s| s.parse::<usize>().ok());
                let Some(json) = cm.data.as_ref().and_then(|d| d.get(CHECKPOINT_KEY)) else {
                    continue;
                };
                parts.push(decode(json.as_bytes())?);
                if let Some(shard) = shard {
                    *counts.entry(shard).or_insert(0) += 1;
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        if parts.is_empty() {
            return self.load_single().await;
        }
        *self.known_parts() = counts;
        Ok(Checkpoint::merge(parts))
    }

    /// The whole checkpoint as shard 0's parts: being newer, it wins over every older part
    /// when parts are merged. [`crate::lease::checkpoint::maintenance`] saves per shard instead.
    async fn save(&self, checkpoint: &Checkpoint) -> Result<Written, CheckpointError> {
        self.save_shard(0, checkpoint).await
    }

    fn per_shard(&self) -> bool {
        true
    }

    async fn save_shard(&self, shard: usize, part: &Checkpoint) -> Result<Written, CheckpointError> {
        let chunks = encode_chunks(part, CHECKPOINT_PART_BYTES)?;
        let mut written = Written::default();
        let params = PatchParams::apply(LEADER_LEASE).force();
        for (i, chunk) in chunks.iter().enumerate() {
            let name = part_name(shard, i);
            let cm = serde_json::json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": name,
                    "labels": { CHECKPOINT_LABEL: LEADER_LEASE },
                    "annotations": { SHARD_ANNOTATION: shard.to_string() },
                },
                "data": { CHECKPOINT_KEY: chunk },
            });
            self.api
                .patch(&name, &params, &Patch::Apply(&cm))
                .await
                .map_err(Self::backend)?;
            written += Written {
                objects: 1,
                bytes: chunk.len() as u64,
            };
        }
        let had = self.known_parts().get(&shard).copied().unwrap_or(0);
        // Parts past the new count hold proxies the new parts also hold (or that are gone).
        for i in chunks.len()..had {
            match self
                .api
                .delete(&part_name(shard, i), &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(Self::backend(error)),
            }
            written.objects += 1;
        }
        self.known_parts().insert(shard, chunks.len());
        Ok(written)
    }
}

/// Publishes an Event on the leader Lease when lease checkpoint saves start failing (Warning
/// `LeaseCheckpointFailed`, with the error) and when they succeed again (Normal
/// `LeaseCheckpointRecovered`): the metric and `/readyz` say it too, the Event says it where
/// `kubectl describe lease` looks.
pub async fn report_checkpoint_health(
    client: Client,
    namespace: String,
    identity: String,
    mut health: watch::Receiver<CheckpointHealth>,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: LEADER_LEASE.to_owned(),
            instance: Some(identity),
        },
    );
    let lease = ObjectReference {
        api_version: Some("coordination.k8s.io/v1".to_owned()),
        kind: Some("Lease".to_owned()),
        name: Some(LEADER_LEASE.to_owned()),
        namespace: Some(namespace),
        ..ObjectReference::default()
    };
    let mut failing = false;
    while health.changed().await.is_ok() {
        let now = health.borrow_and_update().clone();
        let event = match (&now.failing, failing) {
            (Some(error), false) => KubeEvent {
                type_: EventType::Warning,
                reason: "LeaseCheckpointFailed".to_owned(),
                // Errors name objects and limits, never credentials: checkpoints hold none.
                note: Some(
                    format!("saving the lease checkpoint failed (retrying every second): {error}")
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "SaveLeaseCheckpoint".to_owned(),
                secondary: None,
            },
            (None, true) => KubeEvent {
                type_: EventType::Normal,
                reason: "LeaseCheckpointRecovered".to_owned(),
                note: Some("the lease checkpoint is saved again".to_owned()),
                action: "SaveLeaseCheckpoint".to_owned(),
                secondary: None,
            },
            _ => continue,
        };
        failing = now.failing.is_some();
        if let Err(error) = recorder.publish(&event, &lease).await {
            warn!(%error, "publishing the lease checkpoint Event failed");
        }
    }
}
