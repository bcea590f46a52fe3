//! The scripted world of a scenario: one provider instance, the health verdict, the leases, the
//! pool and the failures a step scripts, with the adapters the real reconciler calls (provider,
//! health, leases, and the backend that takes Secrets from the script and loses crashed writes).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use async_trait::async_trait;
use jiff::Timestamp;

use super::{EPOCH, Failure, PROVIDER, SimConfig, SimStep};
use crate::{
    api::{Proxy, ProxyKey, ProxyStatus, SecretKeyRef},
    controller::pool::Pools,
    effects::{BackendError, ProxyBackend, SecretError},
    health::{HealthControl, HealthTarget, Verdict},
    lease::{DrainStatus, LeaseControl, LeaseTarget},
    machine::{AuditEntry, Phase},
    provider::{
        Credentials, CredentialsCheck, CredentialsUpdate, Endpoint, Installation, Instance, InstanceRequest,
        InstanceState, ProbeReport, Provider, ProviderError, ProviderId, UserData,
    },
};

pub(super) const INSTANCE: &str = "epo-sim-proxy";
/// What the scripted world looked like after a reconcile (what invariants are checked against).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorldView {
    /// The provider has an instance for the Proxy.
    pub instance: bool,
    /// The lease store admits new leases on the proxy.
    pub leases_admitted: bool,
    /// Active leases.
    pub leases_active: usize,
    /// The health verdict is passing.
    pub health_passing: bool,
    /// The Proxy object still exists (its finalizer holds it, or it is not deleted).
    pub object: bool,
}

/// The cloud-init content of the scenario Proxy's Secret (it only feeds the spec hash).
pub(super) const USER_DATA: &str = "#cloud-config";

#[derive(Clone, Debug)]
struct SimInstance {
    spec: String,
    running: bool,
    /// The password it accepts (the Secret's label it was last given).
    password: String,
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
    health: Verdict,
    leases: usize,
    provider_down: bool,
    /// This step's reconcile dies before its status write.
    crashing: bool,
    /// It has died: what it would do after the write does not happen.
    dead: bool,
    failures: HashMap<&'static str, Failure>,
    written: Option<ProxyStatus>,
    creates: u32,
    admitted: bool,
    /// The cloud-init Secret's content label (`None`: the initial content).
    cloud_init: Option<String>,
    /// Consecutive probe results, for the thresholds.
    successes: u32,
    probe_failures: u32,
    /// How the health engine was last told to judge probes (its thresholds decide the verdict).
    check: Option<Judging>,
    /// What the lease store was last given: attributes, maxConcurrent, cooldown.
    lease_target: Option<(String, i32, i32)>,
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
            health: Verdict::Unknown,
            leases: 0,
            provider_down: false,
            crashing: false,
            dead: false,
            failures: HashMap::new(),
            written: None,
            creates: 0,
            admitted: false,
            cloud_init: None,
            successes: 0,
            probe_failures: 0,
            check: None,
            lease_target: None,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct World(Mutex<WorldState>);

impl World {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        crate::sync::lock(&self.0)
    }

    pub(super) fn now(&self) -> Timestamp {
        self.lock().now
    }

    /// The provider's behaviour the scenario configures.
    pub(super) fn configure(&self, config: &SimConfig) {
        let mut w = self.lock();
        w.slow_boot = config.slow_boot;
        w.slow_delete = config.slow_delete;
        w.credentials_in_place = config.credentials_in_place;
    }

    /// A scenario that starts in `phase`: its leases, its instance (built from `spec_hash`, running)
    /// and the health verdict that phase implies.
    pub(super) fn start_in(&self, phase: Phase, leases: usize, spec_hash: Option<String>) {
        let mut w = self.lock();
        w.leases = leases;
        if let Some(spec) = spec_hash {
            let password = w.credentials.clone();
            w.instance = Some(SimInstance {
                spec,
                running: true,
                password,
            });
        }
        match phase {
            Phase::Healthy => w.health = Verdict::Passing,
            Phase::Degraded => w.health = Verdict::Failing,
            _ => {}
        }
    }

    /// The health check probes are judged by (until the health engine is given one).
    pub(super) fn set_check(&self, check: &crate::api::HealthCheck) {
        let threshold = |n: i32| u32::try_from(n).unwrap_or(1);
        self.lock().check = Some(Judging {
            interval_seconds: i64::from(check.interval_seconds),
            success_threshold: threshold(check.success_threshold),
            failure_threshold: threshold(check.failure_threshold),
        });
    }

