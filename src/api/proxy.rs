//! The namespaced `Proxy` resource: one egress proxy, provisioned through a named provider
//! instance and handed to crawlers through the discovery API.

use super::Attributes;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Label a Secret must carry to be used as cloud-init content. The operator only watches and
/// caches Secrets with this label, so unrelated Secrets never enter its memory.
pub const CLOUD_INIT_SECRET_LABEL: &str = "crawl.example.com/cloud-init";

/// Desired state of one egress proxy.
///
/// Only `placement`, the resolved cloud-init content and the effective `port` decide *what
/// runs*: changing them replaces the instance. Attributes, lease limits and health settings
/// are applied in place and never churn instances.
// Several printer columns share `type_ = "string"`; clippy reads that as a repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[serde_with::skip_serializing_none]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "Proxy",
    plural = "proxies",
    namespaced,
    status = "ProxyStatus",
    shortname = "px",
    category = "crawl",
    derive = "PartialEq",
    doc = "An egress proxy provisioned through a named provider instance and leased to crawlers.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Provider", type_ = "string", json_path = ".spec.provider"),
    printcolumn(name = "Endpoint", type_ = "string", json_path = ".status.endpoint"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ProxySpec {
    /// Name of a provider instance from the operator's providers config (an instance name
    /// such as `kvm-rack1`, not a provider type). Immutable: moving a proxy to another
    /// provider means deleting it and creating a new one.
    #[x_kube(
        validation = Rule::new("self == oldSelf").message("is immutable: delete the Proxy and create a new one to move it to another provider"),
        validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && size(self) <= 63").message("must name a provider instance: 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit")
    )]
    #[schemars(length(max = 63))]
    pub provider: String,

    /// Hints for where and how the provider places the proxy.
    #[serde(default)]
    pub placement: Placement,

    /// Cloud-init user-data for VM providers, taken from a labelled Secret.
    pub cloud_init: Option<CloudInit>,

    /// TCP port the proxy listens on.
    #[serde(default = "default_port")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("must be a TCP port between 1 and 65535"))]
    pub port: i32,

    /// Free-form labels crawlers select proxies by (for example `region: eu`, `tier: residential`).
    /// Keys follow Kubernetes label-key syntax.
    #[serde(default, skip_serializing_if = "Attributes::is_empty")]
    #[x_kube(
        validation = Rule::new(r"self.all(k, k.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$') && size(k) <= 317)").message("keys must look like label keys: an optional DNS prefix and '/', then 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"),
        validation = Rule::new("self.all(k, size(self[k]) <= 256)").message("values must be at most 256 characters")
    )]
    #[schemars(extend("maxProperties" = 64))]
    pub attributes: Attributes,

    /// How crawlers may lease this proxy.
    #[serde(default)]
    pub lease: LeasePolicy,

    /// How the operator checks the proxy's health (through the proxy).
    #[serde(default)]
    pub health: HealthCheck,

    /// Credentials the proxy requires from its clients (HTTP basic auth).
    pub auth: Option<ProxyAuth>,
}

impl Proxy {
    /// The Proxy's `namespace/name` key (an object without a namespace, which the API server
    /// never serves for this namespaced kind, keys under the empty namespace).
    pub fn key(&self) -> super::ProxyKey {
        super::ProxyKey::new(
            self.metadata.namespace.as_deref().unwrap_or_default(),
            self.metadata.name.as_deref().unwrap_or_default(),
        )
    }
}

fn default_port() -> i32 {
    3128
}

/// Placement hints; each provider documents which ones it honours.
#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Host (hypervisor or machine) to place the proxy on.
    #[schemars(length(max = 253))]
    pub host: Option<String>,
    /// Zone or rack to place the proxy in.
    #[schemars(length(max = 63))]
    pub zone: Option<String>,
    /// Address the proxy listens on (and is reached at), where the provider lets you choose.
    #[x_kube(validation = Rule::new("isIP(self)").message("must be an IPv4 or IPv6 address"))]
    #[schemars(length(max = 45))]
    pub address: Option<String>,
    /// Source address for the proxy's outgoing connections, for hosts with many addresses.
    #[x_kube(validation = Rule::new("isIP(self)").message("must be an IPv4 or IPv6 address"))]
    #[schemars(length(max = 45))]
    pub outgoing_address: Option<String>,
}

/// Cloud-init content for VM providers.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CloudInit {
    /// Secret (in the Proxy's namespace, labelled `crawl.example.com/cloud-init: "true"`)
    /// whose key holds the cloud-init user-data. Rotating its content replaces the instance.
    pub secret_ref: SecretKeyRef,
}

/// A key of a Secret in the Proxy's namespace.
#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("must name a Secret: a non-empty DNS subdomain (lowercase letters, digits, '-' and '.')"))]
    #[schemars(length(max = 253))]
    pub name: String,
    /// Key within the Secret; each field that takes a SecretKeyRef documents its default.
    #[x_kube(validation = Rule::new("self.matches('^[-._a-zA-Z0-9]+$')").message("must be a non-empty Secret key (letters, digits, '-', '_' or '.')"))]
    #[schemars(length(max = 253))]
    pub key: Option<String>,
}

