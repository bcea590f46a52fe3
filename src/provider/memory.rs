//! An in-memory provider: instances are map entries. It keeps the whole contract (idempotent
//! create and delete, truthful NotFound, persisted owners) and can be told to fail, so the
//! controller's tests and benchmarks exercise the real pipeline without a backend. It is not
//! selectable from a providers config.

use std::{
    collections::BTreeMap,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

use async_trait::async_trait;

use super::{
    Endpoint, Installation, Instance, InstanceRequest, InstanceState, ProbeReport, Provider, ProviderError,
};

/// The in-memory provider. Instances start `Running` unless [`MemoryProvider::start_instances_as`]
/// says otherwise.
pub struct MemoryProvider {
    instance: String,
    installation: Installation,
    instances: Mutex<BTreeMap<String, Instance>>,
    unavailable: AtomicBool,
    failing_creates: AtomicUsize,
    create_calls: AtomicUsize,
    creates: AtomicUsize,
    deletes: AtomicUsize,
    initial_state: Mutex<InstanceState>,
    clock: fn() -> jiff::Timestamp,
}

impl MemoryProvider {
    /// A provider instance named `instance`.
    pub fn new(instance: &str) -> Self {
        Self {
            instance: instance.to_owned(),
            installation: Installation::default(),
            instances: Mutex::default(),
            unavailable: AtomicBool::new(false),
            failing_creates: AtomicUsize::new(0),
            create_calls: AtomicUsize::new(0),
            creates: AtomicUsize::new(0),
            deletes: AtomicUsize::new(0),
            initial_state: Mutex::new(InstanceState::Running),
            clock: jiff::Timestamp::now,
        }
    }

    /// Stamp `installation` instead of the default one.
    pub fn with_installation(mut self, installation: Installation) -> Self {
        self.installation = installation;
        self
    }

    /// Use `clock` for creation times (tests pin time).
    pub fn with_clock(mut self, clock: fn() -> jiff::Timestamp) -> Self {
        self.clock = clock;
        self
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Instance>> {
        // A panic while holding the lock leaves a consistent map (every write is one insert or
        // remove), so a poisoned lock is safe to keep using.
        crate::sync::lock(&self.instances)
    }

    /// Makes every call fail with `Unavailable` until called again with `false`.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.unavailable.store(unavailable, Ordering::SeqCst);
    }

    /// Makes the next `count` creates fail with a backend error.
    pub fn fail_next_creates(&self, count: usize) {
        self.failing_creates.store(count, Ordering::SeqCst);
    }

    /// State new instances start in.
    pub fn start_instances_as(&self, state: InstanceState) {
        *crate::sync::lock(&self.initial_state) = state;
    }

    /// Sets the state of an existing instance (e.g. to simulate a crash).
    pub fn set_state(&self, name: &str, state: InstanceState) {
        if let Some(instance) = self.lock().get_mut(name) {
            instance.state = state;
        }
    }

    /// Removes an instance behind the operator's back (it "vanished").
    pub fn vanish(&self, name: &str) {
        self.lock().remove(name);
    }

    /// Inserts an instance as if another process had made it (for GC tests).
    pub fn insert_raw(&self, instance: Instance) {
        self.lock().insert(instance.id.native_id.clone(), instance);
    }

    /// Names of the current instances.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// How many times `create` was called, failures included.
    pub fn create_calls(&self) -> usize {
        self.create_calls.load(Ordering::SeqCst)
    }

    /// How many creates actually made a new instance.
    pub fn created_count(&self) -> usize {
        self.creates.load(Ordering::SeqCst)
    }

    /// How many deletes actually removed an instance.
    pub fn deleted_count(&self) -> usize {
        self.deletes.load(Ordering::SeqCst)
    }

    fn check_available(&self) -> Result<(), ProviderError> {
        if self.unavailable.load(Ordering::SeqCst) {
            Err(ProviderError::Unavailable(format!(
                "memory provider {} is switched off",
                self.instance
            )))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl Provider for MemoryProvider {
    fn provider_type(&self) -> &'static str {
        "memory"
    }

    fn instance(&self) -> &str {
        &self.instance
    }

    fn installation(&self) -> &Installation {
        &self.installation
    }

    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError> {
        self.create_calls.fetch_add(1, Ordering::SeqCst);
        self.check_available()?;
        if let Some(existing) = self.lock().get(&request.name) {
            self.installation
                .refuse_foreign(&request.name, existing.installation.as_ref())?;
            return Ok(existing.clone());
        }
        if self
            .failing_creates
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(ProviderError::Backend("scripted create failure".to_owned()));
        }
        let state = crate::sync::lock(&self.initial_state).clone();
        let instance = Instance {
            id: self.id_for(&request.name),
            owner: Some(request.owner.clone()),
            installation: Some(self.installation.clone()),
            spec_hash: Some(request.spec_hash.clone()),
            created_at: (self.clock)(),
            state,
            endpoint: Some(Endpoint {
                host: request
                    .placement
                    .address
                    .clone()
                    .unwrap_or_else(|| "127.0.0.1".to_owned()),
                port: request.port,
            }),
        };
        let mut instances = self.lock();
        // Another task may have created it between the check and now: keep the first one.
        let stored = instances.entry(request.name.clone()).or_insert_with(|| {
            self.creates.fetch_add(1, Ordering::SeqCst);
            instance
        });
        Ok(stored.clone())
    }

    async fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        self.check_available()?;
        self.lock()
            .get(name)
            .filter(|i| !self.installation.is_foreign(i.installation.as_ref()))
            .cloned()
            .ok_or_else(|| ProviderError::NotFound(name.to_owned()))
    }

    async fn delete(&self, name: &str) -> Result<(), ProviderError> {
        self.check_available()?;
        let mut instances = self.lock();
        let foreign = instances
            .get(name)
            .is_some_and(|i| self.installation.is_foreign(i.installation.as_ref()));
        if !foreign && instances.remove(name).is_some() {
            self.deletes.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        self.check_available()?;
        let mut instances = self.lock();
        let instance = instances
            .get_mut(name)
            .ok_or_else(|| ProviderError::NotFound(name.to_owned()))?;
        self.installation
            .refuse_foreign(name, instance.installation.as_ref())?;
        instance.installation = Some(self.installation.clone());
        Ok(instance.clone())
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        self.check_available()?;
        Ok(self.lock().values().cloned().collect())
    }

    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        self.check_available()?;
        Ok(ProbeReport {
            instance_count: self.lock().len(),
            detail: "in-memory".to_owned(),
        })
    }
}
