//! The cluster-mode controller against a real kube-apiserver and etcd (one control plane per
//! test, `tests/support/control_plane.rs`), with the in-memory provider and scripted health:
//! the whole reconcile pipeline through a real `kube::Client`. Failures are real ones too: a
//! conflict is a user's edit made while a create is in flight, a 410 is etcd compacted.

mod support {
    pub mod control_plane;
    pub mod controller;
    pub mod ports;
    pub mod process;
    pub mod scripted;
}

use std::{sync::Arc, time::Duration};

use egress_proxies_operator::{
    api::{Proxy, ProxyKey, ProxyStatus, RECYCLE_ANNOTATION},
    effects::{BackendError, ProxyBackend},
    health::Verdict,
    lease::{DrainStatus, LeaseControl, LeaseTarget},
    provider::{
        InstanceRequest, InstanceState, Owner, Provider, ProviderRegistry, instance_name,
        memory::MemoryProvider,
    },
};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use support::{
    control_plane::{ControlPlane, RequestCounts},
    controller::{ControllerSetup, RunningController},
    scripted::{ScriptedHealth, ScriptedLeases, key},
};

const NS: &str = "crawl";
const DEADLINE: Duration = Duration::from_secs(15);

struct World {
    plane: Box<ControlPlane>,
    client: Client,
    provider: Arc<MemoryProvider>,
    health: Arc<ScriptedHealth>,
    leases: Arc<ScriptedLeases>,
}

impl World {
    /// A real control plane with the CRDs installed and namespace `crawl`.
    async fn new() -> Self {
        init_logs();
        let plane = ControlPlane::start().await;
        plane.install_crds().await;
        plane.create_namespace(NS).await;
        let client = plane.client().await;
        Self {
            plane: Box::new(plane),
            client,
            provider: Arc::new(MemoryProvider::new("mem")),
            health: ScriptedHealth::new(),
            leases: ScriptedLeases::new(),
        }
    }

    async fn start(&self) -> RunningController {
        self.start_with(|_| {}).await
    }

    /// Starts the controller after `adjust` had its say on the setup.
    async fn start_with(&self, adjust: impl FnOnce(&mut ControllerSetup)) -> RunningController {
        let mut providers = ProviderRegistry::new();
        providers.insert(self.provider.clone());
        let mut setup = ControllerSetup::new(
            self.client.clone(),
            providers,
            self.leases.clone(),
            self.health.clone(),
        );
        setup.deps.concurrency = 4;
        adjust(&mut setup);
        setup.start().await
    }

    fn proxies(&self) -> Api<Proxy> {
        Api::namespaced(self.client.clone(), NS)
    }

    async fn create_proxy(&self, name: &str, spec: serde_json::Value) -> Proxy {
        let proxy: Proxy = serde_json::from_value(json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }))
        .expect("valid Proxy");
        self.proxies()
            .create(&PostParams::default(), &proxy)
            .await
            .expect("created")
    }

    /// Polls the Proxy until `done` holds for its status (or it is gone, for `None`).
    async fn wait_for(&self, name: &str, what: &str, done: impl Fn(Option<&Proxy>) -> bool) -> Option<Proxy> {
        self.wait_within(DEADLINE, name, what, done).await
    }

    async fn wait_within(
        &self,
        within: Duration,
        name: &str,
        what: &str,
        done: impl Fn(Option<&Proxy>) -> bool,
    ) -> Option<Proxy> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let current = self.proxies().get_opt(name).await.expect("readable");
            if done(current.as_ref()) {
                return current;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {name}: {what}; last: {current:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The cluster-mode backend the controller writes through, on its own.
    fn backend(&self) -> egress_proxies_operator::cluster::KubeBackend {
        let reporter = kube::runtime::events::Reporter {
            controller: "test-operator".into(),
            instance: None,
        };
        egress_proxies_operator::cluster::KubeBackend::new(
            self.client.clone(),
            egress_proxies_operator::cluster::events::EventPublisher::new(self.client.clone(), reporter),
            kube::runtime::reflector::store::<Secret>().0,
        )
    }

    /// Merges `metadata` into the Proxy's, as `kubectl label` or `kubectl annotate` would: a
    /// change outside its status that moves its resourceVersion.
    async fn patch_metadata(&self, name: &str, metadata: serde_json::Value) {
        self.proxies()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": metadata })),
            )
            .await
            .expect("metadata patched");
    }

    /// Labels the Proxy `touched=by-a-user`.
    async fn label_by_a_user(&self, name: &str) {
        self.patch_metadata(name, json!({"labels": {"touched": "by-a-user"}}))
            .await;
    }

    async fn wait_phase(&self, name: &str, phase: &str) -> Proxy {
        self.wait_for(name, &format!("phase {phase}"), |p| phase_of(p) == Some(phase))
            .await
            .expect("exists")
    }

    fn plane(&self) -> &ControlPlane {
        &self.plane
    }

    /// The API server's own request counters now.
    async fn requests(&self) -> RequestCounts {
        self.plane().request_counts().await
    }

    /// Events in `crawl` as the operator writes them (events.k8s.io), as JSON.
    async fn events(&self) -> Vec<serde_json::Value> {
        let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(self.client.clone(), NS);
        events
            .list(&Default::default())
            .await
            .expect("events.k8s.io Events")
            .items
            .iter()
            .map(|e| serde_json::to_value(e).expect("JSON"))
            .collect()
    }
}

fn init_logs() {
    // `RUST_LOG=debug cargo test --test controller` shows the operator's logs.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
}