    /// The clock moves to `at` (the operator wakes up by itself; nothing else changes).
    pub(super) fn set_now(&self, at: Timestamp) {
        self.lock().now = at;
    }

    /// What the invariants are checked against, after a reconcile.
    pub(super) fn snapshot(&self, object: bool) -> WorldView {
        let w = self.lock();
        WorldView {
            instance: w.instance.is_some(),
            leases_admitted: w.admitted,
            leases_active: w.leases,
            health_passing: w.health == Verdict::Passing && w.instance.as_ref().is_some_and(|i| i.running),
            object,
        }
    }

    /// What the lease store and the health engine were last given, as text for the trail.
    pub(super) fn targets(&self) -> String {
        let w = self.lock();
        let leases = w.lease_target.as_ref().map_or_else(
            || "lease store: not registered".to_owned(),
            |(attributes, max, cooldown)| {
                format!(
                    "lease store: attributes {{{attributes}}}, maxConcurrent {max}, cooldown {cooldown} s"
                )
            },
        );
        let health = w.check.as_ref().map_or_else(
            || "health engine: not probing".to_owned(),
            |c| {
                format!(
                    "health engine: every {} s, {} passes to pass, {} failures to fail",
                    c.interval_seconds, c.success_threshold, c.failure_threshold
                )
            },
        );
        format!("{leases}; {health}")
    }

    /// Whether this step's reconcile dies before its status write.
    pub(super) fn set_crashing(&self, crashing: bool) {
        let mut w = self.lock();
        w.crashing = crashing;
        w.dead = false;
    }

    /// The status the last reconcile wrote (even if a crash lost it), once.
    pub(super) fn take_written(&self) -> Option<ProxyStatus> {
        self.lock().written.take()
    }

    /// Create calls the provider received.
    pub(super) fn creates(&self) -> u32 {
        self.lock().creates
    }

