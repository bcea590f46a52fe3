//! Scenarios: one Proxy's lifecycle replayed through the **real reconciler** against a scripted
//! world, so an audit trail shows exactly what the operator would do — failures, timers, backoff,
//! budgets and crashes included. What `egress-proxies-operator audit FILE` prints.
//!
//! A scenario file (`machines/scenarios/*.yaml`) reads:
//!
//! ```yaml
//! name: create-fails-then-succeeds
//! description: The provider fails two creates; the operator backs off, then provisions.
//! config: {provisioning_timeout: 600}        # optional: timers in seconds, backoff, budgets
//! start: {phase: healthy}                     # optional: default a new Proxy; a live phase
//!                                             # starts with its instance running and passing
//! steps:
//!   - at: 0                                   # seconds since the start: the clock
//!     fail: {create_instance: {times: 2, kind: transient, message: "disk full"}}
//!   - {at: 10}                                # just time passing: the operator looks again
//!   - {at: 30, world: {health: passing}}
//!   - {at: 60, world: {spec: v2}, crash: true}  # effects run, the status write is lost
//! ```
//!
//! Each step changes the world as it says (`world`), scripts failures of the next calls of an
//! effect (`fail`: `create_instance` or `delete_instance`; `kind`: `transient`, `permanent`,
//! `rejected` or `unavailable`), then runs one reconcile at `at` and records what it did. With
//! `crash: true` the operator dies after the effects and before the status write: the next step
//! starts from the status as it was. The world (one provider, the health verdict, the leases, the
//! pool) is in memory; the reconciler, the table, the planner and the status are the real ones.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use async_trait::async_trait;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::Deserialize;

use super::{
    ProviderAvailability, Reconciler, ReconcilerConfig,
    pool::Budgets,
    status::{FINALIZER, Record},
};
use crate::{
    api::{Proxy, ProxySpec, ProxyStatus, SecretKeyRef},
    effects::{
        BackendError, DrainStatus, HealthControl, HealthTarget, HealthVerdict, LeaseControl, LeaseTarget,
        ProxyBackend, ProxyKey, SecretError,
    },
    machine::{AuditEntry, Phase, audit},
    provider::{
        Credentials, CredentialsUpdate, Endpoint, Installation, Instance, InstanceRequest, InstanceState,
        ProbeReport, Provider, ProviderError, ProviderId, ProviderRegistry, UserData,
    },
};

/// The instant scenario time 0 maps to (any fixed instant would do; output shows offsets).
pub const EPOCH: Timestamp = Timestamp::constant(1_735_689_600, 0); // 2025-01-01T00:00:00Z

/// The provider instance scenarios run on.
const PROVIDER: &str = "sim";

/// Why a scenario cannot be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file cannot be read.
    #[error("cannot read scenario {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid scenario document.
    #[error("invalid scenario {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_norway::Error,
    },
    /// The document parses but says something impossible.
    #[error("invalid scenario {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The reconciler failed (an invariant broke).
    #[error("scenario {name}, step at +{at}s: reconcile failed: {message}")]
    Reconcile {
        /// The scenario.
        name: String,
        /// The step's time.
        at: u64,
        /// The error.
        message: String,
    },
}

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
}

