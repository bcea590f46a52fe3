//! The controller wiring: the reconciler wired to Kubernetes with kube-runtime's `Controller`
//! on `Proxy`, a label-selected reflector of cloud-init Secrets whose changes re-reconcile the
//! Proxies that reference them, extra triggers (health verdicts, provider availability flips
//! resolved through the Proxy cache: [`super::triggers`]), bounded concurrency, debounce, error
//! back-off by category, and graceful shutdown.
//!
//! The controller does not wake itself: Proxy watch events reach it only when the generation,
//! the finalizers or the deletion mark changed ([`proxy_changed`]), so its own status writes do
//! not re-trigger a reconcile and the reconciler's `requeue_after` (timers, backoff) is what
//! brings a waiting Proxy back; a Proxy that waits for nothing is looked at by the resync sweep
//! ([`resync`]). A reconcile that another trigger (health) starts before the
//! cache has received our own last status write is put off briefly instead of redoing the
//! transitions on the old version ([`KubeBackend::is_superseded`]).
//!
//! Must not touch: the lifecycle's decisions (the shared [`Reconciler`] makes them) or the
//! core's services (it is handed their executors in [`ClusterDeps`]).

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, Client, ResourceExt,
    core::PartialObjectMeta,
    runtime::{
        Controller, PredicateConfig, WatchStreamExt,
        controller::{Action, Config as ControllerConfig},
        events::Reporter,
        reflector::{self, ObjectRef},
        watcher::{self, watcher},
    },
};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::{KubeBackend, events, resync, triggers};
use crate::{
    api::{CLOUD_INIT_SECRET_LABEL, Proxy, ProxyKey},
    controller::{ProviderAvailability, ReconcileError, Reconciler, ReconcilerConfig, error_backoff},
    health::HealthControl,
    lease::LeaseControl,
    provider::ProviderRegistry,
    telemetry::Metrics,
};

/// Name of the controller in Events and as the field manager.
pub const CONTROLLER_NAME: &str = "egress-proxies-operator";

/// Everything the controller needs.
pub struct ClusterDeps {
    /// API client.
    pub client: Client,
    /// Provider instances.
    pub providers: ProviderRegistry,
    /// Lease executor.
    pub leases: Arc<dyn LeaseControl>,
    /// Health engine.
    pub health: Arc<dyn HealthControl>,
    /// Provider availability (written by the provider-health monitor).
    pub availability: ProviderAvailability,
    /// Reconciler knobs.
    pub reconciler: ReconcilerConfig,
    /// Watch only this namespace.
    pub namespace: Option<String>,
    /// Parallel reconciles.
    pub concurrency: u16,
    /// Coalesce triggers of one object within this window.
    pub debounce: Duration,
    /// This replica's identity (Events' reporting instance).
    pub identity: String,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The status page's view of the Proxies and their audit, if it is served.
    pub status_feed: Option<crate::cluster::ui::ClusterFeed>,
    /// Names of providers whose availability flipped (e.g. from the provider-health monitor):
    /// their Proxies are reconciled now rather than at their next requeue.
    pub provider_flips: Option<mpsc::UnboundedReceiver<String>>,
}

/// A watch of `api` that relists at once when its resourceVersion has expired (410 Gone, after
/// an etcd compaction or an API server restart with a fresh watch cache), as client-go's
/// reflector does, and backs off (0.8 s doubling to 30 s) on every other error. kube-runtime's
/// watcher already turns a 410 into a relist; passing the 410 through the backoff would delay
/// that relist by the backoff's current step, which an outage before it has grown (seen on a
/// real kube-apiserver: about a minute blind after a 10 s restart).
fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    watcher(api, config)
        .filter(|event| {
            let expired = matches!(event, Err(watcher::Error::WatchError(status)) if status.code == 410);
            if expired {
                info!(kind = %K::kind(&Default::default()), "watch expired (410 Gone): relisting");
            }
            std::future::ready(!expired)
        })
        .default_backoff()
}

struct Context {
    reconciler: Reconciler<KubeBackend>,
    proxies: reflector::Store<Proxy>,
    pools_seeded: std::sync::atomic::AtomicBool,
    failures: Mutex<HashMap<ObjectRef<Proxy>, u32>>,
    metrics: Arc<Metrics>,
    status_feed: Option<crate::cluster::ui::ClusterFeed>,
}