fn phase_of(proxy: Option<&Proxy>) -> Option<&str> {
    proxy?.status.as_ref()?.phase.as_deref()
}

fn condition<'a>(
    status: &'a ProxyStatus,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition"))
}

fn passing() -> Verdict {
    Verdict::Passing
}

async fn make_healthy(world: &World, operator: &RunningController, name: &str) -> Proxy {
    world.wait_phase(name, "provisioning").await;
    world.health.set(&key(NS, name), passing());
    operator.trigger(key(NS, name)).await;
    world.wait_phase(name, "healthy").await
}

async fn labelled_secret(world: &World, name: &str, content: &str) {
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": NS, "labels": {"crawl.example.com/cloud-init": "true"}},
        "stringData": {"user-data": content},
    }))
    .expect("valid");
    Api::<Secret>::namespaced(world.client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await
        .expect("created");
}

#[tokio::test]
async fn create_to_healthy_within_the_write_budget_and_a_resync_writes_nothing() {
    let world = World::new().await;
    let operator = world.start().await;
    let before_create = world.requests().await;
    let created = world
        .create_proxy(
            "web-1",
            json!({"provider": "mem", "attributes": {"region": "eu"}}),
        )
        .await;
    let proxy = make_healthy(&world, &operator, "web-1").await;

    let instance = instance_name(NS, "web-1", &created.uid().expect("uid"));
    assert_eq!(world.provider.names(), std::slice::from_ref(&instance));
    assert!(
        proxy
            .finalizers()
            .contains(&"crawl.example.com/proxy-cleanup".to_owned())
    );
    let status = proxy.status.clone().expect("status");
    assert_eq!(
        status.provider_id.as_deref(),
        Some(format!("memory/mem/{instance}").as_str())
    );
    assert_eq!(status.endpoint.as_deref(), Some("127.0.0.1:3128"));
    assert_eq!(status.spec_hash.as_ref().map(String::len), Some(64));
    assert_eq!(status.observed_generation, proxy.metadata.generation);
    assert!(status.last_health_check_time.is_some());
    assert_eq!(condition(&status, "Ready").status, "True");
    assert_eq!(condition(&status, "Provisioned").status, "True");
    assert_eq!(condition(&status, "Healthy").status, "True");
    let leases = world
        .leases
        .entry(&key(NS, "web-1"))
        .expect("registered with the lease store");
    assert!(leases.open, "a healthy proxy takes leases");
    assert_eq!(
        leases.target.expect("target").attributes.get("region"),
        Some("eu")
    );

    // The API server's own counters: every write to the Proxy (main resource and status),
    // less the test's own create.
    let after = world.requests().await;
    let writes = after.writes_since(&before_create, "proxies") - 1.0;
    assert!(
        writes <= 4.0,
        "{writes} writes from creation to Healthy: {:#?}",
        after.0
    );

    // A steady-state resync changes nothing and writes nothing.
    let before = operator.reconciles();
    for _ in 0..3 {
        operator.trigger(key(NS, "web-1")).await;
        operator.wait_reconciles(operator.reconciles() + 1).await;
    }
    assert!(operator.reconciles() >= before + 3);
    let resynced = world.requests().await;
    assert_eq!(
        resynced.writes_since(&after, "proxies"),
        0.0,
        "a resync must not write"
    );
    operator.stop().await;
}

#[tokio::test]
async fn an_instance_that_never_passes_its_health_check_is_replaced_after_the_provisioning_timeout() {
    let world = World::new().await;
    let operator = world
        .start_with(|setup| setup.deps.reconciler.timers.provisioning_timeout = Duration::from_secs(1))
        .await;
    // Health stays Unknown: the instance never passes its first check.
    world.create_proxy("stuck", json!({"provider": "mem"})).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while world.provider.created_count() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no replacement after the provisioning timeout; created {}",
            world.provider.created_count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        world.provider.deleted_count() >= 1,
        "the stuck instance was deleted"
    );
    let events: Vec<String> = world.events().await.iter().map(|e| e.to_string()).collect();
    assert!(
        events
            .iter()
            .any(|e| e.contains("ProvisioningTimedOut") && e.contains("1 s")),
        "an Event names the reason and the timeout: {events:#?}"
    );
    operator.stop().await;
}

#[tokio::test]
async fn rotating_the_cloud_init_secret_replaces_the_instance() {
    let world = World::new().await;
    labelled_secret(&world, "squid-init", "#cloud-config\npackages: [squid]\n").await;
    let operator = world.start().await;
    world
        .create_proxy(
            "vm-1",
            json!({"provider": "mem", "cloudInit": {"secretRef": {"name": "squid-init"}}}),
        )
        .await;
    let before = make_healthy(&world, &operator, "vm-1").await;
    let first_hash = before
        .status
        .as_ref()
        .and_then(|s| s.spec_hash.clone())
        .expect("hash");
    assert_eq!(world.provider.created_count(), 1);

    Api::<Secret>::namespaced(world.client.clone(), NS)
        .patch(
            "squid-init",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"user-data": "#cloud-config\npackages: [squid, curl]\n"}})),
        )
        .await
        .expect("rotated");
    let replaced = world
        .wait_for("vm-1", "a new spec hash", |p| {
            p.and_then(|p| p.status.as_ref()?.spec_hash.clone())
                .is_some_and(|h| h != first_hash)
        })
        .await
        .expect("exists");
    assert_eq!(phase_of(Some(&replaced)), Some("provisioning"));
    assert_eq!(world.provider.deleted_count(), 1, "the old instance was deleted");
    assert_eq!(world.provider.created_count(), 2, "a new one was created");
    make_healthy(&world, &operator, "vm-1").await;
    operator.stop().await;
}

