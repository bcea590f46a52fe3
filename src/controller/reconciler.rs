//! One reconcile of one Proxy: observe → decide → execute → record. See the module docs of
//! [`crate::controller`].

use std::{collections::VecDeque, sync::Arc, time::Duration};

use jiff::Timestamp;
use kube::ResourceExt;
use tracing::{Instrument, debug, warn};

use super::{
    ProviderAvailability,
    observe::{
        HealthObservation, InstanceObservation, ProviderObservation, Snapshot, SpecProblem, derive_events,
    },
    spec_hash,
    status::{FINALIZER, StatusInput, desired_status, ready_condition, state_from_status},
};
use crate::{
    api::Proxy,
    effects::{
        BackendError, DrainStatus, HealthControl, HealthTarget, HealthVerdict, LeaseControl, LeaseTarget,
        ProxyBackend, ProxyKey, SecretError,
    },
    machine::{AuditEntry, EffectKind, Event, GuardInput, Phase, State, Timers, decide, requeue_after},
    provider::{
        Credentials, Endpoint, InstanceRequest, InstanceState, Owner, ProviderError, ProviderRegistry,
        SharedProvider, UserData, instance_name,
    },
};

/// Knobs of the reconciler.
#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Lifecycle timers.
    pub timers: Timers,
    /// Create attempts per provisioning episode.
    pub max_create_attempts: u32,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            timers: Timers::default(),
            max_create_attempts: GuardInput::DEFAULT_MAX_CREATE_ATTEMPTS,
        }
    }
}

/// Why a reconcile failed; the category decides how the controller retries.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The object lacks what the API server always sets (uid, namespace): an invariant broke.
    #[error("object is missing {0}")]
    MalformedObject(&'static str),
    /// The stored status can't be read back into a state.
    #[error("unreadable status: {0}")]
    UnreadableStatus(String),
    /// A provider call failed in a way that retrying may fix.
    #[error("{0}")]
    Provider(#[from] ProviderError),
    /// A write failed.
    #[error("{0}")]
    Backend(#[from] BackendError),
    /// A referenced Secret could not be read (not a user error).
    #[error("{0}")]
    Secret(SecretError),
}

impl ReconcileError {
    /// A bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            Self::MalformedObject(_) => "MalformedObject",
            Self::UnreadableStatus(_) => "UnreadableStatus",
            Self::Provider(e) => e.category(),
            Self::Backend(BackendError::Conflict(_)) => "Conflict",
            Self::Backend(BackendError::Gone(_)) => "Gone",
            Self::Backend(BackendError::Other(_)) => "BackendError",
            Self::Secret(_) => "SecretUnreadable",
        }
    }
}

/// What a reconcile did.
#[derive(Debug, Default)]
pub struct ReconcileOutcome {
    /// Reconcile again after this long (the state's timer).
    pub requeue_after: Option<Duration>,
    /// Transitions taken, in order.
    pub audit: Vec<AuditEntry>,
    /// Writes made to the Proxy (finalizer and status), for the write budget.
    pub proxy_writes: usize,
    /// The state after the reconcile.
    pub phase: Option<Phase>,
}

/// The reconciler: the pipeline plus the executors it drives.
pub struct Reconciler<B> {
    backend: B,
    providers: ProviderRegistry,
    leases: Arc<dyn LeaseControl>,
    health: Arc<dyn HealthControl>,
    availability: ProviderAvailability,
    config: ReconcilerConfig,
    clock: fn() -> Timestamp,
}

/// What observe resolved about the spec, beyond the hash.
struct Resolved {
    hash: String,
    user_data: Option<UserData>,
    credentials: Option<Credentials>,
}

/// The status fields that effects update during one reconcile.
struct Working {
    reason: String,
    message: String,
    provider_id: Option<String>,
    endpoint: Option<String>,
    spec_hash: Option<String>,
    instance_running: bool,
    last_health_check_time: Option<Timestamp>,
    proxy_writes: usize,
    has_finalizer: bool,
}

impl<B: ProxyBackend> Reconciler<B> {
    /// A reconciler over `backend` and `providers`.
    pub fn new(
        backend: B,
        providers: ProviderRegistry,
        leases: Arc<dyn LeaseControl>,
        health: Arc<dyn HealthControl>,
        availability: ProviderAvailability,
        config: ReconcilerConfig,
    ) -> Self {
        Self {
            backend,
            providers,
            leases,
            health,
            availability,
            config,
            clock: Timestamp::now,
        }
    }

