//! Scenarios: a start state and a list of timed events, replayed through [`decide`].
//!
//! A scenario file (`machines/scenarios/*.yaml`) reads:
//!
//! ```yaml
//! name: create-to-healthy
//! description: A new Proxy is provisioned and passes its health checks.
//! start: {phase: pending}                          # optional; default: the initial state
//! input: {max_create_attempts: 3, active_leases: 0} # optional; default: GuardInput::default()
//! steps:
//!   - {at: 0, event: spec_observed}                 # at: seconds since the start
//!   - {at: 40, event: deletion_requested, input: {active_leases: 2}}
//! ```
//!
//! A step's `input` overrides are sticky: they model the world changing from then on. Replaying
//! yields a [`Replay`]: one [`ReplayStep`] per event (transitioned, ignored or invalid; an invalid
//! event is reported and the replay continues) plus the [`Audit`] of the transitions. Times are
//! relative to a fixed epoch, so replays are deterministic and snapshot as they are.
//! Tests build scenarios in code with the same types ([`Scenario::new`], [`Step::at`]).

use std::path::{Path, PathBuf};

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::audit::{self, Audit, Line};
use super::effects::EffectKind;
use super::guards::GuardInput;
use super::table::{Event, Phase, State};
use super::{Outcome, decide};

/// The instant scenario time 0 maps to (any fixed instant would do; output shows offsets).
pub const EPOCH: Timestamp = Timestamp::constant(1_735_689_600, 0); // 2025-01-01T00:00:00Z

/// Why a scenario cannot be loaded.
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
    /// A step names an event the table does not know.
    #[error("step {step} (at +{at}s): unknown event `{name}`; known events: {known}")]
    UnknownEvent {
        /// 1-based step number.
        step: usize,
        /// The step's time.
        at: u64,
        /// The unknown name.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// `start.phase` names a state the table does not know.
    #[error("start: unknown phase `{name}`; known phases: {known}")]
    UnknownPhase {
        /// The unknown name.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// Steps must be in time order.
    #[error("step {step}: at {at}s is before the previous step's {previous}s")]
    TimeGoesBackwards {
        /// 1-based step number.
        step: usize,
        /// The step's time.
        at: u64,
        /// The previous step's time.
        previous: u64,
    },
}

/// Changes to the [`GuardInput`] from a step on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputOverride {
    /// New `max_create_attempts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_create_attempts: Option<u32>,
    /// New `active_leases`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_leases: Option<u32>,
}

impl InputOverride {
    fn apply(&self, input: &mut GuardInput) {
        if let Some(n) = self.max_create_attempts {
            input.max_create_attempts = n;
        }
        if let Some(n) = self.active_leases {
            input.active_leases = n;
        }
    }
}

/// One timed event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Seconds since the start.
    pub at: u64,
    /// The event.
    pub event: Event,
    /// Input changes that apply from this step on.
    pub input: InputOverride,
}

impl Step {
    /// `event` at `at` seconds.
    pub fn at(at: u64, event: Event) -> Step {
        Step {
            at,
            event,
            input: InputOverride::default(),
        }
    }

    /// From this step on, `n` leases are active.
    pub fn active_leases(mut self, n: u32) -> Step {
        self.input.active_leases = Some(n);
        self
    }

    /// From this step on, allow `n` create attempts per episode.
    pub fn max_create_attempts(mut self, n: u32) -> Step {
        self.input.max_create_attempts = Some(n);
        self
    }
}

/// A named list of timed events from a start state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// Short name.
    pub name: String,
    /// What the scenario shows.
    pub description: String,
    /// The state at time 0.
    pub start: State,
    /// Guard input at time 0.
    pub input: GuardInput,
    /// Steps in time order.
    pub steps: Vec<Step>,
}

impl Scenario {
    /// An empty scenario starting in the initial state with default input.
    pub fn new(name: impl Into<String>) -> Scenario {
        Scenario {
            name: name.into(),
            description: String::new(),
            start: State::default(),
            input: GuardInput::default(),
            steps: Vec::new(),
        }
    }

    /// Set the description.
    pub fn describe(mut self, description: impl Into<String>) -> Scenario {
        self.description = description.into();
        self
    }

    /// Start in `phase` entered at time 0, with `attempts` if the phase counts them.
    pub fn starting_in(mut self, phase: Phase, attempts: u32) -> Scenario {
        self.start = State::from_parts(phase, EPOCH, attempts);
        self
    }

