//! The cluster-scoped `ProviderHealth` resource: one object per configured provider instance,
//! written by the provider-health monitor when the instance's availability changes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// `ProviderHealth` carries no desired state: its name is the provider instance's name and
/// everything else is status. The struct exists because the derive needs one.
// Several printer columns share `type_ = "string"`; clippy reads that as a repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "ProviderHealth",
    plural = "providerhealths",
    no_spec,
    status = "ProviderHealthStatus",
    shortname = "ph",
    category = "crawl",
    derive = "PartialEq",
    doc = "Health of one configured provider instance, as last probed by the operator.",
    printcolumn(name = "Type", type_ = "string", json_path = ".status.providerType"),
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].status"
    ),
    printcolumn(name = "Instances", type_ = "integer", json_path = ".status.instanceCount"),
    printcolumn(
        name = "Latency",
        type_ = "integer",
        json_path = ".status.latencyMillis",
        priority = 1
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
pub struct ProviderHealthFields {}

/// What the last probe of the provider instance found.
#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProviderHealthStatus {
    /// Provider type of the instance (`kvm`, `kvm2`, `kubernetes`, `local`).
    pub provider_type: Option<String>,
    /// The `Available` condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// When the probe that found what this status shows ran. Written when that changes
    /// (availability, message, instance count), not on every probe.
    pub last_probe_time: Option<Time>,
    /// Latency of the probe (connect and list) in milliseconds.
    pub latency_millis: Option<i64>,
    /// Human-readable detail of the last probe's outcome.
    pub message: Option<String>,
    /// Number of instances the provider reports as owned by this operator.
    pub instance_count: Option<i64>,
}