    /// Use `clock` instead of the system clock (tests pin time).
    pub fn with_clock(mut self, clock: fn() -> Timestamp) -> Self {
        self.clock = clock;
        self
    }

    /// The backend (tests inspect it).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Reconciles one Proxy, inside one `reconcile` span naming it (`proxy.namespace`,
    /// `proxy.name`; `proxy.phase` after, or `error.category` and an error status on failure).
    /// Both modes call this, so both get the same span; nothing secret is ever recorded on it.
    pub async fn reconcile(&self, proxy: &Proxy) -> Result<ReconcileOutcome, ReconcileError> {
        // Not `namespace`/`name`: a span field called `name` collides with the span's own name
        // in JSON logs.
        let span = tracing::info_span!(
            "reconcile",
            proxy.namespace = proxy.metadata.namespace.as_deref().unwrap_or_default(),
            proxy.name = proxy.metadata.name.as_deref().unwrap_or_default(),
            proxy.phase = tracing::field::Empty,
            error.category = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        let result = self.reconcile_steps(proxy).instrument(span.clone()).await;
        match &result {
            Ok(outcome) => {
                if let Some(phase) = outcome.phase {
                    span.record("proxy.phase", phase.as_str());
                }
            }
            Err(err) => {
                span.record("error.category", err.category());
                span.record("otel.status_code", "ERROR");
            }
        }
        result
    }

    async fn reconcile_steps(&self, proxy: &Proxy) -> Result<ReconcileOutcome, ReconcileError> {
        let now = (self.clock)();
        let key = ProxyKey {
            namespace: proxy
                .metadata
                .namespace
                .clone()
                .ok_or(ReconcileError::MalformedObject("namespace"))?,
            name: proxy
                .metadata
                .name
                .clone()
                .ok_or(ReconcileError::MalformedObject("name"))?,
        };
        let uid = proxy
            .metadata
            .uid
            .clone()
            .ok_or(ReconcileError::MalformedObject("uid"))?;
        let instance = instance_name(&key.namespace, &key.name, &uid);
        let owner = Owner {
            uid,
            namespace: key.namespace.clone(),
            name: key.name.clone(),
        };
        let previous = proxy.status.clone().unwrap_or_default();
        let mut state = state_from_status(proxy.status.as_ref()).map_err(ReconcileError::UnreadableStatus)?;

        // --- observe ---------------------------------------------------------------------------
        let provider = self.providers.get(&proxy.spec.provider);
        let resolved = match &provider {
            Ok(_) => self.resolve(proxy, &key).await?,
            Err(unknown) => Err(SpecProblem {
                reason: "UnknownProvider",
                message: unknown.to_string(),
            }),
        };
        let provider = provider.ok().cloned();
        let mut provider_down = provider
            .as_ref()
            .and_then(|_| self.availability.down_reason(&proxy.spec.provider));
        let instance_observation = match &provider {
            Some(provider) if needs_instance(&state) => match provider.get(&instance).await {
                Ok(found) => InstanceObservation::Present(found.state),
                Err(ProviderError::NotFound(_)) => InstanceObservation::Missing,
                Err(ProviderError::Unavailable(reason)) => {
                    provider_down.get_or_insert(reason);
                    InstanceObservation::Unknown
                }
                Err(other) => {
                    debug!(proxy = %key, error = %other, "instance lookup failed");
                    InstanceObservation::Unknown
                }
            },
            _ => InstanceObservation::NotChecked,
        };
        let ready = ready_condition(proxy.status.as_ref());
        let snapshot = Snapshot {
            deletion_requested: proxy.metadata.deletion_timestamp.is_some(),
            spec_hash: resolved.as_ref().map(|r| r.hash.clone()).map_err(Clone::clone),
            applied_hash: previous.spec_hash.clone(),
            provider: match &provider_down {
                Some(reason) => ProviderObservation::Unavailable(reason.clone()),
                None => ProviderObservation::Available,
            },
            instance: instance_observation,
            health: match self.health.verdict(&key) {
                HealthVerdict::Unknown => HealthObservation::Unknown,
                HealthVerdict::Passing { after_failing } => HealthObservation::Passing { after_failing },
                HealthVerdict::Failing => HealthObservation::Failing,
            },
            active_leases: self.leases.active(&key),
            reported: ready.map(|c| (c.reason.clone(), c.message.clone())),
            reported_since: ready.map(|c| c.last_transition_time.0),
            provisioned_reported: previous
                .conditions
                .iter()
                .any(|c| c.type_ == super::status::PROVISIONED && c.status == "True"),
            generation_changed: proxy.metadata.generation != previous.observed_generation,
        };
        let derived = derive_events(&state, &snapshot, now, &self.config.timers);

        // --- decide and execute ----------------------------------------------------------------
        let mut working = Working {
            reason: ready
                .map(|c| c.reason.clone())
                .unwrap_or_else(|| "Accepted".to_owned()),
            message: ready.map(|c| c.message.clone()).unwrap_or_default(),
            provider_id: previous.provider_id.clone(),
            endpoint: previous.endpoint.clone(),
            spec_hash: previous.spec_hash.clone(),
            instance_running: snapshot.provisioned_reported
                || snapshot.instance == InstanceObservation::Present(InstanceState::Running),
            last_health_check_time: None,
            proxy_writes: 0,
            has_finalizer: proxy.finalizers().iter().any(|f| f == FINALIZER),
        };
        let context = EffectContext {
            proxy,
            key: &key,
            instance: &instance,
            owner: &owner,
            provider: provider.as_ref(),
            resolved: resolved.as_ref().ok(),
            problem: resolved.as_ref().err(),
            provider_down: provider_down.as_deref(),
        };
        let mut audit = Vec::new();
        let mut derived: VecDeque<Event> = derived.into();
        let mut feedback: VecDeque<Event> = VecDeque::new();
        while let Some(event) = feedback.pop_front().or_else(|| derived.pop_front()) {
            let input = GuardInput {
                max_create_attempts: self.config.max_create_attempts,
                active_leases: self.leases.active(&key),
            };
            let decision = match decide(&state, event, &input, now) {
                Ok(decision) => decision,
                Err(invalid) => {
                    warn!(proxy = %key, %invalid, "engine refused an event; this is a bug in event derivation");
                    continue;
                }
            };
            let Some(entry) = AuditEntry::from_decision(&decision, now) else {
                continue;
            };
            working.reason = entry.reason.clone();
            working.message = transition_message(&context, event, &self.config.timers);
            if matches!(
                event,
                Event::HealthPassed | Event::HealthFailed | Event::HealthRecovered
            ) {
                working.last_health_check_time = Some(now);
            }
            for effect in &decision.effects {
                self.execute(*effect, &context, &mut working, &entry, &mut feedback)
                    .await?;
            }
            debug!(proxy = %key, transition = %entry.arrow(), reason = %entry.reason, "transition");
            if decision.changed_phase() {
                // Later derived events were observed for the old phase; the status write that
                // follows wakes the reconciler again with a fresh snapshot.
                derived.clear();
            }
            state = decision.to;
            audit.push(entry);
        }

        // --- level-triggered upkeep: re-register what in-memory executors lost on a restart ----
        self.sync_targets(&state, &context, &working);

        // --- record: the status, only if it changed --------------------------------------------
        let status = desired_status(StatusInput {
            state: &state,
            previous: &previous,
            generation: proxy.metadata.generation,
            reason: &working.reason,
            message: &working.message,
            provider_id: working.provider_id.clone(),
            endpoint: working.endpoint.clone(),
            spec_hash: working.spec_hash.clone(),
            instance_running: working.instance_running && needs_instance(&state),
            last_health_check_time: working.last_health_check_time,
            now,
        });
        if state.phase() != Phase::Deleted && Some(&status) != proxy.status.as_ref() {
            self.backend.write_status(proxy, &status).await?;
            working.proxy_writes += 1;
        }
        let requeue_after = match state.phase() {
            Phase::Deleted => None,
            // The user must change the object (or its Secret); that change wakes us.
            Phase::Pending if working.reason == "InvalidSpec" => None,
            // Every other state has a timer (healthy: the slow resync behind the watches), so
            // a `requeue_after` effect and "no transition this time" wait alike.
            _ => Some(requeue_after(&state, now, &self.config.timers)),
        };
        Ok(ReconcileOutcome {
            requeue_after,
            audit,
            proxy_writes: working.proxy_writes,
            phase: Some(state.phase()),
        })
    }

    /// Reads the Secrets the spec references and computes the spec hash.
    async fn resolve(
        &self,
        proxy: &Proxy,
        key: &ProxyKey,
    ) -> Result<Result<Resolved, SpecProblem>, ReconcileError> {
        let user_data = match &proxy.spec.cloud_init {
            None => None,
            Some(cloud_init) => {
                let read = self
                    .backend
                    .cloud_init(&key.namespace, &cloud_init.secret_ref)
                    .await;
                match secret_value(read, "CloudInitSecretUnusable")? {
                    Ok(data) => Some(data),
                    Err(problem) => return Ok(Err(problem)),
                }
            }
        };
        let credentials = match &proxy.spec.auth {
            None => None,
            Some(auth) => {
                let read = self
                    .backend
                    .credentials(&key.namespace, &auth.secret_ref.name)
                    .await;
                match secret_value(read, "CredentialsSecretUnusable")? {
                    Ok(credentials) => Some(credentials),
                    Err(problem) => return Ok(Err(problem)),
                }
            }
        };
        let hash = spec_hash::for_spec(&proxy.spec, user_data.as_ref().map(|d| d.0.as_str()));
        Ok(Ok(Resolved {
            hash,
            user_data,
            credentials,
        }))
    }

    async fn execute(
        &self,
        effect: EffectKind,
        cx: &EffectContext<'_>,
        working: &mut Working,
        entry: &AuditEntry,
        feedback: &mut VecDeque<Event>,
    ) -> Result<(), ReconcileError> {
        match effect {
            EffectKind::AddFinalizer => {
                if !working.has_finalizer {
                    self.backend.add_finalizer(cx.proxy).await?;
                    working.has_finalizer = true;
                    working.proxy_writes += 1;
                }
            }
            EffectKind::RemoveFinalizer => {
                self.leases.remove(cx.key);
                self.health.remove(cx.key);
                if working.has_finalizer {
                    self.backend.remove_finalizer(cx.proxy).await?;
                    working.has_finalizer = false;
                    working.proxy_writes += 1;
                }
            }
            EffectKind::CreateInstance => self.create_instance(cx, working, feedback).await?,
            EffectKind::DeleteInstance => {
                let Some(provider) = cx.provider else {
                    // An unknown provider never created anything for this Proxy.
                    feedback.push_back(Event::InstanceGone);
                    return Ok(());
                };
                self.health.remove(cx.key);
                provider.delete(cx.instance).await?;
                // Only a truthful NotFound says it is gone (a pod may still be terminating).
                match provider.get(cx.instance).await {
                    Err(ProviderError::NotFound(_)) => {
                        working.provider_id = None;
                        working.endpoint = None;
                        working.spec_hash = None;
                        working.instance_running = false;
                        feedback.push_back(Event::InstanceGone);
                    }
                    // Still there (terminating): the state's timer brings us back to see it gone.
                    Ok(_) => {}
                    Err(other) => return Err(other.into()),
                }
            }
            EffectKind::EnableLeases => {
                if let Some(target) = self.lease_target(cx, working) {
                    self.leases.upsert(target);
                }
                self.leases.set_admission(cx.key, true);
            }
            EffectKind::DisableLeases => self.leases.set_admission(cx.key, false),
            EffectKind::DrainLeases => {
                // Not drained yet: the draining timer brings us back.
                if self.leases.drain(cx.key) == DrainStatus::Drained {
                    feedback.push_back(Event::DrainComplete);
                }
            }
            EffectKind::RevokeLeases => {
                let revoked = self.leases.revoke_all(cx.key);
                if revoked > 0 {
                    debug!(proxy = %cx.key, revoked, "revoked leases");
                }
            }
            // The status is computed once at the end from the final state and `working`.
            EffectKind::SetConditions => {}
            EffectKind::RecordEvent => {
                if let Err(err) = self.backend.record(cx.proxy, entry, &working.message).await {
                    // The audit trail in the cluster is best effort: the status is authoritative.
                    warn!(proxy = %cx.key, error = %err, "recording an event failed");
                }
            }
            // The delay is the final state's timer, computed once at the end of the reconcile.
            EffectKind::RequeueAfter => {}
        }
        Ok(())
    }

    async fn create_instance(
        &self,
        cx: &EffectContext<'_>,
        working: &mut Working,
        feedback: &mut VecDeque<Event>,
    ) -> Result<(), ReconcileError> {
        let (Some(provider), Some(resolved)) = (cx.provider, cx.resolved) else {
            // The spec is invalid: spec_invalid is derived before any create, so this is only
            // reachable through a stale feedback event. Nothing to create.
            return Ok(());
        };
        let port = u16::try_from(cx.proxy.spec.port).map_err(|_| {
            ReconcileError::Provider(ProviderError::Misconfigured(format!(
                "port {} is out of range",
                cx.proxy.spec.port
            )))
        })?;
        let request = InstanceRequest {
            name: cx.instance.to_owned(),
            owner: cx.owner.clone(),
            spec_hash: resolved.hash.clone(),
            placement: cx.proxy.spec.placement.clone(),
            port,
            user_data: resolved.user_data.clone(),
            credentials: resolved.credentials.clone(),
        };
        match provider.create(&request).await {
            Ok(instance) => {
                working.provider_id = Some(instance.id.to_string());
                working.endpoint = instance.endpoint.as_ref().map(ToString::to_string);
                working.spec_hash = Some(resolved.hash.clone());
                feedback.push_back(Event::InstanceCreated);
                if instance.state == InstanceState::Running {
                    working.instance_running = true;
                    feedback.push_back(Event::InstanceRunning);
                }
            }
            Err(ProviderError::Unavailable(reason)) => {
                working.message = format!("provider unavailable: {reason}");
                feedback.push_back(Event::ProviderUnavailable);
            }
            Err(err) => {
                working.message = format!("create failed: {err}");
                feedback.push_back(Event::CreateFailed);
            }
        }
        Ok(())
    }

    fn lease_target(&self, cx: &EffectContext<'_>, working: &Working) -> Option<LeaseTarget> {
        Some(LeaseTarget {
            key: cx.key.clone(),
            endpoint: parse_endpoint(working.endpoint.as_deref()?)?,
            attributes: cx.proxy.spec.attributes.clone(),
            policy: cx.proxy.spec.lease.clone(),
            credentials: cx.resolved.and_then(|r| r.credentials.clone()),
        })
    }

    /// Health probing and lease registration are in-memory: after a restart (or a spec edit of
    /// attributes, limits or health settings) they are brought in line with the state here.
    fn sync_targets(&self, state: &State, cx: &EffectContext<'_>, working: &Working) {
        let live = matches!(
            state.phase(),
            Phase::Provisioning | Phase::Healthy | Phase::Degraded
        );
        let endpoint = working.endpoint.as_deref().and_then(parse_endpoint);
        match (live, endpoint) {
            (true, Some(endpoint)) => {
                self.health.upsert(HealthTarget {
                    key: cx.key.clone(),
                    endpoint,
                    check: cx.proxy.spec.health.clone(),
                    credentials: cx.resolved.and_then(|r| r.credentials.clone()),
                });
                if let Some(target) = self.lease_target(cx, working) {
                    self.leases.upsert(target);
                }
                self.leases.set_admission(cx.key, state.phase() == Phase::Healthy);
            }
            _ if state.phase() == Phase::Pending => {
                self.health.remove(cx.key);
                self.leases.set_admission(cx.key, false);
            }
            _ => {}
        }
    }
}

/// The per-reconcile inputs of the executors.
struct EffectContext<'a> {
    proxy: &'a Proxy,
    key: &'a ProxyKey,
    instance: &'a str,
    owner: &'a Owner,
    provider: Option<&'a SharedProvider>,
    resolved: Option<&'a Resolved>,
    problem: Option<&'a SpecProblem>,
    provider_down: Option<&'a str>,
}