#[tokio::test]
async fn changing_attributes_never_replaces_the_instance() {
    let world = World::new().await;
    let operator = world.start().await;
    world
        .create_proxy(
            "web-2",
            json!({"provider": "mem", "attributes": {"region": "eu"}}),
        )
        .await;
    make_healthy(&world, &operator, "web-2").await;

    world
        .proxies()
        .patch(
            "web-2",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"attributes": {"region": "us"}, "lease": {"maxConcurrent": 5}, "health": {"intervalSeconds": 10}}})),
        )
        .await
        .expect("patched");
    let proxy = world
        .wait_for("web-2", "generation 2 observed", |p| {
            p.and_then(|p| p.status.as_ref()?.observed_generation) == Some(2)
        })
        .await
        .expect("exists");
    assert_eq!(phase_of(Some(&proxy)), Some("healthy"));
    assert_eq!(world.provider.created_count(), 1);
    assert_eq!(world.provider.deleted_count(), 0);
    let target = world
        .leases
        .entry(&key(NS, "web-2"))
        .and_then(|e| e.target)
        .expect("target");
    assert_eq!(
        target.attributes.get("region"),
        Some("us"),
        "attributes apply in place"
    );
    assert_eq!(target.policy.max_concurrent, 5);
    assert_eq!(
        world.health.target(&key(NS, "web-2")).expect("probed").interval,
        Duration::from_secs(10)
    );
    operator.stop().await;
}

#[tokio::test]
async fn deleting_removes_the_instance_then_the_finalizer() {
    let world = World::new().await;
    let operator = world.start().await;
    world.create_proxy("web-3", json!({"provider": "mem"})).await;
    make_healthy(&world, &operator, "web-3").await;
    world
        .proxies()
        .delete("web-3", &DeleteParams::default())
        .await
        .expect("delete accepted");
    world.wait_for("web-3", "gone", |p| p.is_none()).await;
    assert!(
        world.provider.names().is_empty(),
        "instance left behind: {:?}",
        world.provider.names()
    );
    assert!(
        world.leases.entry(&key(NS, "web-3")).is_none(),
        "lease registration left behind"
    );
    operator.stop().await;
}

#[tokio::test]
async fn a_restart_mid_provision_creates_no_duplicate() {
    let world = World::new().await;
    world.provider.start_instances_as(InstanceState::Starting);
    // The previous operator created the instance and died before writing any status.
    let created = world.create_proxy("web-4", json!({"provider": "mem"})).await;
    let uid = created.uid().expect("uid");
    world
        .provider
        .create(&InstanceRequest {
            name: instance_name(NS, "web-4", &uid),
            owner: Owner {
                uid: uid.clone(),
                namespace: NS.into(),
                name: "web-4".into(),
            },
            // The same spec the operator will ask for: an instance of another spec is never
            // adopted (machines/scenarios/stale-instance-after-crash.yaml).
            spec_hash: egress_proxies_operator::controller::spec_hash::for_spec(&created.spec, None),
            placement: Default::default(),
            port: 3128,
            user_data: None,
            credentials: None,
        })
        .await
        .expect("pre-created");

    let operator = world.start().await;
    world.wait_phase("web-4", "provisioning").await;
    operator.stop().await;
    // And once more, restarting while provisioning.
    let operator = world.start().await;
    operator.trigger(key(NS, "web-4")).await;
    let reconciled = operator.reconciles();
    operator.wait_reconciles(reconciled.max(1)).await;
    assert_eq!(
        world.provider.created_count(),
        1,
        "creates are idempotent by name"
    );
    assert_eq!(world.provider.names().len(), 1);
    operator.stop().await;
}

#[tokio::test]
async fn an_expired_watch_relists_and_converges() {
    let mut world = World::new().await;
    let operator = world.start().await;
    world.create_proxy("web-4", json!({"provider": "mem"})).await;
    make_healthy(&world, &operator, "web-4").await;
    // Writes the controller sees nothing of (another namespace), so its resourceVersion falls
    // behind; then etcd's history is compacted and kube-apiserver restarted with an empty watch
    // cache: the watch resumes from a resourceVersion that is gone (410) and must relist.
    world.plane().create_namespace("elsewhere").await;
    let other: Api<Secret> = Api::namespaced(world.client.clone(), "elsewhere");
    for i in 0..20 {
        let secret: Secret =
            serde_json::from_value(json!({"metadata": {"name": format!("s{i}")}})).expect("valid");
        other
            .create(&PostParams::default(), &secret)
            .await
            .expect("created");
    }
    let plane = &mut world.plane;
    plane.stop_apiserver().await;
    plane.compact_etcd().await;
    plane.start_apiserver_again().await;
    world.client = world.plane().client().await;
    world.create_proxy("web-5", json!({"provider": "mem"})).await;
    // The watch reconnects on kube-runtime's backoff (up to 30 s between tries while the API
    // server was down), then gets 410 and relists.
    world
        .wait_within(
            Duration::from_secs(60),
            "web-5",
            "provisioning after the relist",
            |p| phase_of(p) == Some("provisioning"),
        )
        .await;
    make_healthy(&world, &operator, "web-5").await;
    assert_eq!(
        world.provider.created_count(),
        2,
        "one instance each, none created twice across the relist"
    );
    operator.stop().await;
}

