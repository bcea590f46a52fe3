//! One reconcile of one Proxy, in rounds of observe → derive → decide → plan → execute, then the
//! status. See the module docs of [`crate::controller`].

use std::{collections::VecDeque, sync::Arc, time::Duration};

use jiff::Timestamp;
use kube::ResourceExt;
use tracing::{Instrument, debug, warn};

use super::{
    ProviderAvailability, ReconcileError,
    credentials::CredentialsBook,
    execute::{EffectContext, ObjectWrites, Occurrence, lease_target, parse_endpoint, short},
    observe::{InstanceObservation, Observation, SpecProblem, applied_hash, facts, needs_instance},
    plan::{Plan, PlanInput, Wake, WakeWhy, next_wake, plan},
    pool::{Budgets, PoolFacts, Pools},
    spec_hash::{self, Comparison},
    status::{FINALIZER, Record},
};
use crate::{
    api::{Proxy, ProxyKey},
    effects::{ProxyBackend, SecretError},
    health::{HealthControl, HealthTarget, Verdict as HealthVerdict},
    lease::LeaseControl,
    machine::{AuditEntry, Backoff, Event, Fact, Outcome, Phase, Timers, decide, derive},
    provider::{
        Credentials, Owner, ProviderError, ProviderRegistry, SharedProvider, UserData, instance_name,
    },
};

/// Rounds one reconcile may run before it yields (and requeues after the floor): each round changes the
/// state or the record, so a handful always suffices; the bound only stops a bug from spinning.
const MAX_ROUNDS: usize = 8;

/// Knobs of the reconciler.
#[derive(Clone, Debug, Default)]
pub struct ReconcilerConfig {
    /// The table's timers and the poll intervals.
    pub timers: Timers,
    /// Retry backoff of failed provider calls.
    pub backoff: Backoff,
    /// Pool budgets against mass replacement.
    pub budgets: Budgets,
}

/// What a reconcile did.
#[derive(Debug, Default)]
pub struct ReconcileOutcome {
    /// Reconcile again after this long (`None`: only a change wakes it).
    pub requeue_after: Option<Duration>,
    /// Only the periodic resync is due (see [`Wake::resync_only`]).
    pub resync_only: bool,
    /// What the Proxy waits for until then (see [`WakeWhy`]).
    pub wake_why: Option<WakeWhy>,
    /// Transitions taken, in order.
    pub audit: Vec<AuditEntry>,
    /// The plan of each transition, in order (what the executors were asked to do).
    pub plans: Vec<Plan>,
    /// Writes made to the Proxy (finalizer and status), for the write budget.
    pub proxy_writes: usize,
    /// The state after the reconcile.
    pub phase: Option<Phase>,
}

/// The reconciler: the pipeline plus the executors it drives.
pub struct Reconciler<B> {
    pub(crate) backend: B,
    providers: ProviderRegistry,
    pub(crate) leases: Arc<dyn LeaseControl>,
    pub(crate) health: Arc<dyn HealthControl>,
    availability: ProviderAvailability,
    pools: Arc<Pools>,
    credentials: CredentialsBook,
    config: ReconcilerConfig,
    clock: Arc<dyn Fn() -> Timestamp + Send + Sync>,
}