/// The start of a scenario.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Start {
    /// A phase to start in (entered at time 0); default: a new Proxy.
    pub phase: Option<String>,
    /// Active leases at the start.
    #[serde(default)]
    pub leases: u32,
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
    pub leases: Option<u32>,
    /// A new spec (its label stands for its hash): the placement, cloud-init or port changed.
    pub spec: Option<String>,
    /// The spec cannot be realised (the text says why); an empty text: it can again.
    pub spec_problem: Option<String>,
    /// The Proxy is deleted.
    #[serde(default)]
    pub deleted: bool,
    /// The proxy credentials Secret is rotated (the label stands for the new password).
    pub credentials: Option<String>,
    /// `running`, `starting` or `vanished` (deleted behind the operator's back).
    pub instance: Option<String>,
    /// Someone removed the finalizer.
    #[serde(default)]
    pub finalizer_removed: bool,
    /// The rest of the pool: `{size: 19, degraded: 8, unavailable: 0}` (members besides this one).
    pub pool: Option<PoolChange>,
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
        let scenario: Scenario = serde_norway::from_str(text).map_err(|source| ScenarioError::Parse {
            path: path.to_owned(),
            source,
        })?;
        scenario.check(path)?;
        Ok(scenario)
    }

    /// Read and parse a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.to_owned(),
            source,
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

    fn reconciler_config(&self) -> ReconcilerConfig {
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

    /// Replays the scenario through the reconciler, the Proxy object kept in memory.
    pub async fn replay(&self) -> Result<Replay, ScenarioError> {
        self.replay_in(&InMemory::default()).await
    }

    /// Replays the scenario through the reconciler with the Proxy object kept by `objects`: a
    /// mode's own store and backend. Every step reads the Proxy back as that mode serves it.
    pub async fn replay_in<O: ProxyObjects>(&self, objects: &O) -> Result<Replay, ScenarioError> {
        let world = Arc::new(World::default());
        let clock = world.clone();
        // The provider-health monitor's view: a step that takes the provider down tells it too.
        let availability = ProviderAvailability::default();
        let reconciler = Reconciler::new(
            ScriptedBackend {
                world: world.clone(),
                mode: objects.backend(),
            },
            ProviderRegistry::new().with(SimProvider(world.clone(), Installation::default())),
            Arc::new(SimLeases(world.clone())),
            Arc::new(SimHealth(world.clone())),
            availability.clone(),
            self.reconciler_config(),
        )
        .with_clock(move || clock.now());
        world.lock().slow_boot = self.config.slow_boot;
        world.lock().slow_delete = self.config.slow_delete;
        world.lock().credentials_in_place = self.config.credentials_in_place;
        let step_failed = |at: u64, err: BackendError| ScenarioError::Reconcile {
            name: self.name.clone(),
            at,
            message: format!("the Proxy's store failed: {err}"),
        };
        let mut proxy = sim_proxy();
        let mut deleted_at_start = false;
        if let Some(phase) = self.start.phase.as_deref().and_then(Phase::from_name) {
            let mut record = Record::new(EPOCH);
            record.state = crate::machine::State::new(phase, EPOCH);
            let mut w = world.lock();
            w.leases = self.start.leases;
            if !matches!(phase, Phase::Pending | Phase::Deleted) {
                let hash = super::spec_hash::for_spec(&proxy.spec, Some(USER_DATA));
                w.instance = Some(SimInstance {
                    spec: hash.clone(),
                    running: true,
                });
                record.spec_hash = Some(hash);
                record.provider_id = Some(format!("sim/{PROVIDER}/{INSTANCE}"));
                record.endpoint = Some("127.0.0.1:3128".to_owned());
                record.instance_running = true;
                proxy.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
            }
            if matches!(phase, Phase::Healthy) {
                w.health = HealthVerdict::Passing;
            }
            if matches!(phase, Phase::Degraded) {
                w.health = HealthVerdict::Failing;
            }
            deleted_at_start = matches!(phase, Phase::Deleting);
            proxy.status = Some(record.to_status(&ProxyStatus::default(), Some(1), EPOCH));
        }
        objects.create(&proxy).await.map_err(|e| step_failed(0, e))?;
        if deleted_at_start {
            objects.delete().await.map_err(|e| step_failed(0, e))?;
        }
        let mut steps = Vec::new();
        let mut status = proxy.status.clone();
        for step in &self.steps {
            let at = EPOCH
                .checked_add(jiff::SignedDuration::from_secs(
                    i64::try_from(step.at).unwrap_or(i64::MAX),
                ))
                .unwrap_or(Timestamp::MAX);
            let (changes, edits) = world.apply(step, at, reconciler.pools());
            if edits.new_spec
                && let Some(mut current) = objects.get().await.map_err(|e| step_failed(step.at, e))?
            {
                // A new port stands for any change of what runs (placement, cloud-init, port).
                current.spec.port += 1;
                objects
                    .edit_spec(&current.spec)
                    .await
                    .map_err(|e| step_failed(step.at, e))?;
            }
            if edits.strip_finalizers {
                objects
                    .strip_finalizers()
                    .await
                    .map_err(|e| step_failed(step.at, e))?;
            }
            if edits.delete {
                objects.delete().await.map_err(|e| step_failed(step.at, e))?;
            }
            if let Some(provider) = &step.world.provider {
                availability.set(
                    PROVIDER,
                    (provider == "down").then(|| "the provider is down".to_owned()),
                );
            }
            let Some(current) = objects.get().await.map_err(|e| step_failed(step.at, e))? else {
                // Deleted with no finalizer to hold it: gone without the operator's help.
                let mut changes = changes;
                changes.push("no finalizer holds the Proxy: it is gone".to_owned());
                steps.push(ReplayedStep {
                    at: step.at,
                    changes,
                    crashed: false,
                    audit: Vec::new(),
                    plans: Vec::new(),
                    written: None,
                    phase: Phase::Deleted,
                    wake: None,
                });
                break;
            };
            world.lock().crashing = step.crash;
            let outcome = reconciler
                .reconcile(&current)
                .await
                .map_err(|err| ScenarioError::Reconcile {
                    name: self.name.clone(),
                    at: step.at,
                    message: err.to_string(),
                })?;
            let written = world.lock().written.take();
            match objects.get().await.map_err(|e| step_failed(step.at, e))? {
                Some(stored) => status = stored.status,
                // Gone (deleted): its last status is the last one written.
                None if !step.crash => status = written.clone().or(status),
                None => {}
            }
            steps.push(ReplayedStep {
                at: step.at,
                changes,
                crashed: step.crash,
                audit: outcome.audit,
                plans: outcome.plans,
                written,
                phase: outcome.phase.unwrap_or(Phase::INITIAL),
                wake: outcome.requeue_after,
            });
            if outcome.phase == Some(Phase::Deleted) {
                break;
            }
        }
        Ok(Replay {
            name: self.name.clone(),
            description: self.description.clone(),
            steps,
            status,
            creates: world.lock().creates,
        })
    }
}

