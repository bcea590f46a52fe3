//! The health engine: probes every proxy by fetching its health URL **through** it, keeps a
//! [`HealthSnapshot`] per proxy, and tells the controller when a threshold is crossed.
//!
//! It owns the probe schedule, the probes and the snapshots, and the health executor's
//! interface, [`HealthControl`], which the engine implements and the reconciler calls; it
//! writes no status (the reconciler does, from [`HealthEvent`]s and snapshots).
//!
//! - **Schedule.** Each proxy is probed on its own interval, ±10 % jitter. A new proxy is probed
//!   at once: a running instance must not wait a random part of its first interval to become
//!   Healthy (time to Healthy should not depend on luck); 10k proxies added at once are bounded
//!   by [`HealthConfig::max_concurrent_probes`], and the probe after each one's first verdict
//!   comes at a random point within its interval, which spreads them out (the jitter alone
//!   would keep them a wave for many intervals). One
//!   probe per proxy is in flight at a time; at most [`HealthConfig::max_concurrent_probes`] in
//!   all. State
//!   is one map entry and one heap entry per proxy: memory grows with proxies, not with time.
//! - **Probe.** `http://` URLs are fetched with an absolute-form `GET` to the proxy; `https://`
//!   ones through a `CONNECT` tunnel, then TLS (rustls, platform roots or
//!   [`HealthConfig::tls_roots`]). Credentials go in `Proxy-Authorization: Basic`. A probe
//!   passes on a 2xx answer within the timeout whose body (first 64 KiB) contains the expected
//!   egress address, if one is set. Errors name the step that failed, never the URL or the
//!   credentials.
//! - **Verdict.** `Unknown` until `success_threshold` consecutive passes (`Passing`) or
//!   `failure_threshold` consecutive failures (`Failing`). An event is sent only when the verdict
//!   changes: Unknown→Passing, Unknown→Failing, Passing→Failing, Failing→Passing
//!   (`recovered: true`). Upserting a target again keeps its counters unless its endpoint or URL
//!   changed.
//! - **Hold.** What sees traffic the probes do not (the gateway's rules) may hold a verdict
//!   `Failing` for a while ([`HealthHandle::hold_failing`], [`hold`]): the lifecycle then takes
//!   the proxy out of rotation as for failed probes, and it recovers as from them.
//!
//! The engine runs until every [`HealthHandle`] is dropped.

mod control;
mod hold;
mod probe;
mod verdict;

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    net::IpAddr,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::{
    sync::{Notify, Semaphore, mpsc},
    time::Instant,
};
use tokio_rustls::rustls;

use crate::{
    api::ProxyKey,
    provider::{Credentials, Endpoint},
    telemetry::{ProbeMetrics, ProbeResult},
};
pub use control::HealthControl;
pub use probe::ProbeError;
use verdict::apply;
pub use verdict::next_verdict;

/// Longest `last_error` kept, in bytes.
pub const MAX_ERROR_LEN: usize = 256;

/// Engine-wide settings.
#[derive(Clone, Debug)]
pub struct HealthConfig {
    /// Probes in flight at once, across all proxies.
    pub max_concurrent_probes: usize,
    /// Fraction of the interval by which each probe moves at random (0.1 = ±10 %).
    pub jitter: f64,
    /// Trust roots for `https://` URLs; `None` loads the platform's.
    pub tls_roots: Option<Arc<rustls::RootCertStore>>,
    /// Most body bytes read to look for the egress address.
    pub max_body_bytes: usize,
    /// Capacity of the event channel (the engine waits when it is full).
    pub event_capacity: usize,
    /// Where probe durations are recorded (`epo_probe_duration_seconds`), if anywhere.
    pub probe_metrics: Option<ProbeMetrics>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            max_concurrent_probes: 256,
            jitter: 0.1,
            tls_roots: None,
            max_body_bytes: 64 * 1024,
            event_capacity: 1024,
            probe_metrics: None,
        }
    }
}