/// Runs the controller until `shutdown` resolves; `ready` turns true once the caches are synced.
/// `triggers` names Proxies to reconcile now (e.g. a health threshold was crossed).
pub async fn run_controller(
    deps: ClusterDeps,
    triggers: impl Stream<Item = ProxyKey> + Send + 'static,
    ready: watch::Sender<bool>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (proxies, secrets): (Api<Proxy>, Api<Secret>) = match &deps.namespace {
        Some(ns) => (
            Api::namespaced(deps.client.clone(), ns),
            Api::namespaced(deps.client.clone(), ns),
        ),
        None => (Api::all(deps.client.clone()), Api::all(deps.client.clone())),
    };
    // Only labelled Secrets are watched and cached: unrelated Secrets never enter memory.
    let (secret_store, secret_writer) = reflector::store();
    let secret_stream = watch(
        secrets,
        watcher::Config::default().labels(&format!("{CLOUD_INIT_SECRET_LABEL}=true")),
    )
    .reflect(secret_writer)
    .touched_objects();

    let events = events::EventPublisher::new(
        deps.client.clone(),
        Reporter {
            controller: CONTROLLER_NAME.to_owned(),
            instance: Some(deps.identity.clone()),
        },
    );
    let backend = KubeBackend::new(deps.client.clone(), events, secret_store.clone());
    let (proxy_store, proxy_writer) = reflector::store();
    if let Some(feed) = &deps.status_feed {
        feed.set_proxies(proxy_store.clone());
    }
    let resync_period = deps.reconciler.timers.resync;
    // Without a monitor, a channel that is closed at once: no flips.
    let provider_flips = deps.provider_flips.unwrap_or_else(|| mpsc::unbounded_channel().1);
    let context = Arc::new(Context {
        reconciler: Reconciler::new(
            backend,
            deps.providers,
            deps.leases,
            deps.health,
            deps.availability,
            deps.reconciler,
        ),
        proxies: proxy_store.clone(),
        pools_seeded: std::sync::atomic::AtomicBool::new(false),
        failures: Mutex::default(),
        metrics: deps.metrics,
        status_feed: deps.status_feed,
    });

    let proxy_events = watch(proxies, watcher::Config::default())
        .modify(slim)
        .reflect(proxy_writer)
        .applied_objects()
        .predicate_filter(proxy_changed, PredicateConfig::default());
    let controller = Controller::for_stream(proxy_events, proxy_store.clone()).with_config(
        ControllerConfig::default()
            .concurrency(deps.concurrency)
            .debounce(deps.debounce),
    );
    // Credentials Secrets carry no label: their *metadata* is watched (no content is cached), so
    // a rotation reaches the running proxies at once instead of at the next resync.
    let secret_metadata: Api<PartialObjectMeta<Secret>> = match &deps.namespace {
        Some(ns) => Api::namespaced(deps.client.clone(), ns),
        None => Api::all(deps.client.clone()),
    };
    let credential_events = watch(secret_metadata, watcher::Config::default()).touched_objects();
    let referencing_credentials = proxy_store.clone();
    let referencing = proxy_store.clone();
    let controller = controller
        .watches_stream(credential_events, move |secret: PartialObjectMeta<Secret>| {
            referencing_secret(&referencing_credentials, &secret, |spec| {
                spec.auth.as_ref().map(|a| a.secret_ref.name.as_str())
            })
        })
        .watches_stream(secret_stream, move |secret: Secret| {
            referencing_secret(&referencing, &secret, |spec| {
                spec.cloud_init.as_ref().map(|c| c.secret_ref.name.as_str())
            })
        })
        .reconcile_on(triggers.map(|key| triggers::object_ref(&key)))
        .reconcile_on(resync::sweep(proxy_store.clone(), resync_period, resync::TICK))
        .reconcile_on(triggers::provider_flips(proxy_store.clone(), provider_flips))
        .graceful_shutdown_on(shutdown);

    let readiness = {
        let proxy_store = proxy_store.clone();
        let secret_store = secret_store.clone();
        async move {
            let synced = wait_ready(&proxy_store).await && wait_ready(&secret_store).await;
            if synced {
                info!("caches synced");
                ready.send_replace(true);
            }
        }
    };
    tokio::spawn(readiness);
    let sampler = tokio::spawn(sample_phases(proxy_store, context.metrics.clone()));

    controller
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            use kube::runtime::controller::Error;
            match result {
                Ok(_) => {}
                // `error_policy` said it, with the retry it chose.
                Err(Error::ReconcilerFailed(..)) => {}
                // A reconcile queued (a requeue, a trigger) for a Proxy deleted since: its last
                // round removed the finalizer. Expected after every deletion.
                Err(Error::ObjectNotFound(object)) => {
                    debug!(%object, "a queued reconcile found its Proxy gone");
                }
                Err(err) => warn!(error = %err, "controller error"),
            }
        })
        .await;
    sampler.abort();
    info!("controller stopped");
}

/// How often `epo_proxies` is recounted from the cache.
const PHASE_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

/// Keeps `epo_proxies` current: counts the cached Proxies per reported phase (one pass over
/// the cache per interval, independent of how many reconciles run).
async fn sample_phases(store: reflector::Store<Proxy>, metrics: Arc<Metrics>) {
    if !wait_ready(&store).await {
        return;
    }
    loop {
        let proxies = store.state();
        let counts = crate::controller::status::count_phases(proxies.iter().map(|p| p.status.as_ref()));
        metrics.set_phase_counts(&counts);
        tokio::time::sleep(PHASE_SAMPLE_INTERVAL).await;
    }
}

