//! The replay: one reconcile per scenario step against the scripted world, and the trail it
//! renders.

use std::sync::Arc;

use jiff::Timestamp;

use super::objects::{InMemory, ProxyObjects, sim_proxy};
use super::world::{
    INSTANCE, ScriptedBackend, SimHealth, SimLeases, SimProvider, USER_DATA, World, WorldView,
};
use super::{EPOCH, PROVIDER, Scenario, ScenarioError};
use crate::{
    api::{ProxyStatus, RECYCLE_ANNOTATION},
    controller::{
        ProviderAvailability, ReconcileOutcome, Reconciler,
        plan::Planned,
        spec_hash,
        status::{FINALIZER, PROVISIONED, READY, REMEDIATION_PAUSED, Record, SPEC_VALID},
    },
    effects::BackendError,
    machine::{AuditEntry, Phase, audit},
    provider::{Endpoint, Installation, ProviderRegistry},
};

impl Scenario {
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
        world.configure(&self.config);
        let step_failed = |at: u64, err: BackendError| ScenarioError::Reconcile {
            name: self.name.clone(),
            at,
            message: format!("the Proxy's store failed: {err}"),
        };
        let mut proxy = sim_proxy();
        if let Some(provider) = &self.start.provider {
            proxy.spec.provider = provider.clone();
        }
        // The thresholds probes are judged by until the health engine is given the check.
        world.set_check(&proxy.spec.health);
        let mut deleted_at_start = false;
        if let Some(phase) = self.start.phase.as_deref().and_then(Phase::from_name) {
            let mut record = Record::new(EPOCH);
            record.state = crate::machine::State::new(phase, EPOCH);
            let live = !matches!(phase, Phase::Pending | Phase::Deleted);
            let hash = live.then(|| spec_hash::for_spec(&proxy.spec, Some(USER_DATA)));
            world.start_in(phase, self.start.leases, hash.clone());
            if live {
                record.spec_hash = hash;
                record.provider_id = Some(format!("sim/{PROVIDER}/{INSTANCE}"));
                record.endpoint = Some(Endpoint {
                    host: "127.0.0.1".to_owned(),
                    port: 3128,
                });
                record.instance_running = true;
                proxy.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
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
        'steps: for (index, step) in self.steps.iter().enumerate() {
            let (changes, edits) = world.apply(step, at_time(step.at), reconciler.pools());
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
            if let Some(edit) = &edits.spec_edit
                && let Some(mut current) = objects.get().await.map_err(|e| step_failed(step.at, e))?
            {
                edit.apply_to(&mut current.spec);
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
            if let Some(request) = &edits.recycle {
                objects
                    .annotate(RECYCLE_ANNOTATION, request)
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
                    targets: None,
                    crashed: false,
                    outcome: ReconcileOutcome {
                        phase: Some(Phase::Deleted),
                        ..ReconcileOutcome::default()
                    },
                    written: None,
                    woke: false,
                    world: world.snapshot(false),
                });
                break;
            };
            // The step's reconcile, then (with `follow_wakeups`) the ones the operator asks for
            // before the next step, as a runner would run them.
            let gap_end = self
                .steps
                .get(index + 1)
                .map_or(step.at.saturating_add(REST_AFTER), |next| next.at);
            let (mut at, mut changes, mut crash, mut current) = (step.at, changes, step.crash, current);
            let mut woken = 0;
            loop {
                world.set_crashing(crash);
                let outcome =
                    reconciler
                        .reconcile(&current)
                        .await
                        .map_err(|err| ScenarioError::Reconcile {
                            name: self.name.clone(),
                            at,
                            message: err.to_string(),
                        })?;
                let written = world.take_written();
                let stored = objects.get().await.map_err(|e| step_failed(at, e))?;
                match &stored {
                    Some(stored) => status = stored.status.clone(),
                    // Gone (deleted): its last status is the last one written.
                    None if !crash => status = written.clone().or(status),
                    None => {}
                }
                // What an edit of attributes, limits or health settings reached (no transition
                // shows it: it is upkeep, not a lifecycle step).
                let targets = (woken == 0 && step.world.edit.is_some()).then(|| world.targets());
                let (phase, requeue_after) = (outcome.phase, outcome.requeue_after);
                steps.push(ReplayedStep {
                    at,
                    changes,
                    targets,
                    crashed: crash,
                    outcome,
                    written,
                    woke: woken > 0,
                    world: world.snapshot(stored.is_some()),
                });
                if phase == Some(Phase::Deleted) {
                    break 'steps;
                }
                let (true, Some(after), Some(next)) = (self.config.follow_wakeups, requeue_after, stored)
                else {
                    break;
                };
                // Whole seconds, rounded up: a runner never wakes earlier than asked.
                let after = after.as_secs() + u64::from(after.subsec_nanos() > 0);
                woken += 1;
                if at + after >= gap_end || woken > MAX_WAKEUPS_PER_GAP {
                    break;
                }
                at += after;
                world.set_now(at_time(at));
                (changes, crash, current) = (vec!["wakes up".to_owned()], false, next);
            }
        }
        Ok(Replay {
            name: self.name.clone(),
            description: self.description.clone(),
            steps,
            status,
            creates: world.creates(),
        })
    }
}

