//! The provider contract suite: the properties every provider must keep (see
//! docs/provider-contract.md), checked against a real backend.
//!
//! A backend implements [`ContractBackend`] (how to open a provider on it, what a request
//! looks like, how to count its objects behind the provider's back); then either call
//! [`run_contract_suite`], or generate one test per property with [`contract_tests!`] so a
//! failure names the property:
//!
//! ```ignore
//! #[macro_use]
//! mod support {
//!     #[macro_use]
//!     pub mod contract;
//!     pub mod kvm2;
//! }
//! mod kvm2 {
//!     contract_tests!(crate::support::kvm2::Kvm2Backend::start().await);
//! }
//! ```
//!
//! Every check uses its own instance name (from a random UID) and deletes what it made, even
//! when it fails.

use std::{future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use egress_proxies_operator::{
    api::Placement,
    provider::{
        Instance, InstanceRequest, InstanceState, Owner, Provider, ProviderError, ProviderId, instance_name,
    },
};

/// How far a reported creation time may lie outside the create call (clock granularity,
/// backends that stamp on their side).
pub const CREATED_AT_SLACK: Duration = Duration::from_secs(60);

/// A backend the contract suite runs against.
#[async_trait]
pub trait ContractBackend: Send + Sync {
    /// A provider on this backend. Called again by [`create_after_crash`] after the first one
    /// was dropped: the new one must see the same backend state (a new process would).
    async fn open(&self) -> Arc<dyn Provider>;

    /// The request for `owner`'s instance (named [`name_for`]`(owner)`); the same owner must
    /// give the same request until [`ContractBackend::retry_create`] says otherwise.
    fn request(&self, owner: &Owner) -> InstanceRequest;

    /// How many backend objects (processes, domains, pods) exist for `name`, counted without
    /// the provider.
    async fn backend_objects(&self, name: &str) -> usize;

    /// Whether a failed create of `name` may be retried with a fresh request (e.g. a free port
    /// that was taken between choosing it and using it); the backend forgets `name`'s request.
    /// How long a delete may take to finish after it returned: zero where delete is
    /// synchronous (processes, libvirt domains); a Kubernetes Pod is deleted gracefully, and
    /// until its node confirms, `get` reports it `Stopped` (terminating), then NotFound.
    fn delete_settles(&self) -> Duration {
        Duration::ZERO
    }

    fn retry_create(&self, _name: &str, _error: &ProviderError) -> bool {
        false
    }
}

/// An owner for a contract check: a fresh UID each time, so names never collide.
pub fn new_owner(check: &str) -> Owner {
    Owner {
        uid: format!("{:016x}-{check}", fastrand::u64(..)),
        namespace: "contract".to_owned(),
        name: check.to_owned(),
    }
}

/// The deterministic instance name for `owner`.
pub fn name_for(owner: &Owner) -> String {
    instance_name(&owner.namespace, &owner.name, &owner.uid)
}

/// A request with no placement, no credentials and no user-data, for backends to adjust.
pub fn plain_request(owner: Owner, port: u16) -> InstanceRequest {
    InstanceRequest {
        name: name_for(&owner),
        owner,
        spec_hash: format!("spec-{:08x}", fastrand::u32(..)),
        placement: Placement::default(),
        port,
        user_data: None,
        credentials: None,
    }
}

/// Creates `owner`'s instance, retrying with a fresh request when the backend allows it.
pub async fn create(
    backend: &dyn ContractBackend,
    provider: &dyn Provider,
    owner: &Owner,
) -> Result<Instance, ProviderError> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        let request = backend.request(owner);
        match provider.create(&request).await {
            Err(err) if attempts < 3 && backend.retry_create(&request.name, &err) => continue,
            result => return result,
        }
    }
}