/// Waits until `store` has its initial list. The store's readiness is a shared one-shot that
/// wakes only the most recent waiter, and the controller itself waits on the Proxy store, so a
/// second waiter re-polls on a short interval instead of relying on a wake-up.
async fn wait_ready<K>(store: &reflector::Store<K>) -> bool
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        match tokio::time::timeout(Duration::from_millis(100), store.wait_until_ready()).await {
            Ok(result) => return result.is_ok(),
            Err(_elapsed) => continue,
        }
    }
}

/// Drops from a watched Proxy what the operator never reads and a real API server adds per object
/// (`managedFields`, kubectl's copy of the whole applied manifest) before it is cached: the cache
/// holds every Proxy, so this is most of its size per object at 10,000 Proxies. A status write
/// sends the cached object back, but through the status subresource, which ignores metadata
/// other than the resourceVersion.
fn slim(proxy: &mut Proxy) {
    proxy.managed_fields_mut().clear();
    if let Some(annotations) = proxy.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
        if annotations.is_empty() {
            proxy.metadata.annotations = None;
        }
    }
}

/// The annotation `kubectl apply` keeps the last applied manifest in.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// The Proxies in `secret`'s namespace whose `reference` names it.
fn referencing_secret(
    proxies: &reflector::Store<Proxy>,
    secret: &impl kube::Resource,
    reference: impl Fn(&crate::api::ProxySpec) -> Option<&str>,
) -> Vec<ObjectRef<Proxy>> {
    let namespace = secret.meta().namespace.clone();
    let name = secret.meta().name.as_deref().unwrap_or_default();
    proxies
        .state()
        .into_iter()
        .filter(|p| p.namespace() == namespace && reference(&p.spec) == Some(name))
        .map(|p| ObjectRef::from_obj(&*p))
        .collect()
}

/// What makes a Proxy watch event worth a reconcile: a new generation (a spec edit), a change of
/// finalizers, a recycle request (an annotation: it moves no generation), or the deletion mark.
/// Status-only writes (our own) hash the same and are dropped.
pub fn proxy_changed(proxy: &Proxy) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    proxy.metadata.generation.hash(&mut hasher);
    proxy.metadata.finalizers.hash(&mut hasher);
    crate::controller::observe::recycle_request(proxy).hash(&mut hasher);
    proxy
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| t.0.as_nanosecond())
        .hash(&mut hasher);
    Some(hasher.finish())
}

/// How soon a Proxy whose cached version our own status write already replaced is looked at
/// again (the watch normally delivers that write within milliseconds).
const SUPERSEDED_RETRY: Duration = Duration::from_millis(100);

async fn reconcile(proxy: Arc<Proxy>, context: Arc<Context>) -> Result<Action, ReconcileError> {
    if context.reconciler.backend().is_superseded(&proxy) {
        return Ok(Action::requeue(SUPERSEDED_RETRY));
    }
    if !context
        .pools_seeded
        .swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        // The pool budgets count every Proxy, not only the ones reconciled so far.
        context
            .reconciler
            .pools()
            .seed(context.proxies.state().iter().map(|p| {
                let phase = crate::controller::status::phase_of(p.status.as_ref());
                (p.key(), p.spec.provider.clone(), phase)
            }));
    }
    let started = std::time::Instant::now();
    // The reconciler opens the `reconcile` span itself (standalone mode gets it too).
    let result = context.reconciler.reconcile(&proxy).await;
    context.metrics.observe_reconcile(
        started.elapsed(),
        result.as_ref().err().map(ReconcileError::category),
    );
    let outcome = result?;
    for entry in &outcome.audit {
        context
            .metrics
            .observe_transition(entry.from.as_str(), entry.to.as_str(), &entry.reason);
    }
    if let Some(feed) = &context.status_feed {
        feed.record(&proxy, &outcome.audit);
    }
    crate::sync::lock(&context.failures).remove(&ObjectRef::from_obj(&*proxy));
    Ok(match outcome.requeue_after {
        // The resync sweep visits it; no timer of its own.
        Some(_) if outcome.resync_only => Action::await_change(),
        Some(after) => Action::requeue(after),
        None => Action::await_change(),
    })
}

/// Conflicts retry at once (the next attempt reads the fresh object); everything else backs off
/// exponentially per object, capped at five minutes.
fn error_policy(proxy: Arc<Proxy>, error: &ReconcileError, context: Arc<Context>) -> Action {
    let key = ObjectRef::from_obj(&*proxy);
    if error.category() == "Conflict" {
        // Someone else wrote the Proxy meanwhile: the next round reads the fresh version.
        debug!(
            namespace = %proxy.namespace().unwrap_or_default(),
            name = %proxy.name_any(),
            "reconcile met a conflict; retrying"
        );
        return Action::requeue(Duration::from_millis(200));
    }
    let mut failures = crate::sync::lock(&context.failures);
    let count = failures.entry(key).or_insert(0);
    *count = count.saturating_add(1);
    let delay = error_backoff(*count);
    warn!(
        namespace = %proxy.namespace().unwrap_or_default(),
        name = %proxy.name_any(),
        category = error.category(),
        error = %error,
        retry_in = ?delay,
        "reconcile failed"
    );
    Action::requeue(delay)
}
