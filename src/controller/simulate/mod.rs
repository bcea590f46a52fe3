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
//!                                             # starts with its instance running and passing;
//!                                             # `provider: NAME` names an unknown provider
//! steps:
//!   - at: 0                                   # seconds since the start: the clock
//!     fail: {create_instance: {times: 2, kind: transient, message: "disk full"}}
//!   - {at: 10}                                # just time passing: the operator looks again
//!   - {at: 30, world: {health: passing}}
//!   - {at: 60, world: {spec: v2}, crash: true}  # effects run, the status write is lost
//!   - {at: 70, world: {cloud_init: r2}}       # the Secret's content: a new hash, same object
//!   - {at: 80, world: {probes: [pass, fail]}} # probe results, judged by the thresholds
//!   - {at: 90, world: {edit: {max_concurrent: 3, failure_threshold: 1}}}  # never replaces
//! ```
//!
//! Each step changes the world as it says (`world`), scripts failures of the next calls of an
//! effect (`fail`: `create_instance` or `delete_instance`; `kind`: `transient`, `permanent`,
//! `rejected` or `unavailable`), then runs one reconcile at `at` and records what it did. With
//! `crash: true` the operator dies after the effects and before the status write: the next step
//! starts from the status as it was. The world (one provider, the health verdict, the leases, the
//! pool) is in memory; the reconciler, the table, the planner and the status are the real ones.
//! With `config: {follow_wakeups: true}` the replay also runs the reconciles the operator asks
//! for between steps, as a runner would (`tests/machine_simulation.rs` relies on it).
//!
//! Files: [`scenario`] (the document and its checks), [`replay`] (the replay loop and the trail it
//! renders), [`world`] (the scripted provider, health and leases), [`objects`] (where the Proxy
//! object lives: in memory here, a mode's store in `tests/scenario_modes.rs`).

mod objects;
mod replay;
mod scenario;
mod world;

use std::path::{Path, PathBuf};

use jiff::Timestamp;

pub use objects::{InMemory, ProxyObjects};
pub use replay::{MAX_WAKEUPS_PER_GAP, Replay, ReplayedStep};
pub use scenario::{Expect, Failure, PoolChange, Scenario, SimConfig, SimStep, SpecEdit, Start, WorldChange};
pub use world::WorldView;

/// The instant scenario time 0 maps to (any fixed instant would do; output shows offsets).
pub const EPOCH: Timestamp = Timestamp::constant(1_735_689_600, 0); // 2025-01-01T00:00:00Z

/// The provider instance scenarios run on.
const PROVIDER: &str = "sim";

/// Why a scenario cannot be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file cannot be read.
    #[error("cannot read scenario {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The file is not a valid scenario document.
    #[error("invalid scenario {path}: {cause}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: serde_norway::Error,
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