/// What observe resolved about the spec: its hash and the Secrets' content.
pub(crate) struct Resolved {
    pub hash: String,
    pub user_data: Option<UserData>,
    pub credentials: Option<Credentials>,
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
            pools: Arc::default(),
            credentials: CredentialsBook::default(),
            config,
            clock: Arc::new(Timestamp::now),
        }
    }

    /// Use `clock` instead of the system clock (tests pin time).
    pub fn with_clock(mut self, clock: impl Fn() -> Timestamp + Send + Sync + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The backend (tests inspect it).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The pools whose budgets the reconciler enforces; a mode seeds them from its store.
    pub fn pools(&self) -> &Arc<Pools> {
        &self.pools
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
        let key = ProxyKey::new(
            proxy
                .metadata
                .namespace
                .as_deref()
                .ok_or(ReconcileError::MalformedObject("namespace"))?,
            proxy
                .metadata
                .name
                .as_deref()
                .ok_or(ReconcileError::MalformedObject("name"))?,
        );
        let uid = proxy
            .metadata
            .uid
            .clone()
            .ok_or(ReconcileError::MalformedObject("uid"))?;
        let instance = instance_name(key.namespace(), key.name(), &uid);
        let owner = Owner {
            uid,
            namespace: key.namespace().to_owned(),
            name: key.name().to_owned(),
        };
        let previous = proxy.status.clone().unwrap_or_default();
        let mut record =
            Record::from_status(proxy.status.as_ref(), now).map_err(ReconcileError::UnreadableStatus)?;
        let mut object = ObjectWrites {
            finalizer: proxy.finalizers().iter().any(|f| f == FINALIZER),
            resource_version: None,
            writes: 0,
        };

        // --- observe, once per reconcile: what the spec resolves to ------------------------------
        let provider_name = proxy.spec.provider.as_str();
        let provider = self.providers.get(provider_name).ok().cloned();
        let resolved = match &provider {
            Some(_) => self.resolve(proxy, &key).await?,
            None => Err(SpecProblem {
                reason: "UnknownProvider",
                message: match self.providers.get(provider_name) {
                    Err(unknown) => unknown.to_string(),
                    Ok(_) => String::new(),
                },
            }),
        };
        let problem_text = resolved.as_ref().err().map(SpecProblem::text);
        let context = EffectContext {
            proxy,
            key: &key,
            instance: &instance,
            owner: &owner,
            provider_name,
            provider: provider.as_ref(),
            resolved: resolved
                .as_ref()
                .map_err(|_| problem_text.as_deref().unwrap_or_default()),
        };
        // A Secret rotated again after a failed credentials update is a new request, like a spec
        // edit: both count for the first round only (a retry they allowed that fails again
        // backs off).
        let rotated = resolved.as_ref().is_ok_and(|r| {
            self.credentials
                .rotated_since_failure(&key, r.credentials.as_ref())
        });
        let mut spec_edited =
            (proxy.metadata.generation != previous.observed_generation && proxy.status.is_some()) || rotated;

        let mut audit = Vec::new();
        let mut plans = Vec::new();
        let mut yielded = true;
        let mut held_by_budget = false;
        for _round in 0..MAX_ROUNDS {
            // --- observe: the world, every round (effects change it) -----------------------------
            let observation = self
                .observe(
                    proxy,
                    &key,
                    &record,
                    &context,
                    &resolved,
                    spec_edited,
                    object.finalizer,
                    now,
                )
                .await;
            let facts = facts(&observation, &record, now, &self.config.timers);
            // --- derive ----------------------------------------------------------------------
            let Some(event) = derive(record.state.phase(), facts) else {
                // A replacement the pool's budget holds back is looked at again on every poll.
                held_by_budget = facts.get(Fact::SpecChanged) && !facts.get(Fact::ReplacementBudgetLeft);
                yielded = false;
                break;
            };
            let cause = self.cause_of(event, &observation, &record);
            // --- decide, plan, execute; then what the executors raised, in order --------------
            let mut queue = VecDeque::from([Occurrence { event, cause }]);
            while let Some(occurrence) = queue.pop_front() {
                let decision = match decide(&record.state, occurrence.event, facts, now) {
                    Ok(decision) => decision,
                    Err(invalid) => {
                        warn!(proxy = %key, %invalid, "an executor raised an event the table declares invalid here");
                        break;
                    }
                };
                if decision.outcome == Outcome::Ignored {
                    continue;
                }
                let planned = plan(
                    &decision,
                    occurrence.cause.as_deref(),
                    PlanInput {
                        now,
                        record: &record,
                        backoff: &self.config.backoff,
                        jitter: fastrand::f64(),
                    },
                );
                let Some(entry) = AuditEntry::from_decision(&decision, now, occurrence.cause.as_deref())
                else {
                    continue;
                };
                debug!(proxy = %key, transition = %entry.arrow(), reason = %entry.reason, "transition");
                record.state = decision.to.clone();
                if matches!(occurrence.event, Event::HealthPassed | Event::HealthFailed) {
                    record.last_health_check_time = Some(now);
                }
                for effect in &planned.effects {
                    let raised = self
                        .execute(effect, &context, &mut record, &mut object, &entry)
                        .await?;
                    queue.extend(raised);
                }
                audit.push(entry);
                plans.push(planned);
            }
            // The user's edit counts once: a retry it allowed and that failed again backs off.
            spec_edited = false;
        }
        if yielded {
            warn!(proxy = %key, rounds = MAX_ROUNDS, "reconcile did not settle; continuing at once");
        }
        let phase = record.state.phase();
        self.pools.set(&key, provider_name, phase);

        // --- the in-memory executors' upkeep (after a restart, or an in-place spec edit) ---------
        self.sync_targets(&record, &context);

        // --- status: only if it changed ------------------------------------------------------
        let mut proxy_writes = object.writes;
        if phase != Phase::Deleted {
            let status = record.to_status(&previous, proxy.metadata.generation, now);
            if Some(&status) != proxy.status.as_ref() {
                match object.resource_version {
                    // Our own finalizer write moved the version: write on top of it, not into
                    // a conflict with ourselves.
                    Some(version) => {
                        let mut current = proxy.clone();
                        current.metadata.resource_version = Some(version);
                        self.backend.write_status(&current, &status).await?;
                    }
                    None => self.backend.write_status(proxy, &status).await?,
                }
                proxy_writes += 1;
            }
        }
        let wake = if yielded {
            Wake::unsettled(super::plan::floor(&self.config.timers))
        } else if held_by_budget {
            let every = self.config.timers.poll;
            Wake::after(every, every, WakeWhy::BudgetHeld { every })
        } else {
            next_wake(&record, now, &self.config.timers, resolved.is_ok())
        };
        debug!(proxy = %key, phase = %phase, after = ?wake.after, why = %wake.why, "next wake-up");
        Ok(ReconcileOutcome {
            requeue_after: wake.after,
            resync_only: wake.resync_only,
            wake_why: Some(wake.why),
            audit,
            plans,
            proxy_writes,
            phase: Some(phase),
        })
    }

    /// Gathers one look at the world for `proxy`.
    #[allow(clippy::too_many_arguments)] // one call site; the arguments are the reconcile's locals
    async fn observe(
        &self,
        proxy: &Proxy,
        key: &ProxyKey,
        record: &Record,
        cx: &EffectContext<'_>,
        resolved: &Result<Resolved, SpecProblem>,
        spec_edited: bool,
        finalizer: bool,
        now: Timestamp,
    ) -> Observation {
        let mut provider_down = cx
            .provider
            .and_then(|_| self.availability.down_reason(cx.provider_name));
        let instance = match cx.provider {
            Some(provider) if needs_instance(record.state.phase()) => {
                self.look_up(provider, cx.instance, key, &mut provider_down).await
            }
            _ => InstanceObservation::NotChecked,
        };
        // Compared only against a spec that resolves: an unreadable Secret says nothing about
        // which credentials are wanted.
        let in_place = cx.provider.is_some_and(|p| p.updates_credentials_in_place());
        let (credentials_changed, credentials_need_replacement) = match resolved {
            Ok(resolved) => self
                .credentials
                .compare(key, resolved.credentials.as_ref(), in_place),
            Err(_) => (false, false),
        };
        let spec_changed = match (resolved, applied_hash(&instance, record)) {
            (Ok(resolved), Some(applied)) => {
                let user_data = resolved.user_data.as_ref().map(|d| d.0.as_str());
                match spec_hash::compare(applied, &proxy.spec, user_data) {
                    Comparison::Same => false,
                    Comparison::Changed => true,
                    // Written by a newer operator (a downgrade), or not a hash: replacing every
                    // instance on that guess would be worse than keeping them.
                    Comparison::Unknown => {
                        debug!(proxy = %key, applied, "spec hash of an unknown encoding: not treated as a change");
                        false
                    }
                }
            }
            _ => false,
        };
        let mut observation = Observation {
            deletion_requested: proxy.metadata.deletion_timestamp.is_some(),
            finalizer_present: finalizer,
            spec_edited,
            desired_hash: resolved.as_ref().map(|r| r.hash.clone()).map_err(Clone::clone),
            // An instance that cannot take new credentials in place is replaced like a changed spec.
            spec_changed: spec_changed || (credentials_need_replacement && resolved.is_ok()),
            credentials_changed,
            provider_down,
            instance,
            health: self.health.verdict(key),
            active_leases: self.leases.active(key),
            pool: PoolFacts {
                replacement_budget_left: true,
                remediation_allowed: true,
            },
        };
        // The budgets matter (and a replacement slot is reserved) only where a replacement is
        // about to be decided: a changed spec, or a degraded proxy whose timer ran out.
        let unbudgeted = facts(&observation, record, now, &self.config.timers);
        let phase = record.state.phase();
        let replacing_soon = unbudgeted.get(Fact::SpecChanged)
            || (phase == Phase::Degraded && unbudgeted.get(Fact::TimerExpired));
        observation.pool =
            self.pools
                .facts(key, cx.provider_name, phase, &self.config.budgets, replacing_soon);
        observation
    }

    async fn look_up(
        &self,
        provider: &SharedProvider,
        instance: &str,
        key: &ProxyKey,
        provider_down: &mut Option<String>,
    ) -> InstanceObservation {
        match provider.get(instance).await {
            Ok(found) => InstanceObservation::Present(Box::new(found)),
            Err(ProviderError::NotFound(_)) => InstanceObservation::Missing,
            Err(ProviderError::Unavailable(reason)) => {
                provider_down.get_or_insert(reason);
                InstanceObservation::Unknown
            }
            Err(other) => {
                debug!(proxy = %key, error = %other, "instance lookup failed");
                InstanceObservation::Unknown
            }
        }
    }

    /// What caused a derived event, when more than its name says.
    fn cause_of(&self, event: Event, observation: &Observation, record: &Record) -> Option<String> {
        match event {
            Event::SpecInvalid => observation.desired_hash.as_ref().err().map(SpecProblem::text),
            Event::ProviderUnavailable => observation
                .provider_down
                .as_ref()
                .map(|reason| format!("provider unavailable: {reason}")),
            Event::TimerExpired => {
                let timer = record.state.phase().timer()?;
                Some(format!(
                    "{} ({} s) ran out in {}",
                    timer.as_str(),
                    self.config.timers.duration(timer).as_secs(),
                    record.state.phase()
                ))
            }
            // The row says the provider came back; what the operator knows is that nothing
            // reports it down any more (the monitor, this round's lookup), so it tries again.
            Event::ProviderAvailable => {
                Some("no check reports the provider down now (monitor, lookup): trying again".to_owned())
            }
            Event::InstanceMissing => {
                let id = record.provider_id.as_deref().unwrap_or("of this Proxy");
                Some(match (record.state.phase(), &observation.desired_hash) {
                    (Phase::Replacing, Ok(desired)) => format!(
                        "the old instance {id} is gone (the provider reports NotFound); the new one is \
                         built from spec hash {}",
                        short(desired)
                    ),
                    (Phase::Replacing, Err(_)) => {
                        format!("the old instance {id} is gone (the provider reports NotFound)")
                    }
                    _ => format!(
                        "instance {id} no longer exists (the provider reports NotFound): deleted \
                         outside the operator, or lost with its host"
                    ),
                })
            }
            Event::SpecHashChanged => {
                let desired = observation.desired_hash.as_ref().ok()?;
                let applied = match &observation.instance {
                    InstanceObservation::Present(instance) => instance.spec_hash.clone(),
                    _ => None,
                }
                .or_else(|| record.spec_hash.clone())?;
                Some(if short(&applied) == short(desired) {
                    format!(
                        "the proxy credentials changed and the provider cannot change a running \
                         instance's: replacing it (spec hash {} stays)",
                        short(desired)
                    )
                } else {
                    format!("spec hash {} -> {}", short(&applied), short(desired))
                })
            }
            _ => None,
        }
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
                    .cloud_init(key.namespace(), &cloud_init.secret_ref)
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
                    .credentials(key.namespace(), &auth.secret_ref.name)
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

    /// What leases and probes of the Proxy use: the credentials its instance accepts.
    pub(crate) fn running_credentials(&self, cx: &EffectContext<'_>) -> Option<Credentials> {
        let desired = cx.resolved.ok().and_then(|r| r.credentials.as_ref());
        self.credentials.running_or(cx.key, desired)
    }

    pub(crate) fn set_running_credentials(&self, key: &ProxyKey, credentials: Option<Credentials>) {
        self.credentials.set_running(key, credentials);
    }

    pub(crate) fn replace_for_credentials(&self, key: &ProxyKey, credentials: Option<Credentials>) {
        self.credentials.replace_for(key, credentials);
    }

    pub(crate) fn credentials_update_failed(&self, key: &ProxyKey, credentials: Option<Credentials>) {
        self.credentials.update_failed(key, credentials);
    }

    pub(crate) fn forget_credentials(&self, key: &ProxyKey) {
        self.credentials.forget(key);
    }

    pub(crate) fn credentials_known(&self, key: &ProxyKey) -> bool {
        self.credentials.known(key)
    }

    /// Health probing and lease registration are in-memory: after a restart (or a spec edit of
    /// attributes, limits or health settings) they are brought in line with the persisted state
    /// here. This is upkeep of the executors' own state, not a transition: it never changes the
    /// phase or the status.
    fn sync_targets(&self, record: &Record, cx: &EffectContext<'_>) {
        let phase = record.state.phase();
        let live = matches!(phase, Phase::Provisioning | Phase::Healthy | Phase::Degraded);
        let endpoint = record.endpoint.as_deref().and_then(parse_endpoint);
        match (live, endpoint) {
            (true, Some(endpoint)) => {
                // Probes and leases use what the instance accepts, not what the Secret says.
                let credentials = self.running_credentials(cx);
                self.health.upsert(HealthTarget::from_check(
                    cx.key.clone(),
                    endpoint,
                    &cx.proxy.spec.health,
                    credentials.clone(),
                ));
                if let Some(target) = lease_target(cx, record, credentials) {
                    self.leases.upsert(target);
                }
                // Leasable only once *this process* has seen the proxy pass a probe: after a
                // restart the persisted `healthy` may describe an instance that died meanwhile.
                let verified = self.health.verdict(cx.key) == HealthVerdict::Passing;
                self.leases
                    .set_admission(cx.key, phase == Phase::Healthy && verified);
            }
            _ if phase == Phase::Pending => {
                self.health.remove(cx.key);
                self.leases.set_admission(cx.key, false);
            }
            _ => {}
        }
    }
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
