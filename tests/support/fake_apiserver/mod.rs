//! An in-process fake Kubernetes API server that a real `kube::Client` talks to over HTTP
//! on 127.0.0.1, faithful where the operator depends on it: resourceVersion and generation,
//! the status subresource, finalizers and deletionTimestamp, label and field selectors,
//! merge / JSON / apply patches, 409 conflicts, `Status` error bodies, and list + watch with
//! bookmarks and 410 Gone on a stale resourceVersion; and what a real kubectl needs: stored
//! CRDs served as they declare, OpenAPI v3, `fieldValidation`, server-side Tables from printer
//! columns, `events.k8s.io` Events listed through core v1. Test hooks inject failures, compact
//! the watch history, end open watches, count requests and reach the store directly.
//!
//! What is faithful and what is simplified is documented in docs/testing.md
//! ("Fake API server"). Include it from an integration test with `mod support;` (see
//! `tests/support/mod.rs`) or from a bench with
//! `#[path = "../tests/support/fake_apiserver/mod.rs"] mod fake_apiserver;`.
//!
//! ```ignore
//! let server = FakeApiServer::start().await;
//! let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
//! ```

// Not every test uses every hook.
#![allow(dead_code)]

mod crd;
mod openapi;
mod patch;
mod registry;
mod selector;
mod server;
mod status;
mod store;
mod table;

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use serde_json::{Value, json};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

pub use registry::ResourceDef;
#[allow(unused_imports)]
pub use status::{FieldError, FieldErrorKind};

use store::{Deletion, Store, Target};

/// Locks a mutex, ignoring poisoning: a panicking test must not cascade into every other
/// request of the same server.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// API verbs, as Kubernetes names them in audit logs and RBAC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
}

impl Verb {
    /// POST, PUT, PATCH or DELETE.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            Self::Create | Self::Update | Self::Patch | Self::Delete | Self::DeleteCollection
        )
    }
}

/// One request the server answered (injected failures included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    pub verb: Verb,
    /// API group, empty for core.
    pub group: String,
    /// Plural resource name, e.g. `proxies`.
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// `status` for `/status` requests.
    pub subresource: Option<String>,
    /// PATCH content type, e.g. `application/merge-patch+json`.
    pub content_type: Option<String>,
    /// `fieldManager` query parameter.
    pub field_manager: Option<String>,
    /// HTTP status code sent (200 for a watch that started).
    pub code: u16,
}

impl RequestRecord {
    /// Whether it succeeded (2xx).
    pub fn succeeded(&self) -> bool {
        (200..300).contains(&self.code)
    }
}

/// Selects requests for [`FakeApiServer::fail_next`]; unset fields match anything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestMatcher {
    verb: Option<Verb>,
    resource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<Option<String>>,
}

impl RequestMatcher {
    /// Matches every request.
    pub fn any() -> Self {
        Self::default()
    }

    /// Only this verb.
    pub fn verb(mut self, verb: Verb) -> Self {
        self.verb = Some(verb);
        self
    }

    /// Only this resource: `proxies` or `proxies.crawl.example.com`.
    pub fn resource(mut self, resource: &str) -> Self {
        self.resource = Some(resource.to_owned());
        self
    }

    /// Only this namespace.
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.to_owned());
        self
    }

    /// Only this object name.
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Only this subresource (`status`).
    pub fn subresource(mut self, subresource: &str) -> Self {
        self.subresource = Some(Some(subresource.to_owned()));
        self
    }

    /// Only the main resource (no subresource).
    pub fn main_resource(mut self) -> Self {
        self.subresource = Some(None);
        self
    }

    fn matches(&self, r: &RequestRecord) -> bool {
        let qualified = if r.group.is_empty() {
            r.resource.clone()
        } else {
            format!("{}.{}", r.resource, r.group)
        };
        self.verb.is_none_or(|v| v == r.verb)
            && self
                .resource
                .as_deref()
                .is_none_or(|res| res == r.resource || res == qualified)
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| Some(ns) == r.namespace.as_deref())
            && self.name.as_deref().is_none_or(|n| Some(n) == r.name.as_deref())
            && self.subresource.as_ref().is_none_or(|s| s == &r.subresource)
    }
}

/// Start-up options.
#[derive(Clone, Debug)]
pub struct Options {
    /// How often a watch with `allowWatchBookmarks=true` gets a BOOKMARK.
    pub bookmark_interval: Duration,
    /// Events kept per resource for watches to replay; a watch from an RV older than the
    /// oldest kept event gets 410 Expired.
    pub history_limit: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            bookmark_interval: Duration::from_secs(1),
            history_limit: 10_000,
        }
    }
}

struct Failure {
    matcher: RequestMatcher,
    remaining: usize,
    code: u16,
}

/// The audience of tokens the fake API server issues itself (a TokenReview without audiences
/// checks this one), as kube-apiserver's default `--api-audiences`.
pub const API_SERVER_AUDIENCE: &str = "https://kubernetes.default.svc";