    /// Start with this input.
    pub fn with_input(mut self, input: GuardInput) -> Scenario {
        self.input = input;
        self
    }

    /// Add `event` at `at` seconds.
    pub fn at(self, at: u64, event: Event) -> Scenario {
        self.step(Step::at(at, event))
    }

    /// Add a step.
    pub fn step(mut self, step: Step) -> Scenario {
        self.steps.push(step);
        self
    }

    /// Parse a scenario document; `path` only labels errors.
    pub fn from_yaml(text: &str, path: &Path) -> Result<Scenario, ScenarioError> {
        let file: ScenarioFile = serde_norway::from_str(text).map_err(|source| ScenarioError::Parse {
            path: path.to_owned(),
            source,
        })?;
        file.into_scenario()
    }

    /// Read and parse a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.to_owned(),
            source,
        })?;
        Scenario::from_yaml(&text, path)
    }

    /// Replay every step from the start state.
    pub fn replay(&self) -> Replay {
        let mut replayer = Replayer::new(self.start.clone(), self.input);
        for step in &self.steps {
            replayer.apply(step);
        }
        replayer.finish(self)
    }
}

/// Replay the scenario file at `path` and render its trail (what `egress-proxies-operator audit` prints).
pub fn replay_file(path: &Path) -> Result<String, ScenarioError> {
    Ok(Scenario::load(path)?.replay().render())
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOutcome {
    /// A row matched.
    Transitioned,
    /// The state ignores the event.
    Ignored,
    /// The table declares the event invalid in the state; the state is unchanged.
    Invalid,
}

/// One replayed step, with times relative to the scenario start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReplayStep {
    /// `+45s`.
    pub at: String,
    /// The event.
    pub event: Event,
    /// What happened.
    pub outcome: StepOutcome,
    /// Phase before.
    pub from: Phase,
    /// Phase after.
    pub to: Phase,
    /// The guard that selected the row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guard: Option<&'static str>,
    /// Effects requested.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<EffectKind>,
    /// The row's reason.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// `since` of the state after, relative to the start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// `attempts` of the state after, if it counts them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
}

/// The result of replaying a scenario.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Replay {
    /// Scenario name.
    pub name: String,
    /// Scenario description.
    pub description: String,
    /// Start phase.
    pub start: Phase,
    /// Input at the start.
    pub input: GuardInput,
    /// Every step.
    pub steps: Vec<ReplayStep>,
    /// The final state's phase.
    pub end: Phase,
    /// The audit trail (transitions only), with absolute times.
    #[serde(skip)]
    pub audit: Audit,
    /// The final state.
    #[serde(skip)]
    pub end_state: State,
}

impl Replay {
    /// A readable trail: a header, one aligned line per step, the end state.
    pub fn render(&self) -> String {
        let mut out = format!("scenario: {}\n", self.name);
        if !self.description.is_empty() {
            out.push_str(&format!("  {}\n", self.description.trim()));
        }
        out.push_str(&format!(
            "start: {}  (max_create_attempts={}, active_leases={})\n\n",
            self.start, self.input.max_create_attempts, self.input.active_leases
        ));
        let lines: Vec<Line> = self
            .steps
            .iter()
            .map(|s| match s.outcome {
                StepOutcome::Transitioned => Line {
                    offset: s.at.clone(),
                    arrow: audit::arrow(s.from, s.event, s.guard, s.to.as_str()),
                    effects: audit::format_effects(&s.effects),
                    reason: format!("({})", s.reason.unwrap_or_default()),
                },
                StepOutcome::Ignored => Line {
                    offset: s.at.clone(),
                    arrow: audit::arrow(s.from, s.event, None, "(ignored)"),
                    effects: String::new(),
                    reason: String::new(),
                },
                StepOutcome::Invalid => Line {
                    offset: s.at.clone(),
                    arrow: audit::arrow(s.from, s.event, None, "INVALID (state unchanged)"),
                    effects: String::new(),
                    reason: String::new(),
                },
            })
            .collect();
        out.push_str(&audit::render_lines(&lines));
        out.push_str(&format!("\nend: {}\n", self.end));
        out
    }
}

/// Applies steps one by one; tests use it to interrupt a replay (crash) and resume it.
#[derive(Clone, Debug)]
pub struct Replayer {
    state: State,
    input: GuardInput,
    audit: Audit,
    steps: Vec<ReplayStep>,
}