/// The in-memory provider whose creates wait at a gate the test opens: what happens to a Proxy
/// while its create is in flight.
struct GatedProvider {
    inner: Arc<MemoryProvider>,
    /// A permit per create that reached the gate.
    entered: tokio::sync::Semaphore,
    gate: tokio::sync::Semaphore,
}

impl GatedProvider {
    fn new(inner: Arc<MemoryProvider>) -> Self {
        Self {
            inner,
            entered: tokio::sync::Semaphore::new(0),
            gate: tokio::sync::Semaphore::new(0),
        }
    }

    /// Waits until a create is at the gate.
    async fn wait_entered(&self) {
        tokio::time::timeout(DEADLINE, self.entered.acquire())
            .await
            .expect("a create reaches the provider")
            .expect("open semaphore")
            .forget();
    }

    /// Lets every create through from now on.
    fn open(&self) {
        self.gate.add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
    }
}

#[async_trait::async_trait]
impl Provider for GatedProvider {
    fn provider_type(&self) -> &'static str {
        self.inner.provider_type()
    }
    fn instance(&self) -> &str {
        self.inner.instance()
    }
    fn installation(&self) -> &egress_proxies_operator::provider::Installation {
        self.inner.installation()
    }
    async fn create(
        &self,
        request: &InstanceRequest,
    ) -> Result<egress_proxies_operator::provider::Instance, egress_proxies_operator::provider::ProviderError>
    {
        self.entered.add_permits(1);
        drop(self.gate.acquire().await.expect("open semaphore"));
        self.inner.create(request).await
    }
    async fn get(
        &self,
        name: &str,
    ) -> Result<egress_proxies_operator::provider::Instance, egress_proxies_operator::provider::ProviderError>
    {
        self.inner.get(name).await
    }
    async fn delete(&self, name: &str) -> Result<(), egress_proxies_operator::provider::ProviderError> {
        self.inner.delete(name).await
    }
    async fn list(
        &self,
    ) -> Result<
        Vec<egress_proxies_operator::provider::Instance>,
        egress_proxies_operator::provider::ProviderError,
    > {
        self.inner.list().await
    }
    async fn adopt(
        &self,
        name: &str,
    ) -> Result<egress_proxies_operator::provider::Instance, egress_proxies_operator::provider::ProviderError>
    {
        self.inner.adopt(name).await
    }
    async fn probe(
        &self,
    ) -> Result<
        egress_proxies_operator::provider::ProbeReport,
        egress_proxies_operator::provider::ProviderError,
    > {
        self.inner.probe().await
    }
}

#[tokio::test]
async fn a_status_conflict_is_retried() {
    // A real 409: the Proxy is labelled (as `kubectl label` would) while its create is in
    // flight, so the status write that follows carries a resourceVersion that is no longer
    // the object's. Only the labels moved: the status (with the instance's ID) is written
    // again on the fresh version, and the instance is created once.
    let world = World::new().await;
    let gated = Arc::new(GatedProvider::new(world.provider.clone()));
    let operator = world
        .start_with(|setup| {
            let mut providers = ProviderRegistry::new();
            providers.insert(gated.clone());
            setup.deps.providers = providers;
        })
        .await;
    let before = world.plane().settled_request_counts().await;
    world.create_proxy("web-6", json!({"provider": "mem"})).await;
    gated.wait_entered().await;
    world.label_by_a_user("web-6").await;
    gated.open();
    world
        .wait_for("web-6", "the instance recorded", |p| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| s.provider_id.is_some())
        })
        .await;
    let conflicts = world
        .plane()
        .settled_request_counts()
        .await
        .with_code_since(&before, "proxies", "409");
    assert!(
        conflicts >= 1.0,
        "the status write met a real conflict: {conflicts}"
    );
    assert_eq!(world.provider.created_count(), 1, "the retry reused the instance");
    let labels = world
        .proxies()
        .get("web-6")
        .await
        .expect("exists")
        .metadata
        .labels;
    assert_eq!(
        labels.unwrap_or_default().get("touched").map(String::as_str),
        Some("by-a-user"),
        "the user's label survives the operator's writes"
    );
    operator.stop().await;
}

/// The scripted lease registry, except that the moment a Proxy's leases first open it reads
/// the Proxy's stored phase, then sets its recycle request through the API server, as the
/// gateway does when a rule bans the first answer through a new proxy.
struct RecycleWhenLeasesOpen {
    inner: Arc<ScriptedLeases>,
    proxies: Api<Proxy>,
    asked: std::sync::atomic::AtomicBool,
    stored_phase_when_opened: std::sync::Mutex<Option<String>>,
}

impl LeaseControl for RecycleWhenLeasesOpen {
    fn upsert(&self, target: LeaseTarget) {
        self.inner.upsert(target);
    }
    fn set_admission(&self, key: &ProxyKey, open: bool) {
        self.inner.set_admission(key, open);
        if open && !self.asked.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let annotate =
                json!({"metadata": {"annotations": {RECYCLE_ANNOTATION: "gateway rule blocked #1"}}});
            // Before admission returns: the next round reads the request.
            tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(async {
                    let stored = self.proxies.get(key.name()).await.expect("read");
                    *self.stored_phase_when_opened.lock().expect("lock") =
                        phase_of(Some(&stored)).map(str::to_owned);
                    self.proxies
                        .patch(key.name(), &PatchParams::default(), &Patch::Merge(&annotate))
                        .await
                        .expect("annotated")
                })
            });
        }
    }
    fn drain(&self, key: &ProxyKey) -> DrainStatus {
        self.inner.drain(key)
    }
    fn revoke_all(&self, key: &ProxyKey) -> usize {
        self.inner.revoke_all(key)
    }
    fn remove(&self, key: &ProxyKey) {
        self.inner.remove(key)
    }
    fn active(&self, key: &ProxyKey) -> usize {
        self.inner.active(key)
    }
}