/// Runs `body`, then deletes `names` whatever happened, then reports `body`'s failure.
async fn with_cleanup<F>(provider: &dyn Provider, names: &[&str], body: F)
where
    F: Future<Output = Result<(), String>>,
{
    let outcome = body.await;
    for name in names {
        if let Err(err) = provider.delete(name).await {
            eprintln!("contract cleanup: cannot delete {name}: {err}");
        }
    }
    if let Err(message) = outcome {
        panic!("{message}");
    }
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

fn ensure_same(first: &Instance, second: &Instance, property: &str) -> Result<(), String> {
    ensure!(
        first.id == second.id,
        "{property}: IDs differ: {} then {}",
        first.id,
        second.id
    );
    ensure!(
        first.created_at == second.created_at,
        "{property}: creation times differ ({} then {}): a second instance was made",
        first.created_at,
        second.created_at
    );
    Ok(())
}

/// Creating the same name twice returns the same instance and makes one backend object; the
/// ID is self-contained.
pub async fn idempotent_create(backend: &dyn ContractBackend) {
    let provider = backend.open().await;
    let owner = new_owner("idempotent-create");
    let name = name_for(&owner);
    let body = async {
        let first = create(backend, &*provider, &owner)
            .await
            .map_err(|e| format!("idempotent create: first create failed: {e}"))?;
        let second = provider
            .create(&backend.request(&owner))
            .await
            .map_err(|e| format!("idempotent create: second create failed: {e}"))?;
        ensure_same(&first, &second, "idempotent create")?;
        let objects = backend.backend_objects(&name).await;
        ensure!(
            objects == 1,
            "idempotent create: {objects} backend objects for {name}, expected 1"
        );
        let id = &first.id;
        ensure!(
            id.provider_type == provider.provider_type() && id.instance == provider.instance(),
            "self-contained ID: {id} does not name type {} and instance {}",
            provider.provider_type(),
            provider.instance()
        );
        ensure!(
            id.to_string().parse::<ProviderId>().ok().as_ref() == Some(id),
            "self-contained ID: {id} does not round-trip through its string form"
        );
        ensure!(
            *id == provider.id_for(&name),
            "self-contained ID: create returned {id}, id_for says {}",
            provider.id_for(&name)
        );
        Ok(())
    };
    with_cleanup(&*provider, &[&name], body).await;
}

/// Two creates of one name at the same time make one backend object and agree on it.
pub async fn concurrent_create(backend: &dyn ContractBackend) {
    let provider = backend.open().await;
    let owner = new_owner("concurrent-create");
    let name = name_for(&owner);
    let body = async {
        // Fix the request before racing, so both ask for the same thing.
        let request = backend.request(&owner);
        let (a, b) = tokio::join!(provider.create(&request), provider.create(&request));
        let a = a.map_err(|e| format!("concurrent create: first failed: {e}"))?;
        let b = b.map_err(|e| format!("concurrent create: second failed: {e}"))?;
        ensure_same(&a, &b, "concurrent create")?;
        let objects = backend.backend_objects(&name).await;
        ensure!(
            objects == 1,
            "concurrent create: {objects} backend objects for {name}, expected 1"
        );
        Ok(())
    };
    with_cleanup(&*provider, &[&name], body).await;
}

/// After a delete returned, `get` says NotFound at once, or (within the backend's
/// [`ContractBackend::delete_settles`]) first `Stopped` and then NotFound: a terminating
/// instance never reads as running.
async fn gone_after_delete(
    backend: &dyn ContractBackend,
    provider: &dyn Provider,
    name: &str,
) -> Result<(), String> {
    let deadline = std::time::Instant::now() + backend.delete_settles();
    // Polled: the backend's own controllers finish the delete.
    loop {
        match provider.get(name).await {
            Err(ProviderError::NotFound(_)) => return Ok(()),
            Ok(instance)
                if instance.state == InstanceState::Stopped && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return Err(format!("get after delete gave {other:?}")),
        }
    }
}

/// `get` says NotFound for a name never created and for a deleted one, and finds an existing
/// one.
pub async fn truthful_not_found(backend: &dyn ContractBackend) {
    let provider = backend.open().await;
    let missing = name_for(&new_owner("never-created"));
    let owner = new_owner("truthful-not-found");
    let name = name_for(&owner);
    let body = async {
        match provider.get(&missing).await {
            Err(ProviderError::NotFound(_)) => {}
            other => {
                return Err(format!(
                    "truthful NotFound: get of a never-created name gave {other:?}"
                ));
            }
        }
        create(backend, &*provider, &owner)
            .await
            .map_err(|e| format!("truthful NotFound: create failed: {e}"))?;
        match provider.get(&name).await {
            Ok(instance) => ensure!(
                instance.id == provider.id_for(&name),
                "truthful NotFound: get returned {} for {name}",
                instance.id
            ),
            Err(err) => {
                return Err(format!(
                    "truthful NotFound: get of an existing instance failed: {err}"
                ));
            }
        }
        provider
            .delete(&name)
            .await
            .map_err(|e| format!("truthful NotFound: delete failed: {e}"))?;
        gone_after_delete(backend, &*provider, &name)
            .await
            .map_err(|e| format!("truthful NotFound: {e}"))
    };
    with_cleanup(&*provider, &[&name], body).await;
}

/// Deleting twice succeeds, as does deleting a name never created; afterwards the instance
/// is gone from the provider and the backend.
pub async fn idempotent_delete(backend: &dyn ContractBackend) {
    let provider = backend.open().await;
    let owner = new_owner("idempotent-delete");
    let name = name_for(&owner);
    let body = async {
        create(backend, &*provider, &owner)
            .await
            .map_err(|e| format!("idempotent delete: create failed: {e}"))?;
        for attempt in ["first", "second"] {
            provider
                .delete(&name)
                .await
                .map_err(|e| format!("idempotent delete: {attempt} delete failed: {e}"))?;
        }
        provider
            .delete(&name_for(&new_owner("never-created")))
            .await
            .map_err(|e| format!("idempotent delete: delete of a never-created name failed: {e}"))?;
        gone_after_delete(backend, &*provider, &name)
            .await
            .map_err(|e| format!("idempotent delete: {e}"))?;
        let listed = provider
            .list()
            .await
            .map_err(|e| format!("idempotent delete: list failed: {e}"))?;
        ensure!(
            !listed.iter().any(|i| i.id.native_id == name),
            "idempotent delete: {name} is still listed"
        );
        let objects = backend.backend_objects(&name).await;
        ensure!(
            objects == 0,
            "idempotent delete: {objects} backend objects left for {name}"
        );
        Ok(())
    };
    with_cleanup(&*provider, &[&name], body).await;
}

/// `list` reports each instance with its owner's UID, namespace and name, its spec hash and
/// a plausible creation time: what orphan GC decides from.
pub async fn list_reports_ownership(backend: &dyn ContractBackend) {
    let provider = backend.open().await;
    let owner = new_owner("list-ownership");
    let name = name_for(&owner);
    let body = async {
        let before = jiff::Timestamp::now();
        create(backend, &*provider, &owner)
            .await
            .map_err(|e| format!("list ownership: create failed: {e}"))?;
        let after = jiff::Timestamp::now();
        // The request create used (after any retry).
        let request = backend.request(&owner);
        let listed = provider
            .list()
            .await
            .map_err(|e| format!("list ownership: list failed: {e}"))?;
        let Some(instance) = listed.iter().find(|i| i.id.native_id == name) else {
            return Err(format!("list ownership: {name} is not listed"));
        };
        ensure!(
            instance.owner.as_ref() == Some(&request.owner),
            "list ownership: owner {:?}, expected {:?}",
            instance.owner,
            request.owner
        );
        ensure!(
            instance.spec_hash.as_deref() == Some(request.spec_hash.as_str()),
            "list ownership: spec hash {:?}, expected {:?}",
            instance.spec_hash,
            request.spec_hash
        );
        let slack = jiff::SignedDuration::try_from(CREATED_AT_SLACK).expect("small duration");
        ensure!(
            instance.created_at >= before - slack && instance.created_at <= after + slack,
            "list ownership: creation time {} is not within {before}..{after}",
            instance.created_at
        );
        Ok(())
    };
    with_cleanup(&*provider, &[&name], body).await;
}

/// After the provider is dropped (an operator crash) and a new one is opened on the same
/// backend, the instance is found, and creating it again returns it instead of a second one.
pub async fn create_after_crash(backend: &dyn ContractBackend) {
    let owner = new_owner("create-after-crash");
    let name = name_for(&owner);
    let first = {
        let provider = backend.open().await;
        match create(backend, &*provider, &owner).await {
            Ok(instance) => instance,
            Err(err) => {
                let _ = provider.delete(&name).await;
                panic!("create after crash: first create failed: {err}");
            }
        }
        // The provider is dropped here, as a crash would.
    };
    let provider = backend.open().await;
    let body = async {
        let found = provider
            .get(&name)
            .await
            .map_err(|e| format!("create after crash: the new provider cannot get {name}: {e}"))?;
        ensure_same(&first, &found, "create after crash (get)")?;
        let again = provider
            .create(&backend.request(&owner))
            .await
            .map_err(|e| format!("create after crash: create again failed: {e}"))?;
        ensure_same(&first, &again, "create after crash (create)")?;
        let objects = backend.backend_objects(&name).await;
        ensure!(
            objects == 1,
            "create after crash: {objects} backend objects for {name}, expected 1"
        );
        Ok(())
    };
    with_cleanup(&*provider, &[&name], body).await;
}

/// Every check, in order, against one backend.
pub async fn run_contract_suite(backend: &dyn ContractBackend) {
    idempotent_create(backend).await;
    concurrent_create(backend).await;
    truthful_not_found(backend).await;
    idempotent_delete(backend).await;
    list_reports_ownership(backend).await;
    create_after_crash(backend).await;
}

/// One `#[tokio::test]` per contract property, each with a fresh backend from `$backend`
/// (an expression evaluated inside the async test, so it may `.await`).
#[macro_export]
macro_rules! contract_tests {
    ($backend:expr) => {
        $crate::contract_tests!(@one idempotent_create, $backend);
        $crate::contract_tests!(@one concurrent_create, $backend);
        $crate::contract_tests!(@one truthful_not_found, $backend);
        $crate::contract_tests!(@one idempotent_delete, $backend);
        $crate::contract_tests!(@one list_reports_ownership, $backend);
        $crate::contract_tests!(@one create_after_crash, $backend);
    };
    (@one $check:ident, $backend:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $check() {
            let backend = $backend;
            $crate::support::contract::$check(&backend).await;
        }
    };
}
