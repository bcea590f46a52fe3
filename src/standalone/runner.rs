//! The standalone runner: plays the API server's part over the manifests folder and the
//! embedded store. It turns manifest changes into generations, a vanished manifest into a
//! deletion (the finalizer keeps the record until the instance is gone), and schedules
//! reconciles by each Proxy's requeue time or an external trigger (a health verdict changed, a
//! provider's availability flipped).
//!
//! Must not touch: the lifecycle's decisions (the shared [`Reconciler`] makes them) or the
//! core's services (it is handed their executors in [`StandaloneDeps`]).

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use tokio::{sync::mpsc, time::Instant};
use tracing::{info, warn};

use super::{
    backend::{Records, Secrets, StandaloneBackend},
    due::DueQueue,
    manifests::{Desired, fingerprint, scan},
    progress::Progress,
    recycle::{RecycleAsk, annotations_of, take_annotations},
    store::{GatewayRecycle, ProxyRecord, Store, StoreError},
};

use crate::{
    api::ProxyKey,
    api::{Proxy, ProxySpec, RECYCLE_ANNOTATION},
    check::Checker,
    controller::{
        ProviderAvailability, Reconciler, ReconcilerConfig, error_backoff,
        status::{FINALIZER, PhaseTally, phase_of},
    },
    gateway::rules::RecycleError,
    health::HealthControl,
    lease::LeaseControl,
    provider::ProviderRegistry,
    telemetry::Metrics,
};

/// A standalone failure at start-up.
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    /// The state folder.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The manifests folder.
    #[error("manifests folder {0} does not exist or is not a folder")]
    Manifests(PathBuf),
}

/// The executors and providers standalone mode drives.
pub struct StandaloneDeps {
    /// Provider instances.
    pub providers: ProviderRegistry,
    /// Lease executor.
    pub leases: Arc<dyn LeaseControl>,
    /// Health engine.
    pub health: Arc<dyn HealthControl>,
    /// Provider availability.
    pub availability: ProviderAvailability,
    /// Reconciler knobs.
    pub reconciler: ReconcilerConfig,
}

/// The standalone runner.
pub struct Standalone {
    manifests: PathBuf,
    store: Arc<Store>,
    records: Records,
    secrets: Secrets,
    progress: Arc<Progress>,
    reconciler: Reconciler<StandaloneBackend>,
    checker: Checker,
    last_fingerprint: Option<Vec<(PathBuf, u64, Option<std::time::SystemTime>)>>,
    due: DueQueue,
    failures: HashMap<ProxyKey, u32>,
    broken_files: usize,
    metrics: Option<Arc<Metrics>>,
    reconciles: u64,
    /// Proxies per phase for the progress line and metrics, kept up to date from `touched`.
    tally: PhaseTally<ProxyKey>,
    /// Proxies whose record may have changed since the progress was last updated: those
    /// reconciled (only a Proxy's own reconcile writes its status) and those the folder added,
    /// changed or removed.
    touched: HashSet<ProxyKey>,
    /// The progress line and metrics need setting (counts or broken files changed).
    progress_stale: bool,
    /// Records read to keep the phase counts ([`Self::phase_reads`]).
    phase_reads: u64,
    /// The gateway rules' recycle requests ([`super::recycle`]).
    recycle_asks: Option<mpsc::Receiver<RecycleAsk>>,
    /// When the runner opened: what each Proxy's resync phase counts from ([`resync_in`]).
    opened: Instant,
}

impl Standalone {
    /// Opens the state folder (locking it) and loads what it holds.
    pub fn open(manifests: &Path, state: &Path, deps: StandaloneDeps) -> Result<Self, StandaloneError> {
        if !manifests.is_dir() {
            return Err(StandaloneError::Manifests(manifests.to_owned()));
        }
        Self::with_store(manifests, Store::open(state)?, deps)
    }