/// A recycle asked of a Proxy whose leases have just opened is asked of an instance that
/// served: it is replaced, and the audit never says the request was satisfied by an instance
/// still being created. (Admission opens only after the status saying `healthy` is stored, so
/// the request meets a stored `healthy`. Admission once opened inside the round, whose status
/// write then met the request's conflict and was dropped: the next round started from
/// `provisioning` again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recycle_asked_as_leases_open_replaces_the_instance_that_served() {
    let world = World::new().await;
    let leases = Arc::new(RecycleWhenLeasesOpen {
        inner: world.leases.clone(),
        proxies: world.proxies(),
        asked: Default::default(),
        stored_phase_when_opened: Default::default(),
    });
    let operator = world.start_with(|setup| setup.deps.leases = leases.clone()).await;
    world.create_proxy("web-9", json!({"provider": "mem"})).await;
    world.wait_phase("web-9", "provisioning").await;
    world.health.set(&key(NS, "web-9"), passing());
    operator.trigger(key(NS, "web-9")).await;
    world
        .wait_for("web-9", "the recycle acted on", |p| {
            p.and_then(|p| p.status.as_ref())
                .and_then(|s| s.last_recycle.as_deref())
                == Some("gateway rule blocked #1")
        })
        .await;
    // What the round that acted on it said (its Event is published before the status write).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let reasons = loop {
        let reasons: Vec<String> = world
            .events()
            .await
            .iter()
            .filter_map(|e| e["reason"].as_str().map(str::to_owned))
            .collect();
        if reasons.iter().any(|r| r == "Recycled" || r == "RecycleSatisfied") {
            break reasons;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no recycle event: {reasons:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        reasons.iter().any(|r| r == "Recycled") && !reasons.iter().any(|r| r == "RecycleSatisfied"),
        "the instance that served was called fresh: {reasons:?}"
    );
    // Admission opened only once the store said `healthy`: a crash before that write would
    // have left no lease on an instance the store calls `provisioning`.
    assert_eq!(
        leases.stored_phase_when_opened.lock().expect("lock").as_deref(),
        Some("healthy")
    );
    // The new instance is probed afresh.
    make_healthy(&world, &operator, "web-9").await;
    assert_eq!(
        world.provider.created_count(),
        2,
        "the instance that served is replaced by a fresh one"
    );
    operator.stop().await;
}

/// A status write goes on top of changes to the rest of the Proxy made since the round read
/// it (what the round did has happened; the next round sees the changes), but never over a
/// status someone else wrote meanwhile (a former leader, say): that stays a conflict, and the
/// round is derived again from the fresh object.
#[tokio::test]
async fn a_status_write_goes_on_top_of_a_label_but_never_over_another_status() {
    let world = World::new().await;
    let backend = world.backend();
    let phase = |phase: &str| ProxyStatus {
        phase: Some(phase.to_owned()),
        ..ProxyStatus::default()
    };
    let read = world.create_proxy("web-10", json!({"provider": "mem"})).await;
    world.label_by_a_user("web-10").await;
    backend
        .write_status(&read, &phase("provisioning"))
        .await
        .expect("written on top of the label");
    let stored = world.proxies().get("web-10").await.expect("exists");
    assert_eq!(phase_of(Some(&stored)), Some("provisioning"));
    assert_eq!(
        stored.labels().get("touched").map(String::as_str),
        Some("by-a-user")
    );

    // Another writer's status lands after our read.
    let mut theirs = stored.clone();
    theirs.status = Some(phase("healthy"));
    world
        .proxies()
        .replace_status("web-10", &PostParams::default(), &theirs)
        .await
        .expect("their status");
    let refused = backend.write_status(&stored, &phase("pending")).await;
    assert!(matches!(refused, Err(BackendError::Conflict(_))), "{refused:?}");
    let after = world.proxies().get("web-10").await.expect("exists");
    assert_eq!(phase_of(Some(&after)), Some("healthy"), "their status stands");
}

/// The finalizer's removal (after the instance is gone) goes on top of changes elsewhere in
/// the Proxy made since the round read it, but never drops a finalizer someone else added
/// meanwhile: that stays a conflict.
#[tokio::test]
async fn a_finalizer_removal_goes_on_top_of_a_label_but_never_drops_another_finalizer() {
    let world = World::new().await;
    let backend = world.backend();
    let created = world.create_proxy("web-11", json!({"provider": "mem"})).await;
    backend.add_finalizer(&created).await.expect("finalizer added");
    let read = world.proxies().get("web-11").await.expect("exists");
    world.label_by_a_user("web-11").await;
    backend
        .remove_finalizer(&read)
        .await
        .expect("removed on top of the label");
    let stored = world.proxies().get("web-11").await.expect("exists");
    assert!(stored.finalizers().is_empty(), "{:?}", stored.finalizers());
    assert_eq!(
        stored.labels().get("touched").map(String::as_str),
        Some("by-a-user")
    );

    backend
        .add_finalizer(&stored)
        .await
        .expect("finalizer added again");
    let read = world.proxies().get("web-11").await.expect("exists");
    let mut finalizers = read.finalizers().to_vec();
    finalizers.push("example.com/theirs".to_owned());
    world
        .patch_metadata("web-11", json!({ "finalizers": finalizers }))
        .await;
    let refused = backend.remove_finalizer(&read).await;
    assert!(matches!(refused, Err(BackendError::Conflict(_))), "{refused:?}");
    let after = world.proxies().get("web-11").await.expect("exists");
    assert_eq!(after.finalizers(), finalizers.as_slice(), "theirs and ours stand");
}

