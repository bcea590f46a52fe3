//! Test support for the `local` provider: a state folder per test, free loopback ports, and
//! a view of the Squid processes in `/proc` that does not go through the provider.

use std::{
    collections::HashMap,
    os::unix::fs::PermissionsExt,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use async_trait::async_trait;
use egress_proxies_operator::{
    config::LocalSettings,
    provider::{Instance, InstanceRequest, Owner, Provider, ProviderError, local::LocalProvider},
};

use super::{
    contract::{self, ContractBackend},
    process::{kill_squid, processes_mentioning, squids},
};

pub use super::ports::free_port;

/// Creates `request` on `provider`, choosing another port if the free one was taken meanwhile
/// (by another test: ports are picked free, then bound later).
pub async fn create_on_a_free_port(provider: &LocalProvider, mut request: InstanceRequest) -> Instance {
    for _ in 0..3 {
        match provider.create(&request).await {
            Err(err) if err.to_string().contains("in use") => request.port = free_port(),
            Ok(instance) => return instance,
            Err(err) => panic!("create failed: {err}"),
        }
    }
    panic!("no free port after 3 attempts");
}

/// A private state folder that Squid (dropping to `proxy` when run as root) can reach, and
/// kills every Squid under it (and removes their shared memory) when dropped, whatever the
/// test's outcome.
pub struct StateDir {
    temp: tempfile::TempDir,
}

impl StateDir {
    /// A new, empty state folder.
    pub fn new() -> Self {
        let temp = tempfile::Builder::new()
            .prefix("epo-local-")
            .tempdir()
            .expect("temp dir");
        // tempfile makes it 0700; Squid's user must be able to search it.
        std::fs::set_permissions(temp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        Self { temp }
    }

    /// The folder to use as `stateDir`.
    pub fn path(&self) -> PathBuf {
        self.temp.path().join("state")
    }

    /// Settings on this folder, with short timeouts for tests.
    pub fn settings(&self) -> LocalSettings {
        LocalSettings {
            start_timeout_seconds: 10,
            stop_timeout_seconds: 5,
            ..LocalSettings::new(self.path())
        }
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        for pid in processes_mentioning(self.temp.path()) {
            kill_squid(pid);
        }
    }
}

/// The `local` provider as a contract backend: real Squid on 127.0.0.1.
pub struct LocalBackend {
    /// The state folder every opened provider shares.
    pub state: StateDir,
    settings: LocalSettings,
    requests: Mutex<HashMap<String, InstanceRequest>>,
}

impl LocalBackend {
    /// A backend on a fresh state folder.
    pub fn new() -> Self {
        Self::with_settings(|settings| settings)
    }

    /// A backend whose settings `adjust` changes.
    pub fn with_settings(adjust: impl FnOnce(LocalSettings) -> LocalSettings) -> Self {
        let state = StateDir::new();
        let settings = adjust(state.settings());
        Self {
            state,
            settings,
            requests: Mutex::default(),
        }
    }

    /// A provider on this backend's state folder.
    pub fn provider(&self) -> LocalProvider {
        LocalProvider::new("local", self.settings.clone()).expect("valid local settings")
    }
}

#[async_trait]
impl ContractBackend for LocalBackend {
    async fn open(&self) -> Arc<dyn Provider> {
        Arc::new(self.provider())
    }

    fn request(&self, owner: &Owner) -> InstanceRequest {
        let mut requests = self.requests.lock().expect("not poisoned");
        requests
            .entry(contract::name_for(owner))
            .or_insert_with(|| contract::plain_request(owner.clone(), free_port()))
            .clone()
    }

    async fn backend_objects(&self, name: &str) -> usize {
        squids(&self.state.path().join(name)).len()
    }

    fn retry_create(&self, name: &str, error: &ProviderError) -> bool {
        let port_taken = error.to_string().contains("in use");
        if port_taken {
            self.requests.lock().expect("not poisoned").remove(name);
        }
        port_taken
    }
}

impl Drop for LocalBackend {
    fn drop(&mut self) {
        let leaked = squids(&self.state.path());
        for pid in &leaked {
            kill_squid(*pid);
        }
        if !leaked.is_empty() && !std::thread::panicking() {
            panic!("Squid processes {leaked:?} were left running under the state folder");
        }
    }
}