/// Who a token added with [`FakeApiServer::add_token`] authenticates as, and for which audiences.
#[derive(Clone, Debug)]
struct TokenIdentity {
    username: String,
    audiences: Vec<String>,
}

#[derive(Default)]
struct Hooks {
    requests: Vec<RequestRecord>,
    failures: Vec<Failure>,
    latency: Duration,
    /// Tokens TokenReview accepts.
    tokens: std::collections::HashMap<String, TokenIdentity>,
}

/// State shared by the server task, its connections and the test's handle.
struct Inner {
    store: Mutex<Store>,
    hooks: Mutex<Hooks>,
    /// Bumped by `expire_watches`; every open watch ends when it changes.
    expire: watch::Sender<u64>,
    open_watches: AtomicUsize,
    bookmark_interval: Duration,
    addr: SocketAddr,
}

impl Inner {
    /// Serves what every stored CustomResourceDefinition defines (idempotent).
    fn install_crds(&self) {
        let mut store = lock(&self.store);
        let Some(rid) = store.resolve(crd::CRD_RESOURCE) else {
            return;
        };
        for object in store.all(rid, None) {
            crd::install(&mut store, &object);
        }
    }

    fn take_injected_failure(&self, record: &RequestRecord) -> Option<u16> {
        let mut hooks = lock(&self.hooks);
        let failure = hooks
            .failures
            .iter_mut()
            .find(|f| f.remaining > 0 && f.matcher.matches(record))?;
        failure.remaining -= 1;
        let code = failure.code;
        hooks.failures.retain(|f| f.remaining > 0);
        Some(code)
    }
}