/// One proxy to probe.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthTarget {
    /// The Proxy.
    pub key: ProxyKey,
    /// Where the proxy listens.
    pub endpoint: Endpoint,
    /// What to fetch through it (`http://` or `https://`).
    pub url: String,
    /// Between two probes.
    pub interval: Duration,
    /// Longest a probe may take.
    pub timeout: Duration,
    /// Consecutive failures that make the verdict `Failing`.
    pub failure_threshold: u32,
    /// Consecutive passes that make the verdict `Passing`.
    pub success_threshold: u32,
    /// If set, the response body must contain this address.
    pub expected_egress: Option<IpAddr>,
    /// Sent as `Proxy-Authorization: Basic`.
    pub credentials: Option<Credentials>,
}

/// The engine's judgement of one proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Not enough probes yet.
    Unknown,
    /// Passed `success_threshold` probes in a row (and has not failed enough since).
    Passing,
    /// Failed `failure_threshold` probes in a row (and has not passed enough since).
    Failing,
}

/// What the engine knows about one proxy.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthSnapshot {
    /// Current verdict.
    pub verdict: Verdict,
    /// Passes in a row.
    pub consecutive_successes: u32,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Duration of the last passing probe.
    pub last_latency: Option<Duration>,
    /// Why the last probe failed (`None` after a pass).
    pub last_error: Option<String>,
    /// When the last probe finished.
    pub last_probe_at: Option<jiff::Timestamp>,
    /// When the verdict last changed.
    pub verdict_since: Option<jiff::Timestamp>,
    /// The verdict is `Passing` and was `Failing` before (a recovery, not a first pass).
    pub recovered: bool,
    /// Probes since the target was added (or its endpoint or URL changed).
    pub probes: u64,
}

impl Default for HealthSnapshot {
    fn default() -> Self {
        Self {
            verdict: Verdict::Unknown,
            consecutive_successes: 0,
            consecutive_failures: 0,
            last_latency: None,
            last_error: None,
            last_probe_at: None,
            verdict_since: None,
            recovered: false,
            probes: 0,
        }
    }
}

/// A threshold crossing.
#[derive(Clone, Debug, PartialEq)]
pub struct HealthEvent {
    /// The Proxy.
    pub key: ProxyKey,
    /// The new verdict.
    pub verdict: Verdict,
    /// When it changed.
    pub at: jiff::Timestamp,
    /// Failing → Passing.
    pub recovered: bool,
    /// The last probe's error, for Failing.
    pub last_error: Option<String>,
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// The TLS client could not be set up.
    #[error("TLS client setup: {0}")]
    Tls(String),
}

struct Entry {
    target: Arc<HealthTarget>,
    /// Bumped when endpoint or URL change: results of older probes are dropped.
    identity: u64,
    /// Bumped on every (re)schedule: older heap entries are stale.
    schedule: u64,
    in_flight: bool,
    snapshot: HealthSnapshot,
    /// Held failing until then, whatever probes say ([`HealthHandle::hold_failing`]).
    hold: Option<hold::Hold>,
}

struct Table {
    entries: HashMap<ProxyKey, Entry>,
    heap: BinaryHeap<Reverse<(Instant, u64, ProxyKey)>>,
    next_gen: u64,
}

impl Table {
    fn next_generation(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    fn schedule(&mut self, key: &ProxyKey, at: Instant) {
        let generation = self.next_generation();
        if let Some(e) = self.entries.get_mut(key) {
            e.schedule = generation;
            self.heap.push(Reverse((at, generation, key.clone())));
        }
        // Stale entries pile up when targets are rescheduled or removed: rebuild when they
        // outnumber live ones, so memory stays proportional to the number of proxies.
        if self.heap.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            let heap = std::mem::take(&mut self.heap);
            self.heap = heap
                .into_iter()
                .filter(|Reverse((_, g, k))| entries.get(k).is_some_and(|e| e.schedule == *g))
                .collect();
        }
    }
}

struct State {
    table: Mutex<Table>,
    wake: Notify,
    closed: AtomicBool,
    config: HealthConfig,
    /// Where verdict changes go (also those a hold makes).
    events: mpsc::Sender<HealthEvent>,
}

impl State {
    fn table(&self) -> MutexGuard<'_, Table> {
        // No code path panics while holding the lock with the table half-updated.
        crate::sync::lock(&self.table)
    }
}

struct HandleInner {
    state: Arc<State>,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.state.closed.store(true, Ordering::SeqCst);
        self.state.wake.notify_one();
    }
}

