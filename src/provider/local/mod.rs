//! The `local` provider: one Squid process per Proxy on this host. This is what standalone
//! mode uses by default.
//!
//! It owns, under its `stateDir`, one folder per instance (named by the deterministic
//! instance name; layout in [`state`]), and the Squid processes started from them. The
//! settings are checked in [`config`], the folders are read and assembled in [`table`], and
//! Squid is started, stopped and restarted in [`supervisor`] (over [`process`]).
//!
//! - **create** validates the request, checks the listen address and port are free, assembles
//!   the folder under a temporary name (owner record first, then password file and config),
//!   validates the config with `squid -k parse`, renames the folder into place, starts Squid
//!   in its own session and waits up to `startTimeoutSeconds` for it to accept connections.
//!   Any failure removes what was made: nothing leaks. Creating an existing name returns it.
//! - **liveness**: a pid (from `process.json`, else Squid's own pid file) counts only if
//!   `/proc/PID/cmdline` is our Squid binary running our config, so a recycled pid never does.
//!   `Running` when Squid is alive and its port accepts connections, `Starting` when alive but
//!   not yet accepting, `Stopped` when dead (or being deleted).
//! - **supervision**: a background task (started with the provider, stopped when it is
//!   dropped) scans the folders every [`SUPERVISE_INTERVAL`], and at once when a Squid this
//!   process started exits. A dead Squid whose folder is not being deleted is restarted, with
//!   exponential backoff ([`restart_backoff`]) so a crash loop does not spin; the backoff
//!   resets once the instance has stayed up for [`STABLE_AFTER`]. `get` and `list` only read.
//! - **delete** marks the folder `deleting`, stops Squid (SIGTERM, `stopTimeoutSeconds`, then
//!   SIGKILL) and removes the folder.
//! - One operator process owns a `stateDir`. Within it, a per-name lock serialises create,
//!   delete and restarts; across processes, Squid's own pid file and the listen port keep a
//!   second Squid for one instance from running.

mod config;
mod process;
mod state;
mod supervisor;
mod table;

use std::{
    collections::HashMap,
    fs, io,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, Weak},
    time::Instant,
};

use async_trait::async_trait;
use tokio::sync::Notify;

pub use self::{
    config::LocalSetupError,
    supervisor::{STABLE_AFTER, SUPERVISE_INTERVAL, SupervisionStatus, restart_backoff},
};
use self::{
    config::SquidUser, state::OwnerRecord, supervisor::Supervision, table::remove_stale_temp_folders,
};
use super::{
    Credentials, CredentialsCheck, CredentialsUpdate, Installation, Instance, InstanceRequest, InstanceState,
    ProbeReport, Provider, ProviderError,
    locks::NameLocks,
    squid::{self, Prepared},
};
use crate::{
    config::{LocalSettings, is_dns_label},
    sync::lock,
};

/// The provider type's name in the providers config.
pub const PROVIDER_TYPE: &str = "local";

/// The `local` provider instance.
pub struct LocalProvider {
    inner: Arc<Inner>,
    supervisor: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct Inner {
    instance: String,
    installation: Installation,
    settings: LocalSettings,
    bind_address: IpAddr,
    squid_user: Option<SquidUser>,
    locks: NameLocks,
    supervision: Mutex<HashMap<String, Supervision>>,
    wake: Arc<Notify>,
}

impl LocalProvider {
    /// The provider instance `instance` with `settings`. Checks the settings; touches no
    /// files except removing stale temporary folders of crashed creates. A relative
    /// `stateDir` is resolved against the working directory now (Squid configs need absolute
    /// paths). Inside a tokio runtime the supervisor starts at once, otherwise with the first
    /// call.
    pub fn new(instance: &str, settings: LocalSettings) -> Result<Self, LocalSetupError> {
        Self::for_installation(Installation::default(), instance, settings)
    }

    /// [`Self::new`] for `installation`: it stamps, supervises, returns and deletes only its
    /// own (and legacy) instances in the stateDir, which another installation may share.
    pub fn for_installation(
        installation: Installation,
        instance: &str,
        settings: LocalSettings,
    ) -> Result<Self, LocalSetupError> {
        let config::Checked {
            settings,
            bind_address,
            squid_user,
        } = config::check(settings)?;
        remove_stale_temp_folders(&settings.state_dir);
        let provider = Self {
            inner: Arc::new(Inner {
                instance: instance.to_owned(),
                installation,
                settings,
                bind_address,
                squid_user,
                locks: NameLocks::default(),
                supervision: Mutex::default(),
                wake: Arc::new(Notify::new()),
            }),
            supervisor: Mutex::default(),
        };
        provider.ensure_supervisor();
        Ok(provider)
    }

    /// The folder holding everything of the instance named `name`.
    pub fn instance_dir(&self, name: &str) -> PathBuf {
        self.inner.settings.state_dir.join(name)
    }

    /// The folder holding every instance.
    pub fn state_dir(&self) -> &Path {
        &self.inner.settings.state_dir
    }