/// With `follow_wakeups`, how long after the last step the operator is followed.
const REST_AFTER: u64 = 600;

/// With `follow_wakeups`, the most wake-ups followed between two steps: a wake-up loop that
/// does not let time pass stops here (and shows as that many reconciles at one instant).
pub const MAX_WAKEUPS_PER_GAP: u32 = 1000;

/// Scenario second `at` as an instant.
fn at_time(at: u64) -> Timestamp {
    EPOCH
        .checked_add(jiff::SignedDuration::from_secs(
            i64::try_from(at).unwrap_or(i64::MAX),
        ))
        .unwrap_or(Timestamp::MAX)
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct ReplayedStep {
    /// Seconds since the start.
    pub at: u64,
    /// The world changes and failures of the step, as text.
    pub changes: Vec<String>,
    /// After an edit of attributes, lease limits or health settings: what the lease store and
    /// the health engine were given.
    pub targets: Option<String>,
    /// The status write was lost to a crash.
    pub crashed: bool,
    /// What the reconcile did: its transitions, their plans, the phase after it and when it
    /// asked to look again.
    pub outcome: ReconcileOutcome,
    /// The status the reconcile wrote (even if a crash lost it), if it wrote one.
    pub written: Option<ProxyStatus>,
    /// A reconcile the operator asked for (`follow_wakeups`), not a scripted step.
    pub woke: bool,
    /// The world after the reconcile.
    pub world: WorldView,
}

impl ReplayedStep {
    /// The phase after the step's reconcile.
    pub fn phase(&self) -> Phase {
        self.outcome.phase.unwrap_or(Phase::INITIAL)
    }
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
        self.steps.iter().flat_map(|s| &s.outcome.audit)
    }

    /// The phase at the end.
    pub fn end(&self) -> Phase {
        self.steps.last().map_or(Phase::INITIAL, ReplayedStep::phase)
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
            if step.outcome.audit.is_empty() {
                out.push_str("      (no transition)\n");
            }
            let lines: Vec<audit::Line> = step
                .outcome
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
                .outcome
                .plans
                .iter()
                .flat_map(|p| &p.effects)
                .filter_map(|e| match e {
                    Planned::ScheduleRetry {
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
            if let Some(targets) = &step.targets {
                out.push_str(&format!("      {targets}\n"));
            }
            let wake = match step.outcome.requeue_after {
                Some(d) => format!(
                    "looks again in {}",
                    audit::format_offset(i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
                        .trim_start_matches('+')
                ),
                None => "waits for a change".to_owned(),
            };
            let wake = match (&step.outcome.wake_why, step.outcome.requeue_after) {
                (Some(why), Some(_)) => format!("{wake} ({})", why.describe(offset)),
                // It says itself what it waits for.
                (Some(why), None) => why.describe(offset),
                (None, _) => wake,
            };
            let crash = if step.crashed {
                "  CRASH: the status write is lost"
            } else {
                ""
            };
            out.push_str(&format!("      => {}; {wake}{crash}\n", step.phase()));
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
    if let Some(ready) = condition(READY) {
        parts.push(format!("Ready={}/{}", ready.status, ready.reason));
    }
    for type_ in [PROVISIONED, SPEC_VALID, REMEDIATION_PAUSED] {
        if let Some(c) = condition(type_)
            && (c.status != "True" || type_ == REMEDIATION_PAUSED)
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