    /// Applies a step's changes to the world; returns them as text for the trail, and the
    /// edits of the Proxy object for the caller to make.
    pub(super) fn apply(&self, step: &SimStep, at: Timestamp, pools: &Pools) -> (Vec<String>, ObjectEdits) {
        let mut edits = ObjectEdits::default();
        let mut w = self.lock();
        w.now = at;
        let mut changes = Vec::new();
        let change = &step.world;
        if let Some(health) = &change.health {
            w.health = match health.as_str() {
                "passing" => Verdict::Passing,
                "failing" => Verdict::Failing,
                _ => Verdict::Unknown,
            };
            // A verdict set outright starts the probe counts afresh.
            (w.successes, w.probe_failures) = (0, 0);
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
        if let Some(request) = &change.recycle {
            edits.recycle = Some(request.clone());
            changes.push(format!("recycle requested ({request})"));
        }
        if let Some(credentials) = &change.credentials {
            w.credentials = credentials.clone();
            changes.push(format!("credentials rotated to {credentials}"));
        }
        if let Some(content) = &change.cloud_init {
            w.cloud_init = Some(content.clone());
            changes.push(format!("cloud-init Secret rotated to {content}"));
        }
        if !change.probes.is_empty() {
            let (success_threshold, failure_threshold) = w
                .check
                .as_ref()
                .map_or((1, 1), |c| (c.success_threshold, c.failure_threshold));
            for probe in &change.probes {
                if probe == "pass" {
                    (w.successes, w.probe_failures) = (w.successes + 1, 0);
                } else {
                    (w.successes, w.probe_failures) = (0, w.probe_failures + 1);
                }
                w.health = crate::health::next_verdict(
                    w.health,
                    w.successes,
                    w.probe_failures,
                    success_threshold,
                    failure_threshold,
                );
            }
            changes.push(format!(
                "probes {} (thresholds: {success_threshold} to pass, {failure_threshold} to fail): verdict {}",
                change.probes.join(", "),
                match w.health {
                    Verdict::Passing => "passing",
                    Verdict::Failing => "failing",
                    Verdict::Unknown => "unknown",
                }
            ));
        }
        if let Some(edit) = &change.edit {
            edits.spec_edit = Some(edit.clone());
            changes.push("attributes, lease limits or health settings edited".to_owned());
        }
        match change.instance.as_deref() {
            Some("vanished") => {
                w.instance = None;
                w.health = Verdict::Unknown;
                (w.successes, w.probe_failures) = (0, 0);
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

    /// The scripted failure of the next call of `effect`, if one is left.
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
pub(super) struct ObjectEdits {
    pub(super) new_spec: bool,
    pub(super) spec_edit: Option<super::SpecEdit>,
    pub(super) delete: bool,
    pub(super) strip_finalizers: bool,
    pub(super) recycle: Option<String>,
}

/// The reconciler's backend in a scenario: Secrets from the world's script; finalizer, status and
/// audit writes through the mode's backend, each status write recorded, and lost when the step
/// crashes.
pub(super) struct ScriptedBackend<B> {
    pub(super) world: Arc<World>,
    pub(super) mode: B,
}

#[async_trait]
impl<B: ProxyBackend> ProxyBackend for ScriptedBackend<B> {
    async fn cloud_init(&self, _: &str, _: &SecretKeyRef) -> Result<UserData, SecretError> {
        let w = self.world.lock();
        match (&w.spec_problem, &w.cloud_init) {
            (Some(problem), _) => Err(SecretError::NotUsable(problem.clone())),
            (None, None) => Ok(UserData(USER_DATA.to_owned())),
            (None, Some(content)) => Ok(UserData(format!("{USER_DATA}\n# {content}"))),
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
            w.dead = w.crashing;
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

pub(super) struct SimProvider(pub(super) Arc<World>, pub(super) Installation);

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
        credentials: Option<&Credentials>,
    ) -> Result<CredentialsUpdate, ProviderError> {
        if let Some(err) = self.0.fail("update_credentials") {
            return Err(err);
        }
        let mut w = self.0.lock();
        if !w.credentials_in_place {
            return Ok(CredentialsUpdate::Unsupported);
        }
        if let Some(instance) = &mut w.instance {
            instance.password = credentials.map(|c| c.password.clone()).unwrap_or_default();
        }
        Ok(CredentialsUpdate::Applied)
    }
    async fn check_credentials(
        &self,
        _: &str,
        credentials: Option<&Credentials>,
    ) -> Result<CredentialsCheck, ProviderError> {
        let w = self.0.lock();
        let wanted = credentials.map_or("", |c| c.password.as_str());
        Ok(match &w.instance {
            Some(instance) if instance.password == wanted => CredentialsCheck::Accepts,
            Some(_) => CredentialsCheck::Differs,
            None => return Err(ProviderError::NotFound(INSTANCE.to_owned())),
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
            password: request
                .credentials
                .as_ref()
                .map(|c| c.password.clone())
                .unwrap_or_default(),
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
        if w.provider_down {
            return Err(ProviderError::Unavailable("the provider is down".to_owned()));
        }
        if w.slow_delete {
            if let Some(instance) = &mut w.instance {
                instance.running = false;
            }
        } else {
            w.instance = None;
        }
        w.health = Verdict::Unknown;
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

pub(super) struct SimLeases(pub(super) Arc<World>);

impl LeaseControl for SimLeases {
    fn upsert(&self, target: LeaseTarget) {
        let attributes: Vec<String> = target
            .attributes
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        self.0.lock().lease_target = Some((
            attributes.join(","),
            target.policy.max_concurrent,
            target.policy.cooldown_seconds,
        ));
    }
    fn set_admission(&self, _: &ProxyKey, open: bool) {
        let mut w = self.0.lock();
        if !w.dead {
            w.admitted = open;
        }
    }
    fn drain(&self, _: &ProxyKey) -> DrainStatus {
        match self.0.lock().leases {
            0 => DrainStatus::Drained,
            active => DrainStatus::Pending { active },
        }
    }
    fn revoke_all(&self, _: &ProxyKey) -> usize {
        std::mem::take(&mut self.0.lock().leases)
    }
    fn remove(&self, _: &ProxyKey) {
        self.0.lock().admitted = false;
    }
    fn active(&self, _: &ProxyKey) -> usize {
        self.0.lock().leases
    }
}

/// What the simulated health engine judges probes by: the part of a health target the trail
/// shows and the verdict depends on.
#[derive(Debug)]
struct Judging {
    interval_seconds: i64,
    success_threshold: u32,
    failure_threshold: u32,
}

pub(super) struct SimHealth(pub(super) Arc<World>);

impl HealthControl for SimHealth {
    fn upsert(&self, target: HealthTarget) {
        self.0.lock().check = Some(Judging {
            interval_seconds: i64::try_from(target.interval.as_secs()).unwrap_or(i64::MAX),
            success_threshold: target.success_threshold,
            failure_threshold: target.failure_threshold,
        });
    }
    fn remove(&self, _: &ProxyKey) {}
    fn verdict(&self, _: &ProxyKey) -> Verdict {
        let w = self.0.lock();
        if w.instance.as_ref().is_some_and(|i| i.running) {
            w.health
        } else {
            Verdict::Unknown
        }
    }
}