    /// What supervision has done for `name`, if anything.
    pub fn supervision(&self, name: &str) -> Option<SupervisionStatus> {
        let now = Instant::now();
        lock(&self.inner.supervision)
            .get(name)
            .map(|s| SupervisionStatus {
                restarts: s.restarts,
                last_restart_at: s.last_restart_at,
                consecutive_attempts: s.attempts,
                last_error: s.last_error.clone(),
                next_attempt_in: s.next_attempt.map(|at| at.saturating_duration_since(now)),
            })
    }

    /// Runs one supervision pass now (the background task runs one every
    /// [`SUPERVISE_INTERVAL`]).
    pub async fn supervise_now(&self) {
        self.inner.supervise_once().await;
    }

    fn ensure_supervisor(&self) {
        let mut slot = lock(&self.supervisor);
        if slot.is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let wake = self.inner.wake.clone();
        *slot = Some(runtime.spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(SUPERVISE_INTERVAL) => {}
                    () = wake.notified() => {}
                }
                // The provider is gone: so is its supervision (its Squids keep running).
                let Some(inner) = weak.upgrade() else { break };
                inner.supervise_once().await;
            }
        }));
    }
}

impl Drop for LocalProvider {
    fn drop(&mut self) {
        if let Some(supervisor) = lock(&self.supervisor).take() {
            supervisor.abort();
        }
    }
}