/// The scenario files (`*.yaml`) in `dir`, sorted by name.
pub fn scenario_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Replay the scenario file at `path` and render its trail (what `egress-proxies-operator audit` prints).
pub async fn replay_file(path: &Path) -> Result<String, ScenarioError> {
    Ok(Scenario::load(path)?.replay().await?.render())
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct ReplayedStep {
    /// Seconds since the start.
    pub at: u64,
    /// The world changes and failures of the step, as text.
    pub changes: Vec<String>,
    /// The status write was lost to a crash.
    pub crashed: bool,
    /// The transitions.
    pub audit: Vec<AuditEntry>,
    /// The plan of each transition (its effects with their parameters).
    pub plans: Vec<super::plan::Plan>,
    /// The status the reconcile wrote (even if a crash lost it), if it wrote one.
    pub written: Option<ProxyStatus>,
    /// The phase after the reconcile.
    pub phase: Phase,
    /// When the reconciler asked to look again.
    pub wake: Option<Duration>,
}

/// A replayed scenario.
#[derive(Clone, Debug)]
pub struct Replay {
    /// Scenario name.
    pub name: String,
    /// Scenario description.
    pub description: String,
    /// Every step.
    pub steps: Vec<ReplayedStep>,
    /// The Proxy's status at the end.
    pub status: Option<ProxyStatus>,
    /// Create calls the provider received.
    pub creates: u32,
}

impl Replay {
    /// Every transition, in order.
    pub fn audit(&self) -> impl Iterator<Item = &AuditEntry> {
        self.steps.iter().flat_map(|s| &s.audit)
    }

    /// The phase at the end.
    pub fn end(&self) -> Phase {
        self.steps.last().map_or(Phase::INITIAL, |s| s.phase)
    }

    /// A readable trail: per step, what changed, then each transition with its effects, reason
    /// and cause, then the phase and when the operator looks again.
    pub fn render(&self) -> String {
        let mut out = format!("scenario: {}\n", self.name);
        if !self.description.is_empty() {
            out.push_str(&format!("  {}\n", self.description.trim()));
        }
        for step in &self.steps {
            let at = audit::format_offset(i64::try_from(step.at).unwrap_or(i64::MAX));
            let changes = if step.changes.is_empty() {
                "time passes".to_owned()
            } else {
                step.changes.join("; ")
            };
            out.push_str(&format!("\n{at}  {changes}\n"));
            if step.audit.is_empty() {
                out.push_str("      (no transition)\n");
            }
            let lines: Vec<audit::Line> = step
                .audit
                .iter()
                .map(|e| audit::Line {
                    offset: "     ".to_owned(),
                    arrow: e.arrow(),
                    effects: audit::format_effects(&e.effects),
                    reason: format!("({})", e.reason),
                    cause: e.cause.clone(),
                })
                .collect();
            out.push_str(&audit::render_lines(&lines));
            for retry in step
                .plans
                .iter()
                .flat_map(|p| &p.effects)
                .filter_map(|e| match e {
                    super::plan::Planned::ScheduleRetry {
                        attempts,
                        next_attempt,
                    } => Some((attempts, next_attempt)),
                    _ => None,
                })
            {
                out.push_str(&format!(
                    "      retry: attempt {}, next at {}\n",
                    retry.0,
                    offset(*retry.1)
                ));
            }
            if let Some(status) = &step.written {
                out.push_str(&format!("      status written: {}\n", summary(status)));
            }
            let wake = match step.wake {
                Some(d) => format!(
                    "looks again in {}",
                    audit::format_offset(i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
                        .trim_start_matches('+')
                ),
                None => "waits for a change".to_owned(),
            };
            let crash = if step.crashed {
                "  CRASH: the status write is lost"
            } else {
                ""
            };
            out.push_str(&format!("      => {}; {wake}{crash}\n", step.phase));
        }
        out.push_str(&format!("\nend: {}\n", self.end()));
        out
    }
}

/// A time as an offset from the scenario start.
fn offset(at: Timestamp) -> String {
    audit::format_offset(at.duration_since(EPOCH).as_secs())
}

/// The status fields a trail shows: phase, Ready, SpecValid, Provisioned, the retry state.
fn summary(status: &ProxyStatus) -> String {
    let condition = |type_: &str| status.conditions.iter().find(|c| c.type_ == type_);
    let mut parts = vec![format!("phase={}", status.phase.as_deref().unwrap_or("-"))];
    if let Some(ready) = condition(super::status::READY) {
        parts.push(format!("Ready={}/{}", ready.status, ready.reason));
    }
    for type_ in [
        super::status::PROVISIONED,
        super::status::SPEC_VALID,
        super::status::REMEDIATION_PAUSED,
    ] {
        if let Some(c) = condition(type_)
            && (c.status != "True" || type_ == super::status::REMEDIATION_PAUSED)
        {
            parts.push(format!("{type_}={}", c.status));
        }
    }
    if let Some(attempts) = status.retry_attempts {
        parts.push(format!("retryAttempts={attempts}"));
    }
    if let Some(next) = &status.next_attempt_time {
        parts.push(format!("nextAttemptTime={}", offset(next.0)));
    }
    parts.join(" ")
}

// ---- the scripted world ---------------------------------------------------------------------

const INSTANCE: &str = "epo-sim-proxy";
/// The cloud-init content of the scenario Proxy's Secret (it only feeds the spec hash).
const USER_DATA: &str = "#cloud-config";

#[derive(Clone, Debug)]
struct SimInstance {
    spec: String,
    running: bool,
}

#[derive(Debug)]
struct WorldState {
    now: Timestamp,
    spec: String,
    spec_problem: Option<String>,
    instance: Option<SimInstance>,
    slow_boot: bool,
    slow_delete: bool,
    credentials_in_place: bool,
    credentials: String,
    health: HealthVerdict,
    leases: u32,
    provider_down: bool,
    /// This step's reconcile dies before its status write.
    crashing: bool,
    failures: HashMap<&'static str, Failure>,
    written: Option<ProxyStatus>,
    creates: u32,
}

impl Default for WorldState {
    fn default() -> Self {
        WorldState {
            now: EPOCH,
            spec: "v1".to_owned(),
            spec_problem: None,
            instance: None,
            slow_boot: false,
            slow_delete: false,
            credentials_in_place: false,
            credentials: "v1".to_owned(),
            health: HealthVerdict::Unknown,
            leases: 0,
            provider_down: false,
            crashing: false,
            failures: HashMap::new(),
            written: None,
            creates: 0,
        }
    }
}

#[derive(Debug, Default)]
struct World(Mutex<WorldState>);

impl World {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now(&self) -> Timestamp {
        self.lock().now
    }

    /// Applies a step's changes to the world; returns them as text for the trail, and the
    /// edits of the Proxy object for the caller to make.
    fn apply(&self, step: &SimStep, at: Timestamp, pools: &super::pool::Pools) -> (Vec<String>, ObjectEdits) {
        let mut edits = ObjectEdits::default();
        let mut w = self.lock();
        w.now = at;
        let mut changes = Vec::new();
        let change = &step.world;
        if let Some(health) = &change.health {
            w.health = match health.as_str() {
                "passing" => HealthVerdict::Passing,
                "failing" => HealthVerdict::Failing,
                _ => HealthVerdict::Unknown,
            };
            changes.push(format!("health {health}"));
        }
        if let Some(provider) = &change.provider {
            w.provider_down = provider == "down";
            changes.push(format!("provider {provider}"));
        }
        if let Some(leases) = change.leases {
            w.leases = leases;
            changes.push(format!("{leases} active lease(s)"));
        }
        if let Some(spec) = &change.spec {
            w.spec = spec.clone();
            edits.new_spec = true;
            changes.push(format!("spec changed to {spec}"));
        }
        if let Some(problem) = &change.spec_problem {
            w.spec_problem = (!problem.is_empty()).then(|| problem.clone());
            changes.push(if problem.is_empty() {
                "spec fixed".to_owned()
            } else {
                format!("spec broken: {problem}")
            });
        }
        if change.deleted {
            edits.delete = true;
            changes.push("Proxy deleted".to_owned());
        }
        if let Some(credentials) = &change.credentials {
            w.credentials = credentials.clone();
            changes.push(format!("credentials rotated to {credentials}"));
        }
        match change.instance.as_deref() {
            Some("vanished") => {
                w.instance = None;
                w.health = HealthVerdict::Unknown;
                changes.push("instance vanished".to_owned());
            }
            Some(state @ ("running" | "starting")) => {
                let running = state == "running";
                if let Some(instance) = &mut w.instance {
                    instance.running = running;
                }
                changes.push(format!("instance {state}"));
            }
            _ => {}
        }
        if change.finalizer_removed {
            edits.strip_finalizers = true;
            changes.push("finalizer removed".to_owned());
        }
        if let Some(pool) = change.pool {
            let others = (0..pool.size).map(|i| {
                let phase = if i < pool.degraded {
                    Phase::Degraded
                } else if i < pool.degraded + pool.unavailable {
                    Phase::Replacing
                } else {
                    Phase::Healthy
                };
                let key = ProxyKey::new("sim", &format!("peer-{i}"));
                (key, phase)
            });
            for (key, phase) in others {
                pools.set(&key, PROVIDER, phase);
            }
            changes.push(format!(
                "pool: {} others, {} degraded, {} unavailable",
                pool.size, pool.degraded, pool.unavailable
            ));
        }
        for (effect, failure) in &step.fail {
            let effect: &'static str = match effect.as_str() {
                "create_instance" => "create_instance",
                "update_credentials" => "update_credentials",
                _ => "delete_instance",
            };
            changes.push(format!("next {} {effect} fail ({})", failure.times, failure.kind));
            w.failures.insert(effect, failure.clone());
        }
        if step.crash {
            changes.push("the operator crashes before writing the status".to_owned());
        }
        (changes, edits)
    }

    fn fail(&self, effect: &'static str) -> Option<ProviderError> {
        let mut w = self.lock();
        let failure = w.failures.get_mut(effect)?;
        if failure.times == 0 {
            return None;
        }
        failure.times -= 1;
        let message = failure.message.clone();
        Some(match failure.kind.as_str() {
            "permanent" => ProviderError::Misconfigured(message),
            "rejected" => ProviderError::Rejected(message),
            "unavailable" => ProviderError::Unavailable(message),
            _ => ProviderError::Backend(message),
        })
    }
}

/// What a step does to the Proxy object (as a user or another controller would).
#[derive(Debug, Default)]
struct ObjectEdits {
    new_spec: bool,
    delete: bool,
    strip_finalizers: bool,
}

fn sim_proxy() -> Proxy {
    let spec: ProxySpec = serde_json::from_value(serde_json::json!({
        "provider": PROVIDER,
        "cloudInit": {"secretRef": {"name": "sim-cloud-init"}},
        "auth": {"secretRef": {"name": "sim-auth"}},
    }))
    .unwrap_or_else(|err| unreachable!("a literal minimal spec parses: {err}"));
    Proxy {
        metadata: ObjectMeta {
            name: Some("proxy".to_owned()),
            namespace: Some("sim".to_owned()),
            uid: Some("00000000-0000-0000-0000-000000000001".to_owned()),
            generation: Some(1),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// Where a scenario's Proxy object lives: a mode's own store, and the backend that mode's
/// reconciler writes the finalizer, the status and the audit trail through. The scenario world
/// scripts the rest (provider, health, leases, Secrets). Implemented in memory here, and over
/// the embedded store and the API server by `tests/scenario_modes.rs`.
#[async_trait]
pub trait ProxyObjects: Send + Sync {
    /// The mode's backend.
    type Backend: ProxyBackend + 'static;
    /// A backend over this store.
    fn backend(&self) -> Self::Backend;
    /// Stores the scenario's Proxy (with its finalizers and status) as a new object.
    async fn create(&self, proxy: &Proxy) -> Result<(), BackendError>;
    /// The Proxy as the mode serves it now; `None` once it is gone.
    async fn get(&self) -> Result<Option<Proxy>, BackendError>;
    /// A user's edit of the spec (the generation moves).
    async fn edit_spec(&self, spec: &ProxySpec) -> Result<(), BackendError>;
    /// A user's delete (the finalizer holds the object).
    async fn delete(&self) -> Result<(), BackendError>;
    /// Someone removes every finalizer behind the operator's back.
    async fn strip_finalizers(&self) -> Result<(), BackendError>;
}

/// The Proxy object in memory, served as an API server would.
#[derive(Clone, Default)]
pub struct InMemory(Arc<Mutex<Option<Proxy>>>);

impl InMemory {
    fn edit(&self, change: impl FnOnce(&mut Proxy)) -> Result<(), BackendError> {
        let mut object = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let proxy = object
            .as_mut()
            .ok_or_else(|| BackendError::Gone("proxy".to_owned()))?;
        change(proxy);
        // Like the API server: a deleted object without finalizers is gone.
        if proxy.metadata.deletion_timestamp.is_some()
            && proxy.metadata.finalizers.as_ref().is_none_or(Vec::is_empty)
        {
            *object = None;
        }
        Ok(())
    }
}

#[async_trait]
impl ProxyObjects for InMemory {
    type Backend = InMemory;
    fn backend(&self) -> InMemory {
        self.clone()
    }
    async fn create(&self, proxy: &Proxy) -> Result<(), BackendError> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(proxy.clone());
        Ok(())
    }
    async fn get(&self) -> Result<Option<Proxy>, BackendError> {
        Ok(self.0.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }
    async fn edit_spec(&self, spec: &ProxySpec) -> Result<(), BackendError> {
        self.edit(|proxy| {
            proxy.spec = spec.clone();
            proxy.metadata.generation = proxy.metadata.generation.map(|g| g + 1);
        })
    }
    async fn delete(&self) -> Result<(), BackendError> {
        // Like the API server: marking an object deleted moves its generation.
        self.edit(|proxy| {
            proxy.metadata.deletion_timestamp = Some(Time(EPOCH));
            proxy.metadata.generation = proxy.metadata.generation.map(|g| g + 1);
        })
    }
    async fn strip_finalizers(&self) -> Result<(), BackendError> {
        self.edit(|proxy| proxy.metadata.finalizers = None)
    }
}

#[async_trait]
impl ProxyBackend for InMemory {
    async fn cloud_init(&self, _: &str, _: &SecretKeyRef) -> Result<UserData, SecretError> {
        Err(SecretError::NotUsable(
            "Secrets come from the scenario's script".to_owned(),
        ))
    }
    async fn credentials(&self, _: &str, _: &str) -> Result<Credentials, SecretError> {
        Err(SecretError::NotUsable(
            "Secrets come from the scenario's script".to_owned(),
        ))
    }
    async fn add_finalizer(&self, _: &Proxy) -> Result<Option<String>, BackendError> {
        self.edit(|proxy| proxy.metadata.finalizers = Some(vec![FINALIZER.to_owned()]))
            .map(|()| None)
    }
    async fn remove_finalizer(&self, _: &Proxy) -> Result<(), BackendError> {
        self.edit(|proxy| proxy.metadata.finalizers = None)
    }
    async fn write_status(&self, _: &Proxy, status: &ProxyStatus) -> Result<(), BackendError> {
        self.edit(|proxy| proxy.status = Some(status.clone()))
    }
    async fn record(&self, _: &Proxy, _: &AuditEntry, _: &str) -> Result<(), BackendError> {
        Ok(())
    }
}

/// The reconciler's backend in a scenario: Secrets from the world's script; finalizer, status and
/// audit writes through the mode's backend, each status write recorded, and lost when the step
/// crashes.
struct ScriptedBackend<B> {
    world: Arc<World>,
    mode: B,
}

#[async_trait]
impl<B: ProxyBackend> ProxyBackend for ScriptedBackend<B> {
    async fn cloud_init(&self, _: &str, _: &SecretKeyRef) -> Result<UserData, SecretError> {
        match &self.world.lock().spec_problem {
            Some(problem) => Err(SecretError::NotUsable(problem.clone())),
            None => Ok(UserData(USER_DATA.to_owned())),
        }
    }
    async fn credentials(&self, _: &str, _: &str) -> Result<Credentials, SecretError> {
        Ok(Credentials {
            username: "crawler".to_owned(),
            password: self.world.lock().credentials.clone(),
        })
    }
    async fn add_finalizer(&self, proxy: &Proxy) -> Result<Option<String>, BackendError> {
        self.mode.add_finalizer(proxy).await
    }
    async fn remove_finalizer(&self, proxy: &Proxy) -> Result<(), BackendError> {
        self.mode.remove_finalizer(proxy).await
    }
    async fn write_status(&self, proxy: &Proxy, status: &ProxyStatus) -> Result<(), BackendError> {
        let crashing = {
            let mut w = self.world.lock();
            w.written = Some(status.clone());
            w.crashing
        };
        if crashing {
            return Ok(());
        }
        self.mode.write_status(proxy, status).await
    }
    async fn record(&self, proxy: &Proxy, entry: &AuditEntry, message: &str) -> Result<(), BackendError> {
        self.mode.record(proxy, entry, message).await
    }
}

struct SimProvider(Arc<World>, Installation);

impl SimProvider {
    fn instance(instance: &SimInstance) -> Instance {
        Instance {
            id: ProviderId::new("sim", PROVIDER, INSTANCE),
            owner: None,
            installation: None,
            spec_hash: Some(instance.spec.clone()),
            created_at: EPOCH,
            state: if instance.running {
                InstanceState::Running
            } else {
                InstanceState::Starting
            },
            endpoint: Some(Endpoint {
                host: "127.0.0.1".to_owned(),
                port: 3128,
            }),
        }
    }
}

#[async_trait]
impl Provider for SimProvider {
    fn provider_type(&self) -> &'static str {
        "sim"
    }
    fn instance(&self) -> &str {
        PROVIDER
    }
    fn installation(&self) -> &Installation {
        &self.1
    }
    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        self.get(name).await
    }
    fn updates_credentials_in_place(&self) -> bool {
        self.0.lock().credentials_in_place
    }
    async fn update_credentials(
        &self,
        _: &str,
        _: Option<&Credentials>,
    ) -> Result<CredentialsUpdate, ProviderError> {
        if let Some(err) = self.0.fail("update_credentials") {
            return Err(err);
        }
        Ok(if self.0.lock().credentials_in_place {
            CredentialsUpdate::Applied
        } else {
            CredentialsUpdate::Unsupported
        })
    }
    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError> {
        self.0.lock().creates += 1;
        if let Some(err) = self.0.fail("create_instance") {
            return Err(err);
        }
        let mut w = self.0.lock();
        if w.provider_down {
            return Err(ProviderError::Unavailable("the provider is down".to_owned()));
        }
        let slow = w.slow_boot;
        let instance = w.instance.get_or_insert_with(|| SimInstance {
            spec: request.spec_hash.clone(),
            running: !slow,
        });
        Ok(Self::instance(instance))
    }
    async fn get(&self, _: &str) -> Result<Instance, ProviderError> {
        let w = self.0.lock();
        if w.provider_down {
            return Err(ProviderError::Unavailable("the provider is down".to_owned()));
        }
        w.instance
            .as_ref()
            .map(Self::instance)
            .ok_or_else(|| ProviderError::NotFound(INSTANCE.to_owned()))
    }
    async fn delete(&self, _: &str) -> Result<(), ProviderError> {
        if let Some(err) = self.0.fail("delete_instance") {
            return Err(err);
        }
        let mut w = self.0.lock();
        if w.slow_delete {
            if let Some(instance) = &mut w.instance {
                instance.running = false;
            }
        } else {
            w.instance = None;
        }
        w.health = HealthVerdict::Unknown;
        Ok(())
    }
    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        Ok(self.0.lock().instance.iter().map(Self::instance).collect())
    }
    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        Ok(ProbeReport {
            instance_count: usize::from(self.0.lock().instance.is_some()),
            detail: "simulated".to_owned(),
        })
    }
}

struct SimLeases(Arc<World>);

impl LeaseControl for SimLeases {
    fn upsert(&self, _: LeaseTarget) {}
    fn set_admission(&self, _: &ProxyKey, _: bool) {}
    fn drain(&self, _: &ProxyKey) -> DrainStatus {
        match self.0.lock().leases {
            0 => DrainStatus::Drained,
            active => DrainStatus::Pending {
                active: active as usize,
            },
        }
    }
    fn revoke_all(&self, _: &ProxyKey) -> usize {
        std::mem::take(&mut self.0.lock().leases) as usize
    }
    fn remove(&self, _: &ProxyKey) {}
    fn active(&self, _: &ProxyKey) -> usize {
        self.0.lock().leases as usize
    }
}

struct SimHealth(Arc<World>);

impl HealthControl for SimHealth {
    fn upsert(&self, _: HealthTarget) {}
    fn remove(&self, _: &ProxyKey) {}
    fn verdict(&self, _: &ProxyKey) -> HealthVerdict {
        let w = self.0.lock();
        if w.instance.as_ref().is_some_and(|i| i.running) {
            w.health
        } else {
            HealthVerdict::Unknown
        }
    }
}
