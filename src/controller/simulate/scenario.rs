//! The scenario document (`machines/scenarios/*.yaml`): its types, parsing, the checks that give a
//! user a clear error, and the reconciler configuration it asks for.

use std::{collections::BTreeMap, path::Path, time::Duration};

use serde::Deserialize;

use super::ScenarioError;
use crate::controller::{ReconcilerConfig, pool::Budgets};
use crate::machine::Phase;

/// A scenario document.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name.
    pub name: String,
    /// What the scenario shows.
    #[serde(default)]
    pub description: String,
    /// Timers, backoff and budgets (defaults: the operator's).
    #[serde(default)]
    pub config: SimConfig,
    /// Where the Proxy starts.
    #[serde(default)]
    pub start: Start,
    /// Steps in time order.
    pub steps: Vec<SimStep>,
    /// What the replay must show (checked by `tests/machine_scenarios.rs`).
    #[serde(default)]
    pub expect: Expect,
}

/// What a replay must show.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// The phase at the end.
    pub end: Option<String>,
    /// Exactly this many create calls reached the provider.
    pub creates: Option<u32>,
}

/// Configuration overrides, in seconds and percent.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// `provisioning_timeout`.
    pub provisioning_timeout: Option<u64>,
    /// `degraded_timeout`.
    pub degraded_timeout: Option<u64>,
    /// `drain_timeout`.
    pub drain_timeout: Option<u64>,
    /// First retry delay.
    pub backoff_initial: Option<u64>,
    /// Longest retry delay.
    pub backoff_cap: Option<u64>,
    /// `maxUnavailable` in percent.
    pub max_unavailable_percent: Option<u32>,
    /// `maxUnhealthy` in percent.
    pub max_unhealthy_percent: Option<u32>,
    /// New instances boot slowly: they start `starting` and run once a step says `instance: running`.
    #[serde(default)]
    pub slow_boot: bool,
    /// Deletes are slow: the provider accepts them, but the instance stays (terminating) until a
    /// step says `instance: vanished`.
    #[serde(default)]
    pub slow_delete: bool,
    /// The provider updates a running instance's credentials in place (like `local`); without
    /// it only a new instance carries new ones (like the VM providers).
    #[serde(default)]
    pub credentials_in_place: bool,
    /// Between steps (and for ten minutes after the last) the operator also reconciles when it
    /// asked to, as a runner would: each such reconcile is a step of its own ("wakes up").
    #[serde(default)]
    pub follow_wakeups: bool,
}

/// The start of a scenario.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Start {
    /// A phase to start in (entered at time 0); default: a new Proxy.
    pub phase: Option<String>,
    /// Active leases at the start.
    #[serde(default)]
    pub leases: usize,
    /// The provider instance the Proxy names (default `sim`, the one configured); any other
    /// name is unknown to the operator, as a typo or a provider removed from the config is.
    pub provider: Option<String>,
}

/// One step.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimStep {
    /// Seconds since the start.
    pub at: u64,
    /// What changes in the world before the reconcile.
    #[serde(default)]
    pub world: WorldChange,
    /// Failures of the next calls of an effect.
    #[serde(default)]
    pub fail: BTreeMap<String, Failure>,
    /// The operator dies after the effects, before the status write.
    #[serde(default)]
    pub crash: bool,
}

/// Changes to the world.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorldChange {
    /// `passing`, `failing` or `unknown`.
    pub health: Option<String>,
    /// `up` or `down`.
    pub provider: Option<String>,
    /// Active leases from now on.
    pub leases: Option<usize>,
    /// A new spec (its label stands for its hash): the placement, cloud-init or port changed.
    pub spec: Option<String>,
    /// The spec cannot be realised (the text says why); an empty text: it can again.
    pub spec_problem: Option<String>,
    /// The Proxy is deleted.
    #[serde(default)]
    pub deleted: bool,
    /// A fresh instance is asked for: the recycle annotation is set to this request.
    pub recycle: Option<String>,
    /// The proxy credentials Secret is rotated (the label stands for the new password).
    pub credentials: Option<String>,
    /// The cloud-init Secret's content is rotated (the label stands for the new content): the
    /// spec hash changes, the Proxy object (its generation) does not.
    pub cloud_init: Option<String>,
    /// Health probes through the proxy, in order (`pass` or `fail`): the verdict follows the
    /// Proxy's success and failure thresholds, as the health engine's does.
    #[serde(default)]
    pub probes: Vec<String>,
    /// A user's edit of what never changes the instance: attributes, lease limits, health
    /// settings (the generation moves, the spec hash does not).
    pub edit: Option<SpecEdit>,
    /// `running`, `starting` or `vanished` (deleted behind the operator's back).
    pub instance: Option<String>,
    /// Someone removed the finalizer.
    #[serde(default)]
    pub finalizer_removed: bool,
    /// The rest of the pool: `{size: 19, degraded: 8, unavailable: 0}` (members besides this one).
    pub pool: Option<PoolChange>,
}

/// An edit of the Proxy's attributes, lease limits or health settings.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecEdit {
    /// The attributes, replaced as a whole.
    pub attributes: Option<BTreeMap<String, String>>,
    /// `lease.maxConcurrent`.
    pub max_concurrent: Option<i32>,
    /// `lease.cooldownSeconds`.
    pub cooldown_seconds: Option<i32>,
    /// `health.successThreshold`.
    pub success_threshold: Option<i32>,
    /// `health.failureThreshold`.
    pub failure_threshold: Option<i32>,
    /// `health.intervalSeconds`.
    pub interval_seconds: Option<i32>,
}