#[tokio::test]
async fn a_missing_secret_is_a_clear_condition_until_it_appears() {
    let world = World::new().await;
    let operator = world.start().await;
    world
        .create_proxy(
            "vm-2",
            json!({"provider": "mem", "cloudInit": {"secretRef": {"name": "later"}}}),
        )
        .await;
    let proxy = world
        .wait_for("vm-2", "InvalidSpec", |p| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| s.conditions.iter().any(|c| c.reason == "InvalidSpec"))
        })
        .await
        .expect("exists");
    let ready = condition(proxy.status.as_ref().expect("status"), "Ready").clone();
    assert_eq!(ready.status, "False");
    assert!(
        ready
            .message
            .contains("crawl/later not found or not labelled crawl.example.com/cloud-init"),
        "{}",
        ready.message
    );
    assert!(world.provider.names().is_empty());

    // An unlabelled Secret is not even seen.
    let unlabelled: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "later", "namespace": NS},
        "stringData": {"user-data": "#cloud-config\n"},
    }))
    .unwrap();
    Api::<Secret>::namespaced(world.client.clone(), NS)
        .create(&PostParams::default(), &unlabelled)
        .await
        .expect("created");
    operator.trigger(key(NS, "vm-2")).await;
    operator.wait_reconciles(operator.reconciles() + 1).await;
    assert_eq!(
        phase_of(world.proxies().get("vm-2").await.ok().as_ref()),
        Some("pending")
    );

    // Labelling it is the change that wakes the Proxy.
    Api::<Secret>::namespaced(world.client.clone(), NS)
        .patch(
            "later",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"crawl.example.com/cloud-init": "true"}}})),
        )
        .await
        .expect("labelled");
    world.wait_phase("vm-2", "provisioning").await;
    operator.stop().await;
}

#[tokio::test]
async fn an_unknown_provider_is_a_user_error_not_a_crash() {
    let world = World::new().await;
    let operator = world.start().await;
    world.create_proxy("web-7", json!({"provider": "nope"})).await;
    let proxy = world
        .wait_for("web-7", "InvalidSpec", |p| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| s.conditions.iter().any(|c| c.reason == "InvalidSpec"))
        })
        .await
        .expect("exists");
    let ready = condition(proxy.status.as_ref().expect("status"), "Ready");
    assert!(
        ready.message.contains("no provider instance named \"nope\""),
        "{}",
        ready.message
    );
    assert!(
        proxy.finalizers().is_empty(),
        "nothing was provisioned, so no finalizer"
    );
    operator.stop().await;
}

#[tokio::test]
async fn the_status_write_after_adding_the_finalizer_does_not_conflict() {
    let world = World::new().await;
    let operator = world.start().await;
    // Health stays Unknown: one reconcile adds the finalizer and writes `provisioning`.
    let before = world.requests().await;
    world.create_proxy("first", json!({"provider": "mem"})).await;
    world.wait_phase("first", "provisioning").await;
    let after = world.requests().await;
    let conflicts = after.with_code_since(&before, "proxies", "409");
    assert_eq!(
        conflicts, 0.0,
        "the status write must carry the resourceVersion of the operator's own finalizer patch: {:#?}",
        after.0
    );
    operator.stop().await;
}

#[tokio::test]
async fn a_repeated_event_joins_the_first_ones_series() {
    let world = World::new().await;
    let operator = world.start().await;
    world.create_proxy("flappy", json!({"provider": "mem"})).await;
    make_healthy(&world, &operator, "flappy").await;
    let k = key(NS, "flappy");
    for _ in 0..2 {
        world.health.set(&k, Verdict::Failing);
        operator.trigger(k.clone()).await;
        world.wait_phase("flappy", "degraded").await;
        world.health.set(&k, Verdict::Passing);
        operator.trigger(k.clone()).await;
        world.wait_phase("flappy", "healthy").await;
    }
    let failed: Vec<serde_json::Value> = world
        .events()
        .await
        .into_iter()
        .filter(|e| e["reason"] == "HealthCheckFailed")
        .collect();
    assert_eq!(
        failed.len(),
        1,
        "a repeat within six minutes is a series, not a new Event: {failed:#?}"
    );
    assert_eq!(failed[0]["series"]["count"], 2, "{failed:#?}");
    assert!(failed[0]["series"]["lastObservedTime"].is_string(), "{failed:#?}");
    operator.stop().await;
}