    /// Loads what `store` (opened, so locked, by the caller) holds.
    pub fn with_store(manifests: &Path, store: Store, deps: StandaloneDeps) -> Result<Self, StandaloneError> {
        if !manifests.is_dir() {
            return Err(StandaloneError::Manifests(manifests.to_owned()));
        }
        let state = store.dir().to_owned();
        let store = Arc::new(store);
        let loaded: HashMap<ProxyKey, ProxyRecord> = store.reader().list()?.into_iter().collect();
        let now = Instant::now();
        let due = loaded.keys().map(|k| (k.clone(), now)).collect();
        info!(records = loaded.len(), state = %state.display(), "state loaded");
        let mut tally = PhaseTally::default();
        for (key, record) in &loaded {
            tally.note(key, record.status.as_ref());
        }
        let records: Records = Arc::new(Mutex::new(loaded));
        let secrets: Secrets = Arc::new(RwLock::new(HashMap::new()));
        let progress = Arc::new(Progress::default());
        let backend =
            StandaloneBackend::new(store.clone(), records.clone(), secrets.clone(), progress.clone());
        let StandaloneDeps {
            providers,
            leases,
            health,
            availability,
            reconciler: config,
        } = deps;
        let reconciler = Reconciler::new(backend, providers, leases, health, availability, config);
        // The pool budgets count every Proxy from the start, not only the ones reconciled so far.
        reconciler
            .pools()
            .seed(crate::sync::lock(&records).iter().map(|(key, record)| {
                let provider = record.provider().unwrap_or_default().to_owned();
                (key.clone(), provider, phase_of(record.status.as_ref()))
            }));
        Ok(Self {
            manifests: manifests.to_owned(),
            store,
            records,
            secrets,
            progress,
            reconciler,
            checker: Checker::new(None),
            last_fingerprint: None,
            due,
            failures: HashMap::new(),
            broken_files: 0,
            metrics: None,
            reconciles: 0,
            tally,
            touched: HashSet::new(),
            progress_stale: true,
            phase_reads: 0,
            recycle_asks: None,
            opened: Instant::now(),
        })
    }

    /// Records the gateway rules' recycle requests that arrive on `asks` (while running).
    pub fn with_recycle_requests(mut self, asks: mpsc::Receiver<RecycleAsk>) -> Self {
        self.recycle_asks = Some(asks);
        self
    }