impl Replayer {
    /// Start from `state` with `input`.
    pub fn new(state: State, input: GuardInput) -> Replayer {
        Replayer {
            state,
            input,
            audit: Audit::new(),
            steps: Vec::new(),
        }
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Replace the current state (a rehydrated one, after a simulated restart).
    pub fn set_state(&mut self, state: State) {
        self.state = state;
    }

    /// The audit trail so far.
    pub fn audit(&self) -> &Audit {
        &self.audit
    }

    /// Apply one step and return what it did.
    pub fn apply(&mut self, step: &Step) -> &ReplayStep {
        step.input.apply(&mut self.input);
        let now = at(step.at);
        let from = self.state.phase();
        let record = match decide(&self.state, step.event, &self.input, now) {
            Ok(decision) => {
                self.audit.record(&decision, now);
                self.state = decision.to.clone();
                let outcome = match decision.outcome {
                    Outcome::Transitioned => StepOutcome::Transitioned,
                    Outcome::Ignored => StepOutcome::Ignored,
                };
                let data = self.state.data();
                ReplayStep {
                    at: audit::format_offset(offset(now)),
                    event: step.event,
                    outcome,
                    from,
                    to: self.state.phase(),
                    guard: decision.guard(),
                    effects: decision.effects,
                    reason: decision.row.map(|r| r.reason),
                    since: (outcome == StepOutcome::Transitioned)
                        .then_some(data.since)
                        .flatten()
                        .map(|s| audit::format_offset(offset(s))),
                    attempts: (outcome == StepOutcome::Transitioned
                        && self.state.phase().data_fields().contains(&"attempts"))
                    .then_some(data.attempts),
                }
            }
            Err(invalid) => ReplayStep {
                at: audit::format_offset(offset(now)),
                event: invalid.event,
                outcome: StepOutcome::Invalid,
                from,
                to: from,
                guard: None,
                effects: Vec::new(),
                reason: None,
                since: None,
                attempts: None,
            },
        };
        self.steps.push(record);
        self.steps.last().expect("invariant: a step was just pushed")
    }

    /// Finish the replay of `scenario`.
    pub fn finish(self, scenario: &Scenario) -> Replay {
        Replay {
            name: scenario.name.clone(),
            description: scenario.description.clone(),
            start: scenario.start.phase(),
            input: scenario.input,
            steps: self.steps,
            end: self.state.phase(),
            audit: self.audit,
            end_state: self.state,
        }
    }
}

/// Scenario time `secs` as an instant.
pub fn at(secs: u64) -> Timestamp {
    let secs = i64::try_from(secs).unwrap_or(i64::MAX);
    EPOCH
        .checked_add(jiff::SignedDuration::from_secs(secs))
        .unwrap_or(Timestamp::MAX)
}

fn offset(t: Timestamp) -> i64 {
    t.duration_since(EPOCH).as_secs()
}

/// The file form; event and phase names are strings so errors can name the step.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    start: Option<StartFile>,
    #[serde(default)]
    input: Option<GuardInput>,
    steps: Vec<StepFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartFile {
    phase: String,
    #[serde(default)]
    attempts: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepFile {
    at: u64,
    event: String,
    #[serde(default)]
    input: InputOverride,
}

impl ScenarioFile {
    fn into_scenario(self) -> Result<Scenario, ScenarioError> {
        let start = match self.start {
            None => State::default(),
            Some(start) => {
                let phase = Phase::from_name(&start.phase).ok_or_else(|| ScenarioError::UnknownPhase {
                    name: start.phase.clone(),
                    known: join(Phase::ALL.iter().map(|p| p.as_str())),
                })?;
                // A provisioning start without attempts has issued its first create.
                State::from_parts(phase, EPOCH, start.attempts.unwrap_or(1))
            }
        };
        let mut steps = Vec::with_capacity(self.steps.len());
        let mut previous = 0;
        for (i, s) in self.steps.into_iter().enumerate() {
            let step = i + 1;
            let event = Event::from_name(&s.event).ok_or_else(|| ScenarioError::UnknownEvent {
                step,
                at: s.at,
                name: s.event.clone(),
                known: join(Event::ALL.iter().map(|e| e.as_str())),
            })?;
            if s.at < previous {
                return Err(ScenarioError::TimeGoesBackwards {
                    step,
                    at: s.at,
                    previous,
                });
            }
            previous = s.at;
            steps.push(Step {
                at: s.at,
                event,
                input: s.input,
            });
        }
        Ok(Scenario {
            name: self.name,
            description: self.description,
            start,
            input: self.input.unwrap_or_default(),
            steps,
        })
    }
}

fn join<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}