/// Controls the engine; cheap to clone. The engine stops when the last clone is dropped.
#[derive(Clone)]
pub struct HealthHandle {
    inner: Arc<HandleInner>,
}

/// Starts health engines.
pub struct HealthEngine;

/// How long until a proxy's next probe, after one that `settled` its verdict for the first
/// time (from `Unknown`) or not. Proxies added together are probed together at once; the jitter
/// alone would keep them a wave for many intervals, so the probe after the first verdict comes
/// at a random point within the interval (never later than it), and spreads them out.
fn next_probe_in(interval: Duration, jitter: f64, settled: bool) -> Duration {
    if settled {
        return interval.mul_f64(fastrand::f64());
    }
    let factor = 1.0 + jitter * (fastrand::f64() * 2.0 - 1.0);
    interval.mul_f64(factor.max(0.0))
}

impl HealthEngine {
    /// Starts the engine on the current Tokio runtime.
    pub fn start(config: HealthConfig) -> Result<(HealthHandle, mpsc::Receiver<HealthEvent>), HealthError> {
        let roots = match &config.tls_roots {
            Some(roots) => roots.clone(),
            None => Arc::new(probe::platform_roots()),
        };
        let connector = probe::tls_connector(roots)?;
        let (tx, rx) = mpsc::channel(config.event_capacity.max(1));
        let state = Arc::new(State {
            table: Mutex::new(Table {
                entries: HashMap::new(),
                heap: BinaryHeap::new(),
                next_gen: 0,
            }),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            config,
            events: tx.clone(),
        });
        tokio::spawn(scheduler(state.clone(), tx, Arc::new(connector)));
        Ok((
            HealthHandle {
                inner: Arc::new(HandleInner { state }),
            },
            rx,
        ))
    }
}

impl HealthHandle {
    fn state(&self) -> &State {
        &self.inner.state
    }

    /// Adds a proxy or updates its probe settings. Counters are kept unless the endpoint or
    /// the URL changed (then the proxy starts again from `Unknown`, probed soon).
    pub fn upsert(&self, target: HealthTarget) {
        let state = self.state();
        let now = Instant::now();
        let mut guard = state.table();
        let table = &mut *guard;
        let key = target.key.clone();
        let first = match table.entries.get_mut(&key) {
            None => {
                let identity = table.next_generation();
                table.entries.insert(
                    key.clone(),
                    Entry {
                        target: Arc::new(target),
                        identity,
                        schedule: 0,
                        in_flight: false,
                        snapshot: HealthSnapshot::default(),
                        hold: None,
                    },
                );
                // Probed at once (see the module docs); the interval applies from then on.
                Some(Duration::ZERO)
            }
            Some(entry) if entry.target.endpoint != target.endpoint || entry.target.url != target.url => {
                entry.target = Arc::new(target);
                entry.snapshot = HealthSnapshot::default();
                // A new instance: what held the old one failing is not about it.
                entry.hold = None;
                // A probe in flight reports on the old endpoint or URL: its result is dropped
                // (identity changes) and the new one is probed at once.
                entry.in_flight = false;
                let identity = table.next_generation();
                if let Some(entry) = table.entries.get_mut(&key) {
                    entry.identity = identity;
                }
                Some(Duration::ZERO)
            }
            Some(entry) => {
                let interval_changed = entry.target.interval != target.interval;
                entry.target = Arc::new(target);
                (interval_changed && !entry.in_flight).then(|| entry.target.interval.mul_f64(fastrand::f64()))
            }
        };
        if let Some(delay) = first {
            table.schedule(&key, now + delay);
        }
        drop(guard);
        state.wake.notify_one();
    }

    /// Stops probing a proxy and forgets its snapshot.
    pub fn remove(&self, key: &ProxyKey) {
        self.state().table().entries.remove(key);
    }

    /// Probes a proxy as soon as a slot is free (unless a probe is in flight).
    pub fn probe_now(&self, key: &ProxyKey) {
        let mut table = self.state().table();
        if table.entries.get(key).is_some_and(|e| !e.in_flight) {
            table.schedule(key, Instant::now());
        }
        drop(table);
        self.state().wake.notify_one();
    }