    /// Records a recycle request of the gateway's rules in `key`'s record, durably, and
    /// reconciles it at the next step.
    fn recycle(&mut self, key: &ProxyKey, value: String) -> Result<(), RecycleError> {
        let mut records = crate::sync::lock(&self.records);
        let record = records
            .get_mut(key)
            .filter(|record| !record.deleting)
            .ok_or_else(|| RecycleError::Gone(key.clone()))?;
        record.gateway_recycle = Some(GatewayRecycle {
            value,
            over: record.annotations.get(RECYCLE_ANNOTATION).cloned(),
        });
        self.store.save(key, record).map_err(|e| RecycleError::Failed {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        drop(records);
        self.touched.insert(key.clone());
        self.due.insert(key.clone(), Instant::now());
        Ok(())
    }

    /// Records reconciles, transitions and proxies per phase in `metrics`, as cluster mode does.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Decide with `clock` instead of the system clock (tests and the rest benchmark run on
    /// tokio's paused time and map it to a timestamp).
    pub fn with_clock(self, clock: impl Fn() -> jiff::Timestamp + Send + Sync + 'static) -> Self {
        Self {
            reconciler: self.reconciler.with_clock(clock),
            ..self
        }
    }

    /// Records read so far to keep the progress line's phase counts: those that may have
    /// changed, never all of them at every step.
    pub fn phase_reads(&self) -> u64 {
        self.phase_reads
    }

    /// Reconciles run since the runner opened (what the rest benchmark and the storm tests count).
    pub fn reconciles(&self) -> u64 {
        self.reconciles
    }

    /// The progress view.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Reconcile `key` at the next step.
    pub fn trigger(&mut self, key: ProxyKey) {
        if crate::sync::lock(&self.records).contains_key(&key) {
            self.due.insert(key, Instant::now());
        }
    }

    /// Reconcile every Proxy placed on `provider` at the next step (its availability flipped:
    /// held Proxies provision at once instead of at their next retry).
    pub fn trigger_provider(&mut self, provider: &str) {
        let now = Instant::now();
        let records = crate::sync::lock(&self.records);
        for (key, record) in records.iter() {
            if record.provider() == Some(provider) {
                self.due.insert(key.clone(), now);
            }
        }
    }

    /// One round: pick up manifest changes, reconcile what is due. Returns when the next
    /// reconcile is due (if any).
    pub async fn step(&mut self) -> Option<Instant> {
        let current = fingerprint(&self.manifests);
        if self.last_fingerprint.as_ref() != Some(&current) {
            let desired = scan(&self.manifests, &self.checker);
            for problem in &desired.problems {
                warn!(%problem, "manifest rejected; its proxies keep their last valid version");
            }
            self.apply(desired);
            self.last_fingerprint = Some(current);
        }
        let now = Instant::now();
        for key in self.due.due_at(now) {
            self.reconcile(&key).await;
        }
        self.update_progress();
        self.due.next()
    }

    async fn reconcile(&mut self, key: &ProxyKey) {
        let Some(proxy) = self.proxy(key) else {
            self.due.remove(key);
            return;
        };
        let started = std::time::Instant::now();
        self.reconciles += 1;
        self.touched.insert(key.clone());
        let result = self.reconciler.reconcile(&proxy).await;
        if let Some(metrics) = &self.metrics {
            metrics.observe_reconcile(started.elapsed(), result.as_ref().err().map(|e| e.category()));
            for entry in result.iter().flat_map(|outcome| &outcome.audit) {
                metrics.observe_transition(entry.from.as_str(), entry.to.as_str(), &entry.reason);
            }
        }
        match result {
            Ok(outcome) => {
                self.failures.remove(key);
                let gone = !crate::sync::lock(&self.records).contains_key(key);
                match (gone, outcome.requeue_after) {
                    (true, _) => {
                        self.due.remove(key);
                        // A manifest re-added during the deletion is picked up now.
                        self.last_fingerprint = None;
                    }
                    (false, Some(after)) => {
                        let after = if outcome.resync_only {
                            resync_in(key, after, Instant::now() - self.opened)
                        } else {
                            after
                        };
                        self.due.insert(key.clone(), Instant::now() + after);
                    }
                    (false, None) => {
                        self.due.remove(key);
                    }
                }
            }
            Err(err) => {
                let failures = self.failures.entry(key.clone()).or_insert(0);
                *failures += 1;
                let delay = error_backoff(*failures);
                warn!(proxy = %key, category = err.category(), error = %err, retry_in = ?delay, "reconcile failed");
                self.due.insert(key.clone(), Instant::now() + delay);
            }
        }
    }

    /// Merges the folder's desired state into the records, like API writes would.
    fn apply(&mut self, desired: Desired) {
        let rotated = {
            let mut secrets = crate::sync::write(&self.secrets);
            let rotated = changed_secrets(&secrets, &desired.secrets);
            *secrets = desired.secrets;
            rotated
        };
        let now = jiff::Timestamp::now();
        let mut records = crate::sync::lock(&self.records);
        // A Secret's new content is part of its Proxies' spec hash: reconcile them now, as the
        // cluster's Secret watch does, not at the next resync.
        for (key, record) in records.iter() {
            if references_any(&record.spec, key.namespace(), &rotated) {
                self.due.insert(key.clone(), Instant::now());
            }
        }
        let mut changed = Vec::new();
        for (key, wanted) in &desired.proxies {
            let source = wanted.source.display().to_string();
            match records.get_mut(key) {
                // Deletion can't be undone; the manifest is picked up again once it completes.
                Some(record) if record.deleting => {}
                Some(record) if record.spec != wanted.spec_json => {
                    record.spec = wanted.spec_json.clone();
                    record.generation += 1;
                    record.source = source;
                    take_annotations(record, &wanted.annotations);
                    changed.push(key.clone());
                }
                // An annotation edit (a recycle request) moves no generation, as in a cluster.
                Some(record) if record.annotations != wanted.annotations => {
                    take_annotations(record, &wanted.annotations);
                    changed.push(key.clone());
                }
                Some(_) => {}
                None => {
                    records.insert(
                        key.clone(),
                        ProxyRecord {
                            uid: new_uid(),
                            generation: 1,
                            spec: wanted.spec_json.clone(),
                            source,
                            annotations: wanted.annotations.clone(),
                            created: now,
                            ..ProxyRecord::default()
                        },
                    );
                    changed.push(key.clone());
                }
            }
        }
        let mut gone = Vec::new();
        for (key, record) in records.iter_mut() {
            let source_broken = desired
                .broken_files
                .iter()
                .any(|f| f.display().to_string() == record.source);
            if !desired.proxies.contains_key(key) && !record.deleting && !source_broken {
                if !record.finalizer {
                    // As the API server does: an object without finalizers goes at once (the
                    // operator never added one, so it never made an instance to clean up).
                    gone.push(key.clone());
                    continue;
                }
                record.deleting = true;
                record.deletion_time = Some(now);
                // As the API server does when it marks an object deleted.
                record.generation += 1;
                changed.push(key.clone());
            }
        }
        for key in gone {
            records.remove(&key);
            self.touched.insert(key.clone());
            self.due.remove(&key);
            match self.store.remove(&key) {
                Ok(()) => info!(proxy = %key, "proxy deleted (it had no finalizer)"),
                Err(err) => warn!(proxy = %key, error = %err, "removing the record failed"),
            }
        }
        for key in changed {
            self.touched.insert(key.clone());
            if let Some(record) = records.get(&key)
                && let Err(err) = self.store.save(&key, record)
            {
                warn!(proxy = %key, error = %err, "saving the record failed");
            }
            self.due.insert(key, Instant::now());
        }
        drop(records);
        if self.broken_files != desired.broken_files.len() {
            self.broken_files = desired.broken_files.len();
            self.progress_stale = true;
        }
    }

    /// The Proxy object the reconciler sees, as the API server would serve it.
    fn proxy(&self, key: &ProxyKey) -> Option<Proxy> {
        let records = crate::sync::lock(&self.records);
        proxy_of(key, records.get(key)?)
    }

    /// Brings the phase counts up to date with the records touched since the last call (not
    /// every record: this runs at every step) and hands them on if they changed.
    fn update_progress(&mut self) {
        if !self.touched.is_empty() {
            let records = crate::sync::lock(&self.records);
            for key in self.touched.drain() {
                self.phase_reads += 1;
                self.progress_stale |= match records.get(&key) {
                    Some(record) => self.tally.note(&key, record.status.as_ref()),
                    None => self.tally.forget(&key),
                };
            }
        }
        if !std::mem::take(&mut self.progress_stale) {
            return;
        }
        let counts = self.tally.counts().clone();
        if let Some(metrics) = &self.metrics {
            metrics.set_phase_counts(&counts);
        }
        self.progress.set_counts(counts, self.broken_files);
    }

    /// Runs until `shutdown` resolves: steps whenever something is due, a trigger arrives (a
    /// Proxy's key, or the name of a provider whose availability flipped) or `poll` elapses
    /// (to notice manifest changes).
    pub async fn run(
        mut self,
        mut triggers: mpsc::Receiver<ProxyKey>,
        mut provider_flips: mpsc::UnboundedReceiver<String>,
        poll: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            let next = self.step().await;
            self.progress.print_if_changed();
            let wake = next.map_or(Instant::now() + poll, |at| at.min(Instant::now() + poll));
            tokio::select! {
                _ = &mut shutdown => break,
                Some(key) = triggers.recv() => self.trigger(key),
                Some(provider) = provider_flips.recv() => self.trigger_provider(&provider),
                Some(ask) = next_ask(&mut self.recycle_asks) => {
                    let recorded = self.recycle(&ask.key, ask.value);
                    // The gateway may have stopped waiting; the request stands either way.
                    let _ = ask.done.send(recorded);
                }
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
        info!("standalone mode stopped");
    }
}

/// How long until a Proxy at rest is resynced, `since_open` after the runner opened: at its
/// own phase of the `period`, from a hash of its key, so each Proxy is resynced once a period
/// and the Proxies evenly over it. A timer one period after each reconcile would resync
/// Proxies that settled together (10,000 at a start) together, a burst of reconciles every
/// period (cluster mode's sweep spreads them over it likewise). Never later than the period.
fn resync_in(key: &ProxyKey, period: Duration, since_open: Duration) -> Duration {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let period_ns = period.as_nanos().max(1);
    let phase = u128::from(BuildHasherDefault::<DefaultHasher>::default().hash_one(key)) % period_ns;
    let into_cycle = (since_open.as_nanos() + phase) % period_ns;
    let left = period_ns - into_cycle;
    Duration::from_nanos(u64::try_from(left).unwrap_or(u64::MAX))
}

/// The next recycle request, if there is a path for them (else never).
async fn next_ask(asks: &mut Option<mpsc::Receiver<RecycleAsk>>) -> Option<RecycleAsk> {
    match asks {
        Some(asks) => asks.recv().await,
        None => std::future::pending().await,
    }
}

/// Secrets (namespace, name) added, removed or changed between two readings of the folder.
fn changed_secrets(
    before: &HashMap<(String, String), k8s_openapi::api::core::v1::Secret>,
    after: &HashMap<(String, String), k8s_openapi::api::core::v1::Secret>,
) -> Vec<(String, String)> {
    let mut changed: Vec<(String, String)> = after
        .iter()
        .filter(|(key, secret)| before.get(*key) != Some(*secret))
        .map(|(key, _)| key.clone())
        .collect();
    changed.extend(before.keys().filter(|key| !after.contains_key(*key)).cloned());
    changed
}

/// Whether a Proxy `spec` (as stored) in `namespace` references one of `secrets`, through its
/// cloud-init or its credentials.
fn references_any(spec: &serde_json::Value, namespace: &str, secrets: &[(String, String)]) -> bool {
    ["/cloudInit/secretRef/name", "/auth/secretRef/name"]
        .iter()
        .filter_map(|pointer| spec.pointer(pointer)?.as_str())
        .any(|name| {
            secrets
                .iter()
                .any(|(ns, secret)| ns == namespace && secret == name)
        })
}

/// A random 128-bit identity, like `metadata.uid`.
fn new_uid() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// The Proxy object a stored record stands for, as the API server would serve it; `None` when
/// the stored spec is unreadable (logged).
pub fn proxy_of(key: &ProxyKey, record: &ProxyRecord) -> Option<Proxy> {
    let spec: ProxySpec = match serde_json::from_value(record.spec.clone()) {
        Ok(spec) => spec,
        Err(err) => {
            warn!(proxy = %key, error = %err, "stored spec is unreadable");
            return None;
        }
    };
    Some(Proxy {
        metadata: ObjectMeta {
            name: Some(key.name().to_owned()),
            namespace: Some(key.namespace().to_owned()),
            uid: Some(record.uid.clone()),
            generation: Some(record.generation),
            creation_timestamp: Some(Time(record.created)),
            deletion_timestamp: record.deletion_time.map(Time),
            finalizers: record.finalizer.then(|| vec![FINALIZER.to_owned()]),
            annotations: annotations_of(record),
            ..ObjectMeta::default()
        },
        spec,
        status: record.status.clone(),
    })
}