impl SpecEdit {
    /// Applies the edit to `spec`.
    pub fn apply_to(&self, spec: &mut crate::api::ProxySpec) {
        if let Some(attributes) = &self.attributes {
            spec.attributes = attributes.clone().into();
        }
        if let Some(n) = self.max_concurrent {
            spec.lease.max_concurrent = n;
        }
        if let Some(n) = self.cooldown_seconds {
            spec.lease.cooldown_seconds = n;
        }
        if let Some(n) = self.success_threshold {
            spec.health.success_threshold = n;
        }
        if let Some(n) = self.failure_threshold {
            spec.health.failure_threshold = n;
        }
        if let Some(n) = self.interval_seconds {
            spec.health.interval_seconds = n;
        }
    }
}

/// The other members of the Proxy's pool.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolChange {
    /// How many other Proxies share the provider.
    pub size: u32,
    /// How many of them are degraded.
    #[serde(default)]
    pub degraded: u32,
    /// How many of them are unavailable (being replaced or provisioned).
    #[serde(default)]
    pub unavailable: u32,
}

/// Failures of an effect's next calls.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failure {
    /// How many calls fail.
    pub times: u32,
    /// `transient` (a backend error), `permanent` (misconfigured), `rejected` (this Proxy's
    /// request, e.g. its port is taken) or `unavailable`.
    pub kind: String,
    /// The error text.
    #[serde(default = "default_failure_message")]
    pub message: String,
}

fn default_failure_message() -> String {
    "scripted failure".to_owned()
}

impl Scenario {
    /// Parse a scenario document; `path` only labels errors.
    pub fn from_yaml(text: &str, path: &Path) -> Result<Scenario, ScenarioError> {
        let scenario: Scenario = serde_norway::from_str(text).map_err(|cause| ScenarioError::Parse {
            path: path.to_owned(),
            cause,
        })?;
        scenario.check(path)?;
        Ok(scenario)
    }

    /// Read and parse a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ScenarioError::Io {
            path: path.to_owned(),
            cause,
        })?;
        Scenario::from_yaml(&text, path)
    }

    fn check(&self, path: &Path) -> Result<(), ScenarioError> {
        let invalid = |message: String| ScenarioError::Invalid {
            path: path.to_owned(),
            message,
        };
        for (field, phase) in [
            ("start.phase", &self.start.phase),
            ("expect.end", &self.expect.end),
        ] {
            if let Some(phase) = phase
                && Phase::from_name(phase).is_none()
            {
                let known: Vec<&str> = Phase::ALL.iter().map(|p| p.as_str()).collect();
                return Err(invalid(format!(
                    "{field}: unknown phase `{phase}`; known phases: {}",
                    known.join(", ")
                )));
            }
        }
        let mut previous = 0;
        for (i, step) in self.steps.iter().enumerate() {
            let n = i + 1;
            if step.at < previous {
                return Err(invalid(format!(
                    "step {n}: at {}s is before the previous step's {previous}s",
                    step.at
                )));
            }
            previous = step.at;
            for (effect, failure) in &step.fail {
                if !matches!(
                    effect.as_str(),
                    "create_instance" | "delete_instance" | "update_credentials"
                ) {
                    return Err(invalid(format!(
                        "step {n}: `fail` names `{effect}`; only create_instance, delete_instance and update_credentials can fail"
                    )));
                }
                if !matches!(
                    failure.kind.as_str(),
                    "transient" | "permanent" | "rejected" | "unavailable"
                ) {
                    return Err(invalid(format!(
                        "step {n}: failure kind `{}`; use transient, permanent, rejected or unavailable",
                        failure.kind
                    )));
                }
            }
            let world = &step.world;
            if let Some(bad) = world
                .probes
                .iter()
                .find(|p| !matches!(p.as_str(), "pass" | "fail"))
            {
                return Err(invalid(format!(
                    "step {n}: world.probes `{bad}`; use pass or fail"
                )));
            }
            if world.health.is_some() && !world.probes.is_empty() {
                return Err(invalid(format!(
                    "step {n}: world.health and world.probes both set the verdict; use one"
                )));
            }
            for (field, value, allowed) in [
                ("health", &world.health, &["passing", "failing", "unknown"][..]),
                ("provider", &world.provider, &["up", "down"][..]),
                (
                    "instance",
                    &world.instance,
                    &["running", "starting", "vanished"][..],
                ),
            ] {
                if let Some(value) = value
                    && !allowed.contains(&value.as_str())
                {
                    return Err(invalid(format!(
                        "step {n}: world.{field} `{value}`; use {}",
                        allowed.join(", ")
                    )));
                }
            }
        }
        Ok(())
    }

    pub(super) fn reconciler_config(&self) -> ReconcilerConfig {
        let c = &self.config;
        let mut config = ReconcilerConfig::default();
        let secs = Duration::from_secs;
        if let Some(s) = c.provisioning_timeout {
            config.timers.provisioning_timeout = secs(s);
        }
        if let Some(s) = c.degraded_timeout {
            config.timers.degraded_timeout = secs(s);
        }
        if let Some(s) = c.drain_timeout {
            config.timers.drain_timeout = secs(s);
        }
        if let Some(s) = c.backoff_initial {
            config.backoff.initial = secs(s);
        }
        if let Some(s) = c.backoff_cap {
            config.backoff.cap = secs(s);
        }
        // Deterministic trails: no jitter in scenarios.
        config.backoff.jitter = 0.0;
        config.budgets = Budgets {
            max_unavailable_percent: c
                .max_unavailable_percent
                .unwrap_or(config.budgets.max_unavailable_percent),
            max_unhealthy_percent: c
                .max_unhealthy_percent
                .unwrap_or(config.budgets.max_unhealthy_percent),
        };
        config
    }
}