/// The fake API server; dropping it shuts it down (open connections and watches end).
pub struct FakeApiServer {
    inner: Arc<Inner>,
    task: JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeApiServer {
    /// Starts a server on 127.0.0.1 (an ephemeral port) serving the default resources.
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    /// Starts a server with `options`.
    pub async fn start_with(options: Options) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0 for the fake API server");
        let addr = listener
            .local_addr()
            .expect("a bound listener has a local address");
        let mut store = Store::new(registry::default_resources(), options.history_limit);
        // A real API server always has these; the operator reads kube-system's UID as the
        // cluster's identity.
        let namespaces = resolve(&store, "namespaces");
        for name in ["default", "kube-system"] {
            store
                .create(
                    namespaces,
                    None,
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
                    false,
                    true,
                )
                .expect("a fresh store takes the built-in namespaces");
        }
        let inner = Arc::new(Inner {
            store: Mutex::new(store),
            hooks: Mutex::new(Hooks::default()),
            expire: watch::channel(0).0,
            open_watches: AtomicUsize::new(0),
            bookmark_interval: options.bookmark_interval,
            addr,
        });
        let task = tokio::spawn(server::serve(listener, inner.clone()));
        Self { inner, task }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.inner.addr)
    }

    /// A real `kube::Client` for this server (no TLS, no auth, default namespace
    /// `default`, kube's default retry of 429/503/504 left on, as in production).
    pub fn client(&self) -> kube::Client {
        let url = self.url().parse().expect("the server URL is a valid URI");
        let config = kube::Config::new(url);
        kube::Client::try_from(config).expect("a kube client for a plain-HTTP URL builds")
    }

    /// Serves another resource (or redefines one).
    pub fn register(&self, def: ResourceDef) {
        lock(&self.inner.store).register(def);
    }

    /// Validates every create and update of `resource` over HTTP (e.g. a CRD's schema and
    /// CEL rules); any error makes the write a 422 `Invalid`.
    pub fn set_validator(
        &self,
        resource: &str,
        validator: impl Fn(&Value, Option<&Value>) -> Vec<FieldError> + Send + Sync + 'static,
    ) {
        let mut store = lock(&self.inner.store);
        let rid = resolve(&store, resource);
        store.set_validator(rid, Arc::new(validator));
    }

    /// The next `times` requests matching `matcher` fail with `code` and a Status body
    /// shaped as the API server's for that code (409 → Conflict "the object has been
    /// modified", 500 → InternalError, 503 → ServiceUnavailable...), without side effects.
    /// Calling it again with an equal matcher replaces the earlier injection, so `times = 0`
    /// ends an outage early.
    pub fn fail_next(&self, matcher: RequestMatcher, times: usize, code: u16) {
        let mut hooks = lock(&self.inner.hooks);
        hooks.failures.retain(|f| f.matcher != matcher);
        if times > 0 {
            hooks.failures.push(Failure {
                matcher,
                remaining: times,
                code,
            });
        }
    }

    /// Makes every resourceVersion handed out so far too old: watches from them get a 410
    /// Expired ERROR event. Open watches that are caught up keep going (as after an etcd
    /// compaction); combine with [`Self::expire_watches`] to make them re-watch and relist.
    pub fn compact(&self) {
        lock(&self.inner.store).compact();
    }

    /// Ends every open watch stream cleanly; clients re-watch from their last RV.
    pub fn expire_watches(&self) {
        self.inner.expire.send_modify(|generation| *generation += 1);
    }

    /// Number of watch streams currently open.
    pub fn open_watches(&self) -> usize {
        self.inner.open_watches.load(Ordering::SeqCst)
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.inner.hooks).requests.clone()
    }

    /// Every write request (POST, PUT, PATCH, DELETE) answered so far, failed ones included.
    pub fn writes(&self) -> Vec<RequestRecord> {
        lock(&self.inner.hooks)
            .requests
            .iter()
            .filter(|r| r.verb.is_write())
            .cloned()
            .collect()
    }

    /// Forgets the requests recorded so far.
    pub fn clear_requests(&self) {
        lock(&self.inner.hooks).requests.clear();
    }

    /// Makes TokenReview accept `token` as `username` for `audiences` (empty: the API
    /// server's own, [`API_SERVER_AUDIENCE`]), like a projected service-account token.
    pub fn add_token(&self, token: &str, username: &str, audiences: &[&str]) {
        let audiences = if audiences.is_empty() {
            vec![API_SERVER_AUDIENCE.to_owned()]
        } else {
            audiences.iter().map(|a| (*a).to_owned()).collect()
        };
        lock(&self.inner.hooks).tokens.insert(
            token.to_owned(),
            TokenIdentity {
                username: username.to_owned(),
                audiences,
            },
        );
    }

    /// Delays every request by `latency` before it is handled.
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.inner.hooks).latency = latency;
    }

    /// The cluster-wide resourceVersion of the latest write.
    pub fn resource_version(&self) -> u64 {
        lock(&self.inner.store).rv
    }

    /// An object as stored, bypassing HTTP. `namespace` is ignored for cluster-scoped ones.
    pub fn get_json(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let store = lock(&self.inner.store);
        let rid = resolve(&store, resource);
        let ns = if store.def(rid).namespaced {
            namespace.unwrap_or("default")
        } else {
            ""
        };
        store
            .get(rid, &(ns.to_owned(), name.to_owned()))
            .ok()
            .map(|o| (*o).clone())
    }

    /// All objects of `resource` in `namespace` (every namespace when None).
    pub fn list_json(&self, resource: &str, namespace: Option<&str>) -> Vec<Value> {
        let store = lock(&self.inner.store);
        let rid = resolve(&store, resource);
        store.all(rid, namespace).iter().map(|o| (**o).clone()).collect()
    }

    /// How many objects of `resource` in `namespace` (every namespace when None) satisfy
    /// `predicate`, without copying them (benchmarks poll this at 10,000 objects).
    pub fn count_json(
        &self,
        resource: &str,
        namespace: Option<&str>,
        predicate: impl Fn(&Value) -> bool,
    ) -> usize {
        let store = lock(&self.inner.store);
        let rid = resolve(&store, resource);
        store.all(rid, namespace).iter().filter(|o| predicate(o)).count()
    }

    /// Creates or replaces an object bypassing HTTP (status included, no validator, no
    /// preconditions), with the server-owned metadata a real write would get; watches see
    /// it. The namespace comes from `metadata.namespace` (default `default`).
    pub fn put_json(&self, resource: &str, object: Value) -> Value {
        let mut store = lock(&self.inner.store);
        let rid = resolve(&store, resource);
        let def = store.def(rid);
        let ns = if def.namespaced {
            object
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or("default")
                .to_owned()
        } else {
            String::new()
        };
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let key = (ns.clone(), name);
        let mut object = object;
        if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            metadata.remove("resourceVersion");
        }
        let result = if store.get(rid, &key).is_ok() {
            store.update(rid, &key, object, Target::Whole, false, false)
        } else {
            store.create(rid, def.namespaced.then_some(ns.as_str()), object, false, true)
        };
        drop(store);
        match result {
            Ok(stored) => {
                if def.is_named(crd::CRD_RESOURCE) {
                    self.inner.install_crds();
                }
                (*stored).clone()
            }
            Err(error) => panic!("put_json({resource}) was rejected: {}", error.message),
        }
    }

    /// Deletes an object bypassing HTTP, honouring finalizers as DELETE does. Returns
    /// whether it is gone (false: marked for deletion, or absent).
    pub fn delete_json(&self, resource: &str, namespace: Option<&str>, name: &str) -> bool {
        let mut store = lock(&self.inner.store);
        let rid = resolve(&store, resource);
        let ns = if store.def(rid).namespaced {
            namespace.unwrap_or("default")
        } else {
            ""
        };
        matches!(
            store.delete(rid, &(ns.to_owned(), name.to_owned()), None, None, false),
            Ok(Deletion::Gone(_))
        )
    }
}

fn resolve(store: &Store, resource: &str) -> usize {
    store
        .resolve(resource)
        .unwrap_or_else(|| panic!("the fake API server serves no resource named {resource}"))
}