    /// The latest snapshot of a proxy.
    pub fn snapshot(&self, key: &ProxyKey) -> Option<HealthSnapshot> {
        self.state().table().entries.get(key).map(|e| e.snapshot.clone())
    }

    /// Number of proxies probed.
    pub fn len(&self) -> usize {
        self.state().table().entries.len()
    }

    /// Whether no proxy is probed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

async fn scheduler(
    state: Arc<State>,
    events: mpsc::Sender<HealthEvent>,
    tls: Arc<tokio_rustls::TlsConnector>,
) {
    let permits = Arc::new(Semaphore::new(state.config.max_concurrent_probes.max(1)));
    loop {
        if state.closed.load(Ordering::SeqCst) {
            return;
        }
        // Take one due target at a time, so a full semaphore delays the rest in order.
        let (due, next) = {
            let now = Instant::now();
            let mut table = state.table();
            let mut due = None;
            while let Some(Reverse((at, generation, key))) = table.heap.peek().cloned() {
                if at > now {
                    break;
                }
                table.heap.pop();
                if let Some(e) = table.entries.get_mut(&key)
                    && e.schedule == generation
                    && !e.in_flight
                {
                    e.in_flight = true;
                    due = Some((key, e.target.clone(), e.identity));
                    break;
                }
            }
            let next = table.heap.peek().map(|Reverse((at, _, _))| *at);
            (due, next)
        };
        match due {
            Some((key, target, identity)) => {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (state, events, tls) = (state.clone(), events.clone(), tls.clone());
                tokio::spawn(async move {
                    let started = Instant::now();
                    let result = probe::probe(&target, &tls, state.config.max_body_bytes).await;
                    let latency = started.elapsed();
                    drop(permit);
                    if let Some(metrics) = &state.config.probe_metrics {
                        metrics.observe(probe_result(&result), latency);
                    }
                    record(&state, &events, key, identity, result.map(|()| latency)).await;
                });
            }
            None => {
                let sleep = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = sleep => {}
                    _ = state.wake.notified() => {}
                }
            }
        }
    }
}

/// The metric label of a probe's outcome.
fn probe_result(result: &Result<(), ProbeError>) -> ProbeResult {
    match result {
        Ok(()) => ProbeResult::Ok,
        Err(ProbeError::Timeout(_)) => ProbeResult::Timeout,
        Err(_) => ProbeResult::Fail,
    }
}

/// Applies a probe result, sends the event if a threshold was crossed, then schedules the
/// next probe (after the event is accepted, so a proxy's events stay in order).
async fn record(
    state: &State,
    events: &mpsc::Sender<HealthEvent>,
    key: ProxyKey,
    identity: u64,
    result: Result<Duration, ProbeError>,
) {
    let now = jiff::Timestamp::now();
    let mut settled = false;
    let event = {
        let mut table = state.table();
        let Some(entry) = table.entries.get_mut(&key) else {
            return;
        };
        if entry.identity != identity {
            // The endpoint or URL changed while probing: the result is about the old one.
            return;
        }
        let held = hold::active(&mut entry.hold);
        apply(&mut entry.snapshot, &entry.target, result, held, now).map(|(old, verdict)| {
            settled = old == Verdict::Unknown;
            HealthEvent {
                key: key.clone(),
                verdict,
                at: now,
                recovered: old == Verdict::Failing && verdict == Verdict::Passing,
                last_error: entry.snapshot.last_error.clone(),
            }
        })
    };
    if let Some(event) = event {
        // `last_error` is left out when there is none (a pass).
        tracing::info!(
            proxy = %key,
            verdict = ?event.verdict,
            recovered = event.recovered,
            last_error = event.last_error.as_deref(),
            "health verdict changed"
        );
        // A closed receiver means nobody listens any more; keep probing for snapshots.
        let _ = events.send(event).await;
    }
    let mut table = state.table();
    let Some(entry) = table.entries.get_mut(&key) else {
        return;
    };
    if entry.identity != identity {
        return;
    }
    entry.in_flight = false;
    let delay = next_probe_in(entry.target.interval, state.config.jitter, settled);
    table.schedule(&key, Instant::now() + delay);
    drop(table);
    state.wake.notify_one();
}

#[cfg(test)]
mod tests;
