//! The provider-health monitor's sink in cluster mode: one cluster-scoped `ProviderHealth`
//! object per provider instance, written only when what it shows changes (a restarted operator
//! finding the same writes nothing), its condition's transition time moved only by a
//! transition. Must not touch: availability (the monitor keeps it).

use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};

use crate::api::{ProviderHealth, ProviderHealthFields, ProviderHealthStatus};
use crate::monitor::{HealthSink, ProbeOutcome};

/// Writes one `ProviderHealth` per provider instance, named after it.
pub struct KubeHealthSink {
    api: Api<ProviderHealth>,
}

impl KubeHealthSink {
    /// A sink writing through `client`.
    pub fn new(client: Client) -> Self {
        Self {
            api: Api::all(client),
        }
    }
}

#[async_trait]
impl HealthSink for KubeHealthSink {
    async fn publish(&self, outcome: &ProbeOutcome) -> Result<(), String> {
        let mut object = match self
            .api
            .get_opt(&outcome.provider)
            .await
            .map_err(|e| e.to_string())?
        {
            Some(object) => object,
            None => {
                let fresh = ProviderHealth {
                    metadata: ObjectMeta {
                        name: Some(outcome.provider.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: ProviderHealthFields {},
                    status: None,
                };
                self.api
                    .create(&PostParams::default(), &fresh)
                    .await
                    .map_err(|e| e.to_string())?
            }
        };
        let (status, reason) = if outcome.available {
            ("True", "ProbeSucceeded")
        } else {
            ("False", "ProbeFailed")
        };
        let stored = object.status.take();
        let since = stored
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Available"))
            .filter(|c| c.status == status)
            .map_or(Time(outcome.at), |c| c.last_transition_time.clone());
        let fresh = ProviderHealthStatus {
            provider_type: Some(outcome.provider_type.clone()),
            conditions: vec![Condition {
                type_: "Available".to_owned(),
                status: status.to_owned(),
                reason: reason.to_owned(),
                message: outcome.message.chars().take(1000).collect(),
                observed_generation: object.metadata.generation,
                last_transition_time: since,
            }],
            last_probe_time: Some(Time(outcome.at)),
            latency_millis: Some(i64::try_from(outcome.latency.as_millis()).unwrap_or(i64::MAX)),
            message: Some(outcome.message.chars().take(1000).collect()),
            instance_count: outcome
                .instance_count
                .map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        };
        if stored.is_some_and(|stored| shows_the_same(stored, &fresh)) {
            return Ok(());
        }
        object.status = Some(fresh);
        self.api
            .replace_status(&outcome.provider, &PostParams::default(), &object)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// Whether `stored` shows what `fresh` does, apart from when its probe ran and how long it took.
fn shows_the_same(mut stored: ProviderHealthStatus, fresh: &ProviderHealthStatus) -> bool {
    stored.last_probe_time.clone_from(&fresh.last_probe_time);
    stored.latency_millis = fresh.latency_millis;
    stored == *fresh
}