#[async_trait]
impl Provider for LocalProvider {
    fn provider_type(&self) -> &'static str {
        PROVIDER_TYPE
    }

    fn instance(&self) -> &str {
        &self.inner.instance
    }

    fn installation(&self) -> &Installation {
        &self.inner.installation
    }

    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError> {
        self.ensure_supervisor();
        let inner = &self.inner;
        let name = request.name.as_str();
        if !is_dns_label(name) {
            return Err(ProviderError::Misconfigured(format!(
                "instance name {name:?} is not a DNS label"
            )));
        }
        // Before the folder is looked at: a request Squid cannot carry is refused whether or not
        // an instance of that name exists, and never reaches a file.
        let prepared = Prepared::for_request(request)?;
        let _guard = inner.locks.lock(name).await;
        let dir = inner.dir(name);
        if dir.root().exists() {
            if !dir.is_ours() {
                return Err(ProviderError::Misconfigured(format!(
                    "{} is in the way: this provider did not make it",
                    dir.root().display()
                )));
            }
            inner.refuse_foreign(name, &dir)?;
            if dir.is_deleting() {
                // A delete was interrupted (crash): finish it, then create afresh.
                inner.remove_instance(&dir).await?;
            } else {
                if inner.live_pid(&dir).is_none() {
                    // Made before a crash but not (or no longer) running: start it now rather
                    // than at the next supervision pass; if that fails, supervision retries.
                    if let Err(err) = inner.start(name, &dir).await {
                        tracing::warn!(instance = %inner.instance, name, error = %err, "cannot start existing squid");
                    }
                }
                return inner.read_instance(name).await;
            }
        }
        inner.create_new(request, prepared, &dir).await
    }

    async fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        self.ensure_supervisor();
        if !is_dns_label(name) {
            // No folder can have that name: it certainly does not exist.
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        match self.inner.read_instance(name).await? {
            // Another installation's: for this one it does not exist.
            instance if self.inner.installation.is_foreign(instance.installation.as_ref()) => {
                Err(ProviderError::NotFound(name.to_owned()))
            }
            instance => Ok(instance),
        }
    }

    async fn delete(&self, name: &str) -> Result<(), ProviderError> {
        self.ensure_supervisor();
        if !is_dns_label(name) {
            return Ok(());
        }
        let inner = &self.inner;
        let _guard = inner.locks.lock(name).await;
        let dir = inner.dir(name);
        match fs::symlink_metadata(dir.root()) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => {
                return Err(ProviderError::Backend(format!(
                    "cannot read {}: {err}",
                    dir.root().display()
                )));
            }
            // Not ours (see `instance_names`): for this provider it does not exist.
            Ok(_) if !dir.is_ours() => return Ok(()),
            Ok(_) if inner.is_foreign(&dir) => {
                tracing::info!(instance = %inner.instance, name, "delete: another installation's instance; left alone");
                return Ok(());
            }
            Ok(_) => {}
        }
        fs::File::create(dir.deleting_marker()).map_err(|err| {
            ProviderError::Backend(format!("cannot mark {} as deleting: {err}", dir.root().display()))
        })?;
        inner.remove_instance(&dir).await?;
        lock(&inner.supervision).remove(name);
        tracing::info!(instance = %inner.instance, name, "deleted local proxy");
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        self.ensure_supervisor();
        let inner = &self.inner;
        let mut instances = Vec::new();
        for name in inner.instance_names()? {
            match inner.read_instance(&name).await {
                Ok(instance) => instances.push(instance),
                // Deleted between listing the folder and reading it.
                Err(ProviderError::NotFound(_)) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(instances)
    }

    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        self.ensure_supervisor();
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let inner = &self.inner;
        let _guard = inner.locks.lock(name).await;
        let dir = inner.dir(name);
        if !dir.root().exists() || !dir.is_ours() {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let mut record: OwnerRecord = state::read_json(&dir.owner_file()).map_err(|err| {
            ProviderError::Misconfigured(format!(
                "{name} cannot be adopted: its owner record is unreadable: {err}"
            ))
        })?;
        inner
            .installation
            .refuse_foreign(name, record.installation.as_ref())?;
        if record.installation.is_none() {
            record.installation = Some(inner.installation.clone());
            state::write_json(&dir.owner_file(), &record).map_err(|err| {
                ProviderError::Backend(format!("cannot restamp {name}'s owner record: {err}"))
            })?;
        }
        inner.read_instance(name).await
    }

    fn updates_credentials_in_place(&self) -> bool {
        true
    }

    /// Rewrites the password file in place: Squid's `basic_ncsa_auth` re-reads it when it
    /// changes, so the new credentials work from the next request on, the old ones get 407, and
    /// nothing is restarted. Adding or removing authentication changes `squid.conf`: only a new
    /// instance can do that (`Unsupported`).
    async fn update_credentials(
        &self,
        name: &str,
        credentials: Option<&Credentials>,
    ) -> Result<CredentialsUpdate, ProviderError> {
        let inner = &self.inner;
        let _guard = inner.locks.lock(name).await;
        let (dir, record) = inner.owned_folder(name)?;
        let Some(credentials) = credentials else {
            return Ok(if record.authenticated {
                CredentialsUpdate::Unsupported
            } else {
                CredentialsUpdate::Applied
            });
        };
        if !record.authenticated {
            return Ok(CredentialsUpdate::Unsupported);
        }
        let line = squid::password_line(credentials)?;
        let passwords = dir.passwords_file();
        state::write_atomic(&passwords, line.as_bytes(), 0o640).map_err(|err| {
            ProviderError::Backend(format!("cannot write the password file of {name}: {err}"))
        })?;
        if let Some(user) = &inner.squid_user {
            std::os::unix::fs::chown(&passwords, None, Some(user.gid)).map_err(|err| {
                ProviderError::Backend(format!("cannot hand the password file of {name} to Squid: {err}"))
            })?;
        }
        tracing::info!(instance = %inner.instance, name, "proxy credentials updated in place");
        Ok(CredentialsUpdate::Applied)
    }

    /// Reads what the instance's folder says: whether its `squid.conf` asks for credentials
    /// (the owner record) and, if so, whether the password file's hash takes `credentials`.
    async fn check_credentials(
        &self,
        name: &str,
        credentials: Option<&Credentials>,
    ) -> Result<CredentialsCheck, ProviderError> {
        let inner = &self.inner;
        let _guard = inner.locks.lock(name).await;
        let (dir, record) = inner.owned_folder(name)?;
        let accepts = match (credentials, record.authenticated) {
            (None, authenticated) => !authenticated,
            (Some(_), false) => false,
            (Some(credentials), true) => {
                let line = fs::read_to_string(dir.passwords_file()).map_err(|err| {
                    ProviderError::Backend(format!("cannot read the password file of {name}: {err}"))
                })?;
                squid::password_line_accepts(&line, credentials)
            }
        };
        Ok(if accepts {
            CredentialsCheck::Accepts
        } else {
            CredentialsCheck::Differs
        })
    }

    fn supervision_of(&self, name: &str) -> Option<SupervisionStatus> {
        self.supervision(name)
    }

    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        self.ensure_supervisor();
        let inner = &self.inner;
        let version = process::squid_version(&inner.settings.squid_path).await?;
        inner.ensure_state_dir()?;
        let probe_file = inner
            .settings
            .state_dir
            .join(format!(".probe-{:08x}", fastrand::u32(..)));
        fs::write(&probe_file, b"probe")
            .and_then(|()| fs::remove_file(&probe_file))
            .map_err(|err| {
                let message = format!(
                    "stateDir {} is not writable: {err}",
                    inner.settings.state_dir.display()
                );
                if err.kind() == io::ErrorKind::PermissionDenied {
                    ProviderError::Misconfigured(message)
                } else {
                    ProviderError::Unavailable(message)
                }
            })?;
        let instances = self.list().await?;
        let running = instances
            .iter()
            .filter(|i| i.state == InstanceState::Running)
            .count();
        let mut detail = format!(
            "{version}; stateDir {}; {} instances, {running} running",
            inner.settings.state_dir.display(),
            instances.len()
        );
        if !inner.settings.auth_helper_path.exists() {
            detail.push_str(&format!(
                "; auth helper {} is missing (Proxies with credentials will fail)",
                inner.settings.auth_helper_path.display()
            ));
        }
        Ok(ProbeReport {
            instance_count: instances.len(),
            detail,
        })
    }
}

#[cfg(test)]
mod tests;
