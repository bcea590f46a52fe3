//! One reconcile of one Proxy, read as the sequence of its calls: resolve, then rounds of observe
//! → facts → derive → decide → plan → execute, then the status, admission (only once the
//! status saying `healthy` is stored) and the next wake-up. See the module docs of
//! [`crate::controller`].

use std::{collections::VecDeque, sync::Arc, time::Duration};

use jiff::Timestamp;
use kube::ResourceExt;
use tracing::{Instrument, debug, warn};

use super::{
    availability::ProviderAvailability,
    credentials::CredentialsBook,
    error::ReconcileError,
    execute::{Executors, ObjectWrites, Occurrence},
    observe::{Observer, Subject, cause_of, facts},
    plan::{Plan, PlanInput, Wake, WakeWhy, floor, next_wake, plan},
    pool::{Budgets, Pools},
    status::{FINALIZER, Record},
};
use crate::{
    api::{Proxy, ProxyKey},
    effects::ProxyBackend,
    health::HealthControl,
    lease::LeaseControl,
    machine::{AuditEntry, Backoff, Event, Fact, Facts, Outcome, Phase, Timers, decide, derive},
    provider::{Owner, ProviderRegistry, instance_name},
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
#[derive(Clone, Debug, Default)]
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

/// What one reconcile has done so far: the record the status is written from, the object's
/// own writes, and the trail of transitions with their plans.
struct Progress {
    record: Record,
    object: ObjectWrites,
    audit: Vec<AuditEntry>,
    plans: Vec<Plan>,
}

impl Progress {
    /// Nothing done yet: the record as the Proxy's status has it.
    fn start(proxy: &Proxy, now: Timestamp) -> Result<Self, ReconcileError> {
        Ok(Progress {
            record: Record::from_status(proxy.status.as_ref(), now)
                .map_err(ReconcileError::UnreadableStatus)?,
            object: ObjectWrites {
                finalizer: proxy.finalizers().iter().any(|f| f == FINALIZER),
                resource_version: None,
                writes: 0,
            },
            audit: Vec::new(),
            plans: Vec::new(),
        })
    }
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

    /// resolve → rounds of (observe → facts → derive → decide → plan → execute) → status →
    /// admission → wake.
    async fn reconcile_steps(&self, proxy: &Proxy) -> Result<ReconcileOutcome, ReconcileError> {
        let now = (self.clock)();
        let (key, instance, owner) = identify(proxy)?;
        let mut progress = Progress::start(proxy, now)?;
        let observer = self.observer();
        let provider = self.providers.get(&proxy.spec.provider);
        let resolved = observer.resolve(proxy, &key, provider.as_ref().copied()).await?;
        let executors = self.executors(Subject {
            proxy,
            key: &key,
            instance: &instance,
            owner: &owner,
            provider_name: &proxy.spec.provider,
            provider: provider.as_ref().ok().copied(),
            resolved: &resolved,
        });
        let subject = &executors.subject;
        // A spec edit, or a Secret rotated again after a failed update, is a new request for
        // the first round only: a retry it allowed that fails again backs off.
        let mut spec_edited = spec_edited(proxy) || observer.rotated_since_failure(subject);
        let mut settled = None;
        for _round in 0..MAX_ROUNDS {
            let record = &progress.record;
            let observation = observer
                .observe(subject, record, spec_edited, progress.object.finalizer, now)
                .await;
            let facts = facts(&observation, record, now, &self.config.timers);
            let Some(event) = derive(record.state.phase(), facts) else {
                settled = Some(facts);
                break;
            };
            let cause = cause_of(event, &observation, record, &self.config.timers);
            let first = Occurrence { event, cause };
            self.transition(&executors, &mut progress, first, facts, now)
                .await?;
            spec_edited = false;
        }
        let phase = progress.record.state.phase();
        self.pools.set(&key, subject.provider_name, phase);
        executors.sync_targets(&progress.record);
        let proxy_writes = self.write_status(proxy, &progress, now).await?;
        executors.admit_if_stored_healthy(&progress.record);
        let wake = self.wake(&key, settled, &progress.record, now, resolved.is_ok());
        debug!(proxy = %key, phase = %phase, after = ?wake.after, why = %wake.why, "next wake-up");
        Ok(ReconcileOutcome {
            requeue_after: wake.after,
            resync_only: wake.resync_only,
            wake_why: Some(wake.why),
            audit: progress.audit,
            plans: progress.plans,
            proxy_writes,
            phase: Some(phase),
        })
    }

    /// The read side of this reconciler, for one reconcile.
    fn observer(&self) -> Observer<'_, B> {
        Observer {
            backend: &self.backend,
            availability: &self.availability,
            health: &*self.health,
            leases: &*self.leases,
            credentials: &self.credentials,
            pools: &self.pools,
            timers: &self.config.timers,
            budgets: &self.config.budgets,
        }
    }

    /// The write side of this reconciler, acting on `subject`.
    fn executors<'a>(&'a self, subject: Subject<'a>) -> Executors<'a, B> {
        Executors {
            backend: &self.backend,
            leases: &*self.leases,
            health: &*self.health,
            credentials: &self.credentials,
            subject,
        }
    }

    /// decide → plan → execute for `first`, then for each event the executors raise, in order,
    /// against the same facts.
    async fn transition(
        &self,
        executors: &Executors<'_, B>,
        progress: &mut Progress,
        first: Occurrence,
        facts: Facts,
        now: Timestamp,
    ) -> Result<(), ReconcileError> {
        let key = executors.subject.key;
        let mut queue = VecDeque::from([first]);
        while let Some(occurrence) = queue.pop_front() {
            let record = &mut progress.record;
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
            let input = PlanInput {
                now,
                record,
                backoff: &self.config.backoff,
                jitter: fastrand::f64(),
            };
            let planned = plan(&decision, occurrence.cause.as_deref(), input);
            let Some(entry) = AuditEntry::from_decision(&decision, now, occurrence.cause.as_deref()) else {
                continue;
            };
            debug!(proxy = %key, transition = %entry.arrow(), reason = %entry.reason, "transition");
            record.state = decision.to.clone();
            if matches!(occurrence.event, Event::HealthPassed | Event::HealthFailed) {
                record.last_health_check_time = Some(now);
            }
            for effect in &planned.effects {
                let raised = executors
                    .execute(effect, &mut progress.record, &mut progress.object, &entry)
                    .await?;
                queue.extend(raised);
            }
            progress.audit.push(entry);
            progress.plans.push(planned);
        }
        Ok(())
    }

    /// Writes the status if it changed (never for a deleted Proxy); returns the writes made to
    /// the Proxy in this reconcile, for the write budget.
    async fn write_status(
        &self,
        proxy: &Proxy,
        progress: &Progress,
        now: Timestamp,
    ) -> Result<usize, ReconcileError> {
        let writes = progress.object.writes;
        if progress.record.state.phase() == Phase::Deleted {
            return Ok(writes);
        }
        let previous = proxy.status.clone().unwrap_or_default();
        let status = progress
            .record
            .to_status(&previous, proxy.metadata.generation, now);
        if Some(&status) == proxy.status.as_ref() {
            return Ok(writes);
        }
        match &progress.object.resource_version {
            // Our own finalizer write moved the version: write on top of it, not into a
            // conflict with ourselves.
            Some(version) => {
                let mut current = proxy.clone();
                current.metadata.resource_version = Some(version.clone());
                self.backend.write_status(&current, &status).await?;
            }
            None => self.backend.write_status(proxy, &status).await?,
        }
        Ok(writes + 1)
    }

    /// When to look again: `settled` holds the facts of the round that derived no event, `None`
    /// when the rounds ran out first.
    fn wake(
        &self,
        key: &ProxyKey,
        settled: Option<Facts>,
        record: &Record,
        now: Timestamp,
        spec_valid: bool,
    ) -> Wake {
        let timers = &self.config.timers;
        match settled {
            None => {
                warn!(proxy = %key, rounds = MAX_ROUNDS, "reconcile did not settle; continuing at once");
                Wake::unsettled(floor(timers))
            }
            // A replacement the pool's budget holds back (a changed spec, a recycle request) is
            // looked at again on every poll.
            Some(facts)
                if (facts.get(Fact::SpecChanged) || facts.get(Fact::RecycleRequested))
                    && !facts.get(Fact::ReplacementBudgetLeft) =>
            {
                let every = timers.poll;
                Wake::after(every, every, WakeWhy::BudgetHeld { every })
            }
            Some(_) => next_wake(record, now, timers, spec_valid),
        }
    }
}

/// The Proxy's key, its instance's name and the owner stamped on the instance.
fn identify(proxy: &Proxy) -> Result<(ProxyKey, String, Owner), ReconcileError> {
    let namespace = proxy
        .metadata
        .namespace
        .as_deref()
        .ok_or(ReconcileError::MalformedObject("namespace"))?;
    let name = proxy
        .metadata
        .name
        .as_deref()
        .ok_or(ReconcileError::MalformedObject("name"))?;
    let uid = proxy
        .metadata
        .uid
        .clone()
        .ok_or(ReconcileError::MalformedObject("uid"))?;
    let instance = instance_name(namespace, name, &uid);
    let owner = Owner {
        uid,
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    };
    Ok((ProxyKey::new(namespace, name), instance, owner))
}

/// The user edited the spec since the status was last written.
fn spec_edited(proxy: &Proxy) -> bool {
    proxy
        .status
        .as_ref()
        .is_some_and(|status| proxy.metadata.generation != status.observed_generation)
}