#[tokio::test]
async fn a_repeat_with_another_note_is_an_event_of_its_own_and_every_occurrence_is_kept() {
    // events.k8s.io/v1 keeps an Event's note immutable: a repeat may add to the series only
    // when it says the same thing.
    use egress_proxies_operator::cluster::events::EventPublisher;
    use kube::{
        Resource,
        runtime::events::{Event, EventType, Reporter},
    };
    let (_plane, client) = ControlPlane::with_crds(&[NS]).await;
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), NS);
    let proxy: Proxy = serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
        "metadata": {"name": "noted", "namespace": NS},
        "spec": {"provider": "mem"},
    }))
    .unwrap();
    let proxy = proxies.create(&PostParams::default(), &proxy).await.unwrap();
    let publisher = EventPublisher::new(
        client.clone(),
        Reporter {
            controller: "egress-proxies-operator".into(),
            instance: Some("test".into()),
        },
    );
    let event = |note: &str| Event {
        type_: EventType::Normal,
        reason: "CredentialsUpdated".into(),
        note: Some(note.into()),
        action: "Reconcile".into(),
        secondary: None,
    };
    for note in ["healthy to healthy", "healthy to healthy", "degraded to degraded"] {
        publisher
            .publish(&event(note), &proxy.object_ref(&()))
            .await
            .unwrap_or_else(|e| panic!("publishing {note:?}: {e}"));
    }
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, NS);
    let mut seen: Vec<(String, i32)> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| (e.note.unwrap_or_default(), e.series.map_or(1, |s| s.count)))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("degraded to degraded".to_owned(), 1),
            ("healthy to healthy".to_owned(), 2)
        ]
    );
}

/// The defaults scaled down 100x (10 s doubling to 5 min becomes 100 ms doubling to 3 s), so a
/// 6 s window stands for the first 10 minutes.
fn scaled_backoff() -> egress_proxies_operator::machine::Backoff {
    egress_proxies_operator::machine::Backoff {
        initial: Duration::from_millis(100),
        cap: Duration::from_secs(3),
        jitter: 0.1,
    }
}

#[tokio::test]
async fn a_provider_that_fails_every_create_is_asked_with_backoff() {
    let world = World::new().await;
    world.provider.fail_next_creates(1_000_000);
    let operator = world
        .start_with(|setup| {
            setup.deps.reconciler.backoff = scaled_backoff();
            setup.deps.reconciler.timers.poll = Duration::from_millis(20);
        })
        .await;
    world.create_proxy("flaky", json!({"provider": "mem"})).await;
    let window = Duration::from_secs(6);
    let started = tokio::time::Instant::now();
    let mut seen_backoff = false;
    while started.elapsed() < window {
        // The status carries the count and the next attempt time, so neither a restart nor
        // a status-triggered reconcile could shorten the wait.
        if let Some(status) = world.proxies().get("flaky").await.expect("readable").status {
            seen_backoff |= status.retry_attempts.unwrap_or(0) >= 2 && status.next_attempt_time.is_some();
            if status.phase.as_deref() == Some("pending") && status.retry_attempts.is_some() {
                let ready = condition(&status, "Ready");
                assert_eq!(ready.reason, "CreateFailed");
                assert!(
                    ready.message.contains("scripted create failure"),
                    "the cause is kept: {ready:?}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let calls = world.provider.create_calls();
    // 0, 0.1, 0.3, 0.7, 1.5, 3.1, 6.1 s: six calls in the window (jitter only shortens delays).
    assert!(
        (4..=8).contains(&calls),
        "{calls} create calls in the scaled first 10 minutes"
    );
    assert!(seen_backoff, "retryAttempts and nextAttemptTime were reported");
    operator.stop().await;
}

/// Twenty Proxies share one cloud-init Secret; rotating it replaces them a quarter at a time.
#[tokio::test]
async fn a_shared_secret_rotation_replaces_at_most_a_quarter_at_once() {
    let world = World::new().await;
    labelled_secret(&world, "shared-init", "#cloud-config\npackages: [squid]\n").await;
    let operator = world
        .start_with(|setup| setup.deps.reconciler.timers.poll = Duration::from_millis(100))
        .await;
    let names: Vec<String> = (0..20).map(|i| format!("pool-{i:02}")).collect();
    for name in &names {
        world
            .create_proxy(
                name,
                json!({"provider": "mem", "cloudInit": {"secretRef": {"name": "shared-init"}}}),
            )
            .await;
    }
    drive_to_healthy(&world, &operator, &names, None).await;
    let created_before = world.provider.created_count();

    Api::<Secret>::namespaced(world.client.clone(), NS)
        .patch(
            "shared-init",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"user-data": "#cloud-config\npackages: [squid, curl]\n"}})),
        )
        .await
        .expect("rotated");
    replaced_within_the_budget(&world, &operator, &names, created_before).await;
    operator.stop().await;
}

/// A ban rule (or a user) asks every proxy of a twenty-proxy pool for a fresh instance at once
/// (the recycle annotation, as `kubectl annotate` sets it): they are replaced a quarter at a time,
/// each exactly once, and the request is recorded in each status so it recycles once.
#[tokio::test]
async fn recycling_the_whole_pool_respects_its_budget() {
    let world = World::new().await;
    let operator = world
        .start_with(|setup| setup.deps.reconciler.timers.poll = Duration::from_millis(100))
        .await;
    let names: Vec<String> = (0..20).map(|i| format!("pool-{i:02}")).collect();
    for name in &names {
        world.create_proxy(name, json!({"provider": "mem"})).await;
    }
    drive_to_healthy(&world, &operator, &names, None).await;
    let created_before = world.provider.created_count();

    for name in &names {
        world
            .patch_metadata(name, json!({"annotations": {RECYCLE_ANNOTATION: "ban-1"}}))
            .await;
    }
    replaced_within_the_budget(&world, &operator, &names, created_before).await;
    // The round that creates the last new instance writes its status after the create: the
    // count can reach twenty a moment before the last status says so.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let proxies = world.proxies().list(&Default::default()).await.expect("list");
        let unrecorded: Vec<String> = proxies
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.last_recycle.as_deref()) != Some("ban-1"))
            .map(|p| p.name_any())
            .collect();
        if unrecorded.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the recycle request is not in the status of {unrecorded:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        world.provider.created_count(),
        created_before + 20,
        "recorded, each proxy recycles once"
    );

    operator.stop().await;
}