impl SecretKeyRef {
    /// The key to read, falling back to `default_key` when none is set.
    pub fn key_or<'a>(&'a self, default_key: &'a str) -> &'a str {
        self.key.as_deref().unwrap_or(default_key)
    }
}

/// Lease limits for crawlers.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LeasePolicy {
    /// How many crawlers may hold a lease on this proxy at once.
    #[serde(default = "default_max_concurrent")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1000").message("must be between 1 and 1000"))]
    pub max_concurrent: i32,
    /// Seconds a proxy rests after a lease is released before it is leased again.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 86400").message("must be between 0 and 86400 (one day)"))]
    pub cooldown_seconds: i32,
    /// Longest lease a crawler may ask for, in seconds; longer requests are capped.
    #[serde(default = "default_max_ttl")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 86400").message("must be between 1 and 86400 (one day)"))]
    pub max_ttl_seconds: i32,
}

fn default_max_concurrent() -> i32 {
    1
}
fn default_max_ttl() -> i32 {
    3600
}

impl Default for LeasePolicy {
    fn default() -> Self {
        Self {
            max_concurrent: default_max_concurrent(),
            cooldown_seconds: 0,
            max_ttl_seconds: default_max_ttl(),
        }
    }
}

/// The health check, performed by fetching `url` through the proxy.
#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.timeoutSeconds < self.intervalSeconds").message("timeoutSeconds must be less than intervalSeconds: a probe has to finish before the next one starts"))]
pub struct HealthCheck {
    /// URL fetched through the proxy (http or https; https is tunnelled with CONNECT).
    #[serde(default = "default_health_url")]
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://')").message("must be an http:// or https:// URL"))]
    #[schemars(length(max = 2048))]
    pub url: String,
    /// Seconds between two probes.
    #[serde(default = "default_interval")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 3600").message("must be between 1 and 3600"))]
    pub interval_seconds: i32,
    /// Seconds a probe may take before it counts as failed.
    #[serde(default = "default_timeout")]
    #[x_kube(validation = Rule::new("self >= 1").message("must be at least 1"))]
    pub timeout_seconds: i32,
    /// Consecutive failed probes before the proxy is taken out of rotation.
    #[serde(default = "default_failure_threshold")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("must be between 1 and 100"))]
    pub failure_threshold: i32,
    /// Consecutive passed probes before the proxy is (back) in rotation.
    #[serde(default = "default_success_threshold")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("must be between 1 and 100"))]
    pub success_threshold: i32,
    /// If set, the probe passes only when the body of `url`'s response contains this address,
    /// proving traffic really leaves through the expected egress IP.
    #[x_kube(validation = Rule::new("isIP(self)").message("must be an IPv4 or IPv6 address"))]
    #[schemars(length(max = 45))]
    pub expected_egress_address: Option<String>,
}

fn default_health_url() -> String {
    "http://connectivitycheck.gstatic.com/generate_204".to_owned()
}
fn default_interval() -> i32 {
    30
}
fn default_timeout() -> i32 {
    5
}
fn default_failure_threshold() -> i32 {
    3
}
fn default_success_threshold() -> i32 {
    1
}

impl Default for HealthCheck {
    fn default() -> Self {
        Self {
            url: default_health_url(),
            interval_seconds: default_interval(),
            timeout_seconds: default_timeout(),
            failure_threshold: default_failure_threshold(),
            success_threshold: default_success_threshold(),
            expected_egress_address: None,
        }
    }
}

/// Proxy credentials (HTTP basic auth) from a Secret in the Proxy's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ProxyAuth {
    /// Secret holding `username` and `password` keys.
    pub secret_ref: ProxyAuthSecretRef,
}

/// The Secret holding proxy credentials.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ProxyAuthSecretRef {
    /// Name of the Secret; it must have the keys `username` and `password`.
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("must name a Secret: a non-empty DNS subdomain (lowercase letters, digits, '-' and '.')"))]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// Observed state, written only by the operator and only when something status-affecting
/// changed.
#[serde_with::skip_serializing_none]
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProxyStatus {
    /// Lifecycle phase (the state of the Proxy's state machine).
    pub phase: Option<String>,
    /// When the phase was entered.
    pub phase_since: Option<Time>,
    /// Consecutive failed provider calls (creates, deletes, instances that vanished while
    /// booting); reset once the proxy is healthy or its old instance is gone. Drives the backoff.
    pub retry_attempts: Option<i32>,
    /// When the next attempt after a failure may start (exponential backoff with jitter). Kept
    /// in the status so that neither a restart nor the operator's own writes shorten the wait.
    pub next_attempt_time: Option<Time>,
    /// `Ready`, `Provisioned`, `Healthy` and `SpecValid`, with bounded reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    pub observed_generation: Option<i64>,
    /// Hash of what the running instance was built from (placement, resolved cloud-init
    /// content, effective port).
    pub spec_hash: Option<String>,
    /// Self-contained provider ID of the running instance (`type/instance/native-id`).
    #[serde(rename = "providerID")]
    pub provider_id: Option<String>,
    /// `host:port` crawlers connect to.
    pub endpoint: Option<String>,
    /// When health last changed the status (not a heartbeat of every probe).
    pub last_health_check_time: Option<Time>,
    /// The last `crawl.example.com/recycle` request acted on (its annotation value): a
    /// different value asks for a fresh instance again.
    pub last_recycle: Option<String>,
}