/// The `Ready` message for a transition caused by `event` (never secret content).
fn transition_message(cx: &EffectContext<'_>, event: Event, timers: &Timers) -> String {
    match event {
        // Says what did not happen, and by when, so the user knows which timeout to look at.
        Event::ProvisioningTimeout => format!(
            "no passing health check within the provisioning timeout ({} s): deleting the \
             instance to start over",
            timers.provisioning_timeout.as_secs()
        ),
        Event::SpecInvalid => cx
            .problem
            .map(|p| format!("{}: {}", p.reason, p.message))
            .unwrap_or_default(),
        Event::ProviderUnavailable => cx
            .provider_down
            .map(|r| format!("provider unavailable: {r}"))
            .unwrap_or_default(),
        _ => event.doc().to_owned(),
    }
}

/// States in which the instance's existence decides events.
fn needs_instance(state: &State) -> bool {
    !matches!(state.phase(), Phase::Pending | Phase::Deleted)
}

/// `host:port` or `[v6]:port` back into an [`Endpoint`].
fn parse_endpoint(endpoint: &str) -> Option<Endpoint> {
    let (host, port) = endpoint.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some(Endpoint {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

/// A referenced Secret's value. A Secret the user must fix becomes a [`SpecProblem`] with
/// `reason`; anything else stays an error, retried with back-off.
fn secret_value<T>(
    read: Result<T, SecretError>,
    reason: &'static str,
) -> Result<Result<T, SpecProblem>, ReconcileError> {
    match read {
        Ok(value) => Ok(Ok(value)),
        Err(SecretError::NotUsable(message)) => Ok(Err(SpecProblem { reason, message })),
        Err(transient) => Err(ReconcileError::Secret(transient)),
    }
}