/// Drives the twenty proxies `names` to Healthy after something asked to replace them all:
/// every one is replaced exactly once (`created_before` creates before), never more than the
/// pool's budget (25 % = 5) unavailable at once.
async fn replaced_within_the_budget(
    world: &World,
    operator: &RunningController,
    names: &[String],
    created_before: usize,
) {
    let max_unavailable = drive_to_healthy(world, operator, names, Some(created_before + 20)).await;
    assert!(
        max_unavailable <= 5,
        "{max_unavailable} of 20 were unavailable at once (budget 25 % = 5)"
    );
    assert!(max_unavailable >= 1, "something was replaced");
    assert_eq!(
        world.provider.created_count(),
        created_before + 20,
        "every proxy was replaced once"
    );
}

/// Passes health for every proxy that is provisioning, until all are Healthy (and, with
/// `creates`, the provider made that many instances in all); returns the most proxies seen
/// unavailable (pending, provisioning or replacing) at once.
async fn drive_to_healthy(
    world: &World,
    operator: &RunningController,
    names: &[String],
    creates: Option<usize>,
) -> usize {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut max_unavailable = 0;
    loop {
        let proxies = world.proxies().list(&Default::default()).await.expect("list");
        let phases: Vec<(String, String)> = proxies
            .items
            .iter()
            .filter(|p| names.contains(&p.name_any()))
            .map(|p| (p.name_any(), phase_of(Some(p)).unwrap_or("pending").to_owned()))
            .collect();
        let unavailable = phases
            .iter()
            .filter(|(_, phase)| matches!(phase.as_str(), "pending" | "provisioning" | "replacing"))
            .count();
        max_unavailable = max_unavailable.max(unavailable);
        for (name, phase) in &phases {
            if phase == "provisioning" {
                world.health.set(&key(NS, name), passing());
                operator.trigger(key(NS, name)).await;
            }
        }
        let all_healthy = phases.len() == names.len() && phases.iter().all(|(_, p)| p == "healthy");
        if all_healthy && creates.is_none_or(|n| world.provider.created_count() >= n) {
            return max_unavailable;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not all healthy: {phases:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// All twenty fail their health checks at once (a shared health URL is down): the brake holds,
/// none is replaced, and each says why.
#[tokio::test]
async fn a_pool_wide_health_failure_replaces_none_while_the_brake_holds() {
    let world = World::new().await;
    let operator = world
        .start_with(|setup| setup.deps.reconciler.timers.degraded_timeout = Duration::from_secs(1))
        .await;
    let names: Vec<String> = (0..20).map(|i| format!("brake-{i:02}")).collect();
    for name in &names {
        world.create_proxy(name, json!({"provider": "mem"})).await;
    }
    drive_to_healthy(&world, &operator, &names, None).await;
    for name in &names {
        world.health.set(&key(NS, name), Verdict::Failing);
        operator.trigger(key(NS, name)).await;
    }
    for name in &names {
        world.wait_phase(name, "degraded").await;
    }
    // Several degraded timeouts pass; every proxy reports the paused remediation.
    for name in &names {
        world
            .wait_for(name, "RemediationPaused", |p| {
                p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == "RemediationPaused" && c.status == "True")
                })
            })
            .await;
    }
    // Two more degraded timeouts each (forty more re-checks of the brake, counted by the
    // controller's own metrics): the brake still holds.
    let paused = || operator.metric_sum("epo_transitions_total", "reason=\"RemediationPaused\"");
    let rechecks_from = paused();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while paused() < rechecks_from + 2 * names.len() as u64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the brake was re-checked {} times in 30 s",
            paused() - rechecks_from
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        world.provider.deleted_count(),
        0,
        "no instance was replaced while the brake held"
    );
    for name in &names {
        assert_eq!(
            phase_of(world.proxies().get_opt(name).await.expect("read").as_ref()),
            Some("degraded")
        );
    }
    operator.stop().await;
}

/// The providers config no longer names a Proxy's provider while its instance may still run:
/// deleting the Proxy keeps the finalizer (nothing can confirm the instance is gone) and says
/// why and what to do, instead of releasing the object and leaking the instance.
#[tokio::test]
async fn deleting_a_proxy_whose_provider_is_gone_keeps_the_finalizer_and_says_why() {
    let world = World::new().await;
    let operator = world.start().await;
    world.create_proxy("orphaned", json!({"provider": "mem"})).await;
    make_healthy(&world, &operator, "orphaned").await;
    operator.stop().await;

    // The operator restarts with a providers config that lacks `mem`.
    let operator = world
        .start_with(|setup| setup.deps.providers = ProviderRegistry::new())
        .await;
    world
        .proxies()
        .delete("orphaned", &DeleteParams::default())
        .await
        .expect("delete");
    let stuck = world
        .wait_for("orphaned", "DeleteFailed", |p| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| condition(s, "Ready").reason == "DeleteFailed")
        })
        .await
        .expect("still there");
    let message = &condition(stuck.status.as_ref().expect("status"), "Ready").message;
    assert!(
        message.contains("provider \"mem\" is not configured"),
        "{message}"
    );
    assert!(
        message.contains("remove the finalizer"),
        "the escape hatch is named: {message}"
    );
    assert!(
        stuck
            .finalizers()
            .iter()
            .any(|f| f == "crawl.example.com/proxy-cleanup")
    );
    assert_eq!(world.provider.names().len(), 1, "the instance was not touched");
    operator.stop().await;
}
