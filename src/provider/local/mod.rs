//! The `local` provider: one Squid process per Proxy on this host. This is what standalone
//! mode uses by default.
//!
//! It owns, under its `stateDir`, one folder per instance (named by the deterministic
//! instance name; layout in [`state`]), and the Squid processes started from them.
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

mod process;
mod squid_config;
mod state;

use std::{
    collections::HashMap,
    fs, io,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::{Duration, Instant, SystemTime},
};

use async_trait::async_trait;
use tokio::sync::Notify;

use self::{
    squid_config::SquidConfig,
    state::{InstanceDir, OWNER_RECORD_VERSION, OwnerRecord, ProcessRecord, TEMP_PREFIX, TRASH_PREFIX},
};
use super::{
    Endpoint, Installation, Instance, InstanceRequest, InstanceState, ProbeReport, Provider, ProviderError,
    ProviderId,
};
use crate::config::{LocalSettings, is_dns_label};

/// The provider type's name in the providers config.
pub const PROVIDER_TYPE: &str = "local";

/// How often the supervisor looks for dead Squids.
pub const SUPERVISE_INTERVAL: Duration = Duration::from_secs(2);

/// First restart delay after a failed or short-lived restart; doubles per attempt.
const BACKOFF_BASE: Duration = Duration::from_secs(1);

/// Longest delay between two restart attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// How long a restarted Squid must stay up before its backoff resets.
pub const STABLE_AFTER: Duration = Duration::from_secs(30);

/// How often `create` looks whether a new Squid accepts connections yet.
const START_POLL: Duration = Duration::from_millis(50);

/// How long a restart waits for the previous Squid to finish exiting.
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// Temporary folders older than this are leftovers of a crashed create.
const STALE_TEMP_AGE: Duration = Duration::from_secs(600);

/// The delay before restart attempt number `attempt` (1-based) of an instance whose Squid
/// keeps dying: none for the first, then 1 s, 2 s, 4 s... up to a minute.
pub fn restart_backoff(attempt: u32) -> Duration {
    match attempt {
        0 | 1 => Duration::ZERO,
        n => BACKOFF_BASE
            .saturating_mul(1u32 << (n - 2).min(16))
            .min(BACKOFF_MAX),
    }
}

/// Settings that cannot work, found when the provider is built.
#[derive(Debug, thiserror::Error)]
pub enum LocalSetupError {
    /// A relative `stateDir` cannot be made absolute (no working directory).
    #[error("stateDir {path:?} is relative and the working directory is unknown: {reason}")]
    StateDirUnresolvable {
        /// The setting.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A path that goes into squid.conf has a character Squid's config syntax cannot carry.
    #[error(
        "{field} {path:?} cannot be written into a Squid config: it must not contain spaces, quotes or '#'"
    )]
    UnusablePath {
        /// The setting.
        field: &'static str,
        /// Its value.
        path: PathBuf,
    },
    /// An address setting is not an IP address.
    #[error("{field} {value:?} is not an IP address")]
    NotAnAddress {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: String,
    },
    /// An `extraConfig` entry is empty or spans lines.
    #[error("extraConfig[{0}] must be one Squid directive on one line")]
    ExtraConfig(usize),
    /// A timeout is zero.
    #[error("{0} must be at least 1")]
    ZeroTimeout(&'static str),
    /// The operator runs as root and `squidUser` does not exist.
    #[error("squidUser {0:?} does not exist on this host (Squid drops to it when the operator runs as root)")]
    UnknownSquidUser(String),
}

/// What supervision has done for one instance (for diagnostics and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SupervisionStatus {
    /// Restarts that started a Squid.
    pub restarts: u64,
    /// Restart attempts since the instance last stayed up for [`STABLE_AFTER`].
    pub consecutive_attempts: u32,
    /// Why the last attempt failed, if it did.
    pub last_error: Option<String>,
    /// When the next attempt may happen, from now, if one is pending.
    pub next_attempt_in: Option<Duration>,
}

#[derive(Default)]
struct Supervision {
    restarts: u64,
    attempts: u32,
    last_attempt: Option<Instant>,
    next_attempt: Option<Instant>,
    last_error: Option<String>,
}

/// The user Squid drops to when started as root.
#[derive(Clone, Debug)]
struct SquidUser {
    name: String,
    uid: u32,
    gid: u32,
}

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

/// What `create` derived from a request.
struct Plan {
    listen: SocketAddr,
    outgoing: Option<IpAddr>,
    password_line: Option<String>,
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
        mut settings: LocalSettings,
    ) -> Result<Self, LocalSetupError> {
        settings.state_dir = std::path::absolute(&settings.state_dir).map_err(|err| {
            LocalSetupError::StateDirUnresolvable {
                path: settings.state_dir.clone(),
                reason: err.to_string(),
            }
        })?;
        for (field, path) in [
            ("stateDir", &settings.state_dir),
            ("authHelperPath", &settings.auth_helper_path),
        ] {
            if !squid_config::is_config_token(&path.to_string_lossy()) {
                return Err(LocalSetupError::UnusablePath {
                    field,
                    path: path.clone(),
                });
            }
        }
        let bind_address = parse_ip("bindAddress", &settings.bind_address)?;
        if let Some(advertise) = &settings.advertise_address {
            parse_ip("advertiseAddress", advertise)?;
        }
        if let Some(index) = settings
            .extra_config
            .iter()
            .position(|line| line.trim().is_empty() || line.contains(['\n', '\r']))
        {
            return Err(LocalSetupError::ExtraConfig(index));
        }
        if settings.start_timeout_seconds == 0 {
            return Err(LocalSetupError::ZeroTimeout("startTimeoutSeconds"));
        }
        if settings.stop_timeout_seconds == 0 {
            return Err(LocalSetupError::ZeroTimeout("stopTimeoutSeconds"));
        }
        let squid_user = if rustix::process::geteuid().is_root() {
            let (uid, gid) = lookup_user(&settings.squid_user)
                .ok_or_else(|| LocalSetupError::UnknownSquidUser(settings.squid_user.clone()))?;
            Some(SquidUser {
                name: settings.squid_user.clone(),
                uid,
                gid,
            })
        } else {
            None
        };
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
        inner.create_new(request, &dir).await
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

impl Inner {
    fn dir(&self, name: &str) -> InstanceDir {
        InstanceDir::at(self.settings.state_dir.join(name))
    }

    fn id(&self, name: &str) -> ProviderId {
        ProviderId::new(PROVIDER_TYPE, &self.instance, name)
    }

    /// The installation `dir`'s owner record names (`None`: legacy or unreadable).
    fn stamped_installation(&self, dir: &InstanceDir) -> Option<Installation> {
        state::read_json::<OwnerRecord>(&dir.owner_file())
            .ok()
            .and_then(|record| record.installation)
    }

    /// Whether `dir` is another installation's instance.
    fn is_foreign(&self, dir: &InstanceDir) -> bool {
        self.installation
            .is_foreign(self.stamped_installation(dir).as_ref())
    }

    /// For `create` of `name`: the error if another installation made `dir`.
    fn refuse_foreign(&self, name: &str, dir: &InstanceDir) -> Result<(), ProviderError> {
        self.installation
            .refuse_foreign(name, self.stamped_installation(dir).as_ref())
    }

    /// Folder names that are instances made by this provider (they hold an owner record or a
    /// config); temporary and foreign folders are skipped.
    fn instance_names(&self) -> Result<Vec<String>, ProviderError> {
        let entries = match fs::read_dir(&self.settings.state_dir) {
            Ok(entries) => entries,
            // Nothing was ever created.
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => {
                return Err(ProviderError::Unavailable(format!(
                    "cannot list stateDir {}: {err}",
                    self.settings.state_dir.display()
                )));
            }
        };
        let mut names: Vec<String> = entries
            .filter_map(|entry| {
                let entry = entry.ok()?;
                let name = entry.file_name().into_string().ok()?;
                let dir = InstanceDir::at(entry.path());
                let ours = is_dns_label(&name) && entry.file_type().ok()?.is_dir() && dir.is_ours();
                ours.then_some(name)
            })
            .collect();
        names.sort();
        Ok(names)
    }

    /// The instance as its folder and process say.
    async fn read_instance(&self, name: &str) -> Result<Instance, ProviderError> {
        let dir = self.dir(name);
        let metadata = match fs::metadata(dir.root()) {
            Ok(metadata) if metadata.is_dir() => metadata,
            Ok(_) => return Err(ProviderError::NotFound(name.to_owned())),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(ProviderError::NotFound(name.to_owned()));
            }
            Err(err) => {
                return Err(ProviderError::Backend(format!(
                    "cannot read {}: {err}",
                    dir.root().display()
                )));
            }
        };
        if !dir.is_ours() {
            // A folder this provider did not make (see `instance_names`).
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let record = match state::read_json::<OwnerRecord>(&dir.owner_file()) {
            Ok(record) => Some(record),
            Err(err) => {
                // Reported without an owner: orphan GC never touches such an instance.
                tracing::warn!(instance = %self.instance, name, error = %err, "owner record unreadable");
                None
            }
        };
        let listen = record.as_ref().and_then(|r| listen_of(r).ok());
        let state = if dir.is_deleting() {
            InstanceState::Stopped
        } else if self.live_pid(&dir).is_some() {
            match listen {
                Some(listen) if !process::accepts_connections(listen).await => InstanceState::Starting,
                _ => InstanceState::Running,
            }
        } else {
            InstanceState::Stopped
        };
        let created_at = record.as_ref().map(|r| r.created_at).unwrap_or_else(|| {
            metadata
                .modified()
                .ok()
                .and_then(|time: SystemTime| jiff::Timestamp::try_from(time).ok())
                .unwrap_or(jiff::Timestamp::UNIX_EPOCH)
        });
        let endpoint = record.as_ref().map(|r| Endpoint {
            host: self
                .settings
                .advertise_address
                .clone()
                .unwrap_or_else(|| r.address.clone()),
            port: r.port,
        });
        Ok(Instance {
            id: self.id(name),
            owner: record.as_ref().map(|r| r.owner.clone()),
            installation: record.as_ref().and_then(|r| r.installation.clone()),
            spec_hash: record.as_ref().map(|r| r.spec_hash.clone()),
            created_at,
            state,
            endpoint,
        })
    }

    /// The pid of our live Squid for `dir`, from our record or Squid's pid file.
    fn live_pid(&self, dir: &InstanceDir) -> Option<i32> {
        let config = dir.config_file();
        let recorded = state::read_json::<ProcessRecord>(&dir.process_file())
            .ok()
            .map(|record| record.pid);
        [recorded, process::read_pid_file(&dir.squid_pid_file())]
            .into_iter()
            .flatten()
            .find(|pid| process::is_our_squid(*pid, &self.settings.squid_path, &config))
    }

    /// Validates a request into what the config needs.
    fn plan(&self, request: &InstanceRequest) -> Result<Plan, ProviderError> {
        if request.port == 0 {
            return Err(ProviderError::Misconfigured(
                "port 0 cannot be listened on".to_owned(),
            ));
        }
        let address = match &request.placement.address {
            Some(address) => address.parse::<IpAddr>().map_err(|_| {
                ProviderError::Misconfigured(format!("placement.address {address:?} is not an IP address"))
            })?,
            None => self.bind_address,
        };
        let outgoing = request
            .placement
            .outgoing_address
            .as_deref()
            .map(|outgoing| {
                outgoing.parse::<IpAddr>().map_err(|_| {
                    ProviderError::Misconfigured(format!(
                        "placement.outgoingAddress {outgoing:?} is not an IP address"
                    ))
                })
            })
            .transpose()?;
        let password_line = request
            .credentials
            .as_ref()
            .map(squid_config::password_line)
            .transpose()
            .map_err(|err| ProviderError::Misconfigured(err.to_string()))?;
        Ok(Plan {
            listen: SocketAddr::new(address, request.port),
            outgoing,
            password_line,
        })
    }

    /// Creates the stateDir if needed and, when Squid drops privileges, checks its user can
    /// reach it.
    fn ensure_state_dir(&self) -> Result<(), ProviderError> {
        let state_dir = &self.settings.state_dir;
        fs::create_dir_all(state_dir).map_err(|err| {
            let message = format!("cannot create stateDir {}: {err}", state_dir.display());
            if err.kind() == io::ErrorKind::PermissionDenied {
                ProviderError::Misconfigured(message)
            } else {
                ProviderError::Backend(message)
            }
        })?;
        if let Some(user) = &self.squid_user {
            check_reachable_by(state_dir, user)?;
        }
        Ok(())
    }

    /// Creates a new instance: nothing is left behind if any step fails.
    async fn create_new(
        &self,
        request: &InstanceRequest,
        dir: &InstanceDir,
    ) -> Result<Instance, ProviderError> {
        let name = request.name.as_str();
        let plan = self.plan(request)?;
        process::check_listen(plan.listen)?;
        if let Some(outgoing) = plan.outgoing {
            process::check_outgoing(outgoing)?;
        }
        self.ensure_state_dir()?;
        let temp = InstanceDir::at(
            self.settings
                .state_dir
                .join(format!("{TEMP_PREFIX}{name}-{:08x}", fastrand::u32(..))),
        );
        let backend = |what: &str, err: io::Error| ProviderError::Backend(format!("cannot {what}: {err}"));
        state::create_dir_with_mode(temp.root(), 0o755)
            .map_err(|err| backend(&format!("create {}", temp.root().display()), err))?;
        if let Err(err) = self.assemble(request, &plan, &temp, dir).await {
            remove_folder(temp.root()).await;
            return Err(err);
        }
        if let Err(err) = fs::rename(temp.root(), dir.root()) {
            remove_folder(temp.root()).await;
            if dir.owner_file().exists() {
                // Another process made it meanwhile (one process per stateDir is the rule,
                // but never make a second): it is the instance.
                return self.read_instance(name).await;
            }
            return Err(backend(
                &format!("move the new instance to {}", dir.root().display()),
                err,
            ));
        }
        let _ = state::sync_dir(&self.settings.state_dir);
        if let Err(err) = self.start_and_wait(name, dir, plan.listen).await {
            // Never leave a half-made instance: stop whatever started, remove the folder.
            if let Err(cleanup) = self.remove_instance(dir).await {
                tracing::error!(instance = %self.instance, name, error = %cleanup, "cannot clean up failed create");
            }
            return Err(err);
        }
        tracing::info!(instance = %self.instance, name, listen = %plan.listen, "created local proxy");
        self.read_instance(name).await
    }

    /// Writes the owner record, password file and config into `temp` and validates the
    /// config; the config names the files at their final place, `dir`.
    async fn assemble(
        &self,
        request: &InstanceRequest,
        plan: &Plan,
        temp: &InstanceDir,
        dir: &InstanceDir,
    ) -> Result<(), ProviderError> {
        let backend =
            |what: &str, err: io::Error| ProviderError::Backend(format!("cannot write {what}: {err}"));
        let record = OwnerRecord {
            version: OWNER_RECORD_VERSION,
            provider_instance: self.instance.clone(),
            installation: Some(self.installation.clone()),
            owner: request.owner.clone(),
            spec_hash: request.spec_hash.clone(),
            created_at: jiff::Timestamp::now(),
            address: plan.listen.ip().to_string(),
            port: plan.listen.port(),
            outgoing_address: plan.outgoing.map(|ip| ip.to_string()),
            authenticated: plan.password_line.is_some(),
        };
        state::write_json(&temp.owner_file(), &record).map_err(|err| backend("owner record", err))?;
        if let Some(line) = &plan.password_line {
            let passwords = temp.passwords_file();
            state::write_atomic(&passwords, line.as_bytes(), 0o640)
                .map_err(|err| backend("password file", err))?;
            if let Some(user) = &self.squid_user {
                // The auth helper runs as the Squid user and must read it.
                std::os::unix::fs::chown(&passwords, None, Some(user.gid))
                    .map_err(|err| backend("password file owner", err))?;
            }
        }
        let config = SquidConfig {
            name: &request.name,
            listen: plan.listen,
            outgoing: plan.outgoing,
            dir,
            auth_helper: plan
                .password_line
                .is_some()
                .then_some(self.settings.auth_helper_path.as_path()),
            access_log: self.settings.access_log,
            effective_user: self.squid_user.as_ref().map(|u| u.name.as_str()),
            extra: &self.settings.extra_config,
        }
        .render();
        state::write_atomic(&temp.config_file(), config.as_bytes(), 0o644)
            .map_err(|err| backend("squid.conf", err))?;
        process::parse_config(&self.settings.squid_path, &temp.config_file()).await
    }

    /// Starts the Squid of an existing folder (or adopts one already running) and returns its
    /// pid. The caller holds the name's lock.
    async fn start(&self, name: &str, dir: &InstanceDir) -> Result<i32, ProviderError> {
        let record: OwnerRecord = state::read_json(&dir.owner_file()).map_err(|err| {
            ProviderError::Backend(format!("cannot read the owner record of {name}: {err}"))
        })?;
        let listen = listen_of(&record)?;
        let squid_path = &self.settings.squid_path;
        let config = dir.config_file();
        let running = self
            .live_pid(dir)
            .or_else(|| process::find_squids(squid_path, &config).first().copied());
        if let Some(pid) = running {
            self.record_pid(dir, pid);
            return Ok(pid);
        }
        // The last Squid may still be exiting (killed, its cmdline already gone): its port is
        // free only once it has exited.
        if let Ok(ProcessRecord {
            pid,
            start_ticks: Some(ticks),
            ..
        }) = state::read_json(&dir.process_file())
            && !process::wait_for_exit(pid, ticks, EXIT_WAIT).await
        {
            return Err(ProviderError::Backend(format!(
                "the previous squid (pid {pid}) of {name} is still exiting"
            )));
        }
        process::check_listen(listen)?;
        self.prepare_run_dir(dir)?;
        let mut child = process::spawn_squid(squid_path, dir)?;
        let pid = child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .ok_or_else(|| ProviderError::Backend("squid exited before its pid was known".to_owned()))?;
        self.record_pid(dir, pid);
        tracing::info!(instance = %self.instance, name, pid, "started squid");
        let wake = self.wake.clone();
        let (instance, name) = (self.instance.clone(), name.to_owned());
        // Reaps the child (no zombie) and wakes the supervisor at once. If this process
        // exits first, Squid lives on in its own session and a later provider adopts it.
        tokio::spawn(async move {
            match child.wait().await {
                Ok(status) => tracing::info!(%instance, name, pid, %status, "squid exited"),
                Err(err) => tracing::warn!(%instance, name, pid, error = %err, "cannot wait for squid"),
            }
            wake.notify_one();
        });
        Ok(pid)
    }

    fn record_pid(&self, dir: &InstanceDir, pid: i32) {
        let record = ProcessRecord {
            pid,
            started_at: jiff::Timestamp::now(),
            start_ticks: process::proc_stat(pid).map(|stat| stat.start_ticks),
        };
        if let Err(err) = state::write_json(&dir.process_file(), &record) {
            // Squid's own pid file and the /proc scan still find it.
            tracing::warn!(instance = %self.instance, pid, error = %err, "cannot write process record");
        }
    }

    /// Makes `run/` writable for the Squid user and removes a stale Squid pid file (no Squid
    /// of ours is alive: the caller checked), which Squid would otherwise trust if its pid
    /// were recycled.
    fn prepare_run_dir(&self, dir: &InstanceDir) -> Result<(), ProviderError> {
        let run = dir.run_dir();
        let backend =
            |err: io::Error| ProviderError::Backend(format!("cannot prepare {}: {err}", run.display()));
        match state::create_dir_with_mode(&run, 0o750) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(backend(err)),
        }
        if let Some(user) = &self.squid_user {
            std::os::unix::fs::chown(&run, Some(user.uid), Some(user.gid)).map_err(backend)?;
        }
        match fs::remove_file(dir.squid_pid_file()) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(backend(err)),
            _ => Ok(()),
        }
    }

    /// Starts a new instance's Squid and waits until it accepts connections, it exits, or
    /// `startTimeoutSeconds` pass (then it is left starting).
    async fn start_and_wait(
        &self,
        name: &str,
        dir: &InstanceDir,
        listen: SocketAddr,
    ) -> Result<(), ProviderError> {
        let pid = self.start(name, dir).await?;
        let squid_path = &self.settings.squid_path;
        let config = dir.config_file();
        let deadline =
            tokio::time::Instant::now() + Duration::from_secs(self.settings.start_timeout_seconds.into());
        loop {
            if !process::is_our_squid(pid, squid_path, &config) {
                return Err(match process::startup_failure(dir) {
                    Some(fatal) => {
                        ProviderError::Misconfigured(format!("squid exited while starting: {fatal}"))
                    }
                    None => ProviderError::Backend(format!(
                        "squid exited while starting; see {}",
                        dir.cache_log().display()
                    )),
                });
            }
            if process::accepts_connections(listen).await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(instance = %self.instance, name, "squid is not accepting connections yet");
                return Ok(());
            }
            tokio::time::sleep(START_POLL).await;
        }
    }

    /// Stops every Squid of `dir` and removes the folder. The caller holds the name's lock.
    async fn remove_instance(&self, dir: &InstanceDir) -> Result<(), ProviderError> {
        let squid_path = &self.settings.squid_path;
        let config = dir.config_file();
        let mut pids = process::find_squids(squid_path, &config);
        pids.extend(self.live_pid(dir));
        pids.sort_unstable();
        pids.dedup();
        let grace = Duration::from_secs(self.settings.stop_timeout_seconds.into());
        process::stop(&pids, squid_path, &config, grace)
            .await
            .map_err(ProviderError::Backend)?;
        // One rename makes the instance gone; a crash while its files are being removed
        // leaves only a trash folder, which the next provider removes.
        let name = dir.root().file_name().unwrap_or_default().to_string_lossy();
        let trash = self
            .settings
            .state_dir
            .join(format!("{TRASH_PREFIX}{name}-{:08x}", fastrand::u32(..)));
        match fs::rename(dir.root(), &trash) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => {
                return Err(ProviderError::Backend(format!(
                    "cannot remove {}: {err}",
                    dir.root().display()
                )));
            }
        }
        let _ = state::sync_dir(&self.settings.state_dir);
        remove_folder(&trash).await;
        Ok(())
    }

    /// One supervision pass over every instance.
    async fn supervise_once(&self) {
        let names = match self.instance_names() {
            Ok(names) => names,
            Err(err) => {
                tracing::warn!(instance = %self.instance, error = %err, "supervision cannot list instances");
                return;
            }
        };
        for name in &names {
            self.supervise(name).await;
        }
        lock(&self.supervision).retain(|name, _| names.contains(name));
    }

    /// Restarts `name`'s Squid if it is dead, its folder is not being deleted, and its
    /// backoff has passed.
    async fn supervise(&self, name: &str) {
        let dir = self.dir(name);
        if dir.is_deleting() {
            return;
        }
        let now = Instant::now();
        if self.live_pid(&dir).is_some() {
            if let Some(s) = lock(&self.supervision).get_mut(name)
                && s.attempts > 0
                && s.last_attempt
                    .is_some_and(|at| now.duration_since(at) >= STABLE_AFTER)
            {
                s.attempts = 0;
                s.next_attempt = None;
                s.last_error = None;
            }
            return;
        }
        let due = lock(&self.supervision)
            .get(name)
            .and_then(|s| s.next_attempt)
            .is_none_or(|at| now >= at);
        if !due {
            return;
        }
        // A create or delete of this name is under way: it decides.
        let Some(_guard) = self.locks.try_lock(name) else {
            return;
        };
        if !dir.root().exists() || dir.is_deleting() || self.live_pid(&dir).is_some() {
            return;
        }
        // Another installation sharing the stateDir supervises its own.
        if self.is_foreign(&dir) {
            return;
        }
        let result = self.start(name, &dir).await;
        let mut supervision = lock(&self.supervision);
        let s = supervision.entry(name.to_owned()).or_default();
        s.attempts = s.attempts.saturating_add(1);
        s.last_attempt = Some(now);
        s.next_attempt = Some(now + restart_backoff(s.attempts + 1));
        match result {
            Ok(pid) => {
                s.restarts += 1;
                s.last_error = None;
                tracing::warn!(instance = %self.instance, name, pid, attempt = s.attempts, "restarted dead squid");
            }
            Err(err) => {
                tracing::warn!(instance = %self.instance, name, attempt = s.attempts, error = %err, "cannot restart squid");
                s.last_error = Some(err.to_string());
            }
        }
    }
}

fn parse_ip(field: &'static str, value: &str) -> Result<IpAddr, LocalSetupError> {
    value.parse().map_err(|_| LocalSetupError::NotAnAddress {
        field,
        value: value.to_owned(),
    })
}

fn listen_of(record: &OwnerRecord) -> Result<SocketAddr, ProviderError> {
    let ip: IpAddr = record.address.parse().map_err(|_| {
        ProviderError::Backend(format!("owner record has a bad address {:?}", record.address))
    })?;
    Ok(SocketAddr::new(ip, record.port))
}

/// `name`'s uid and primary gid from `/etc/passwd`.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 4 && fields[0] == name {
            Some((fields[2].parse().ok()?, fields[3].parse().ok()?))
        } else {
            None
        }
    })
}

/// Checks that `user` can search every folder from `/` to `path` (by owner, primary group or
/// others bits), since Squid opens its logs there after dropping to that user.
fn check_reachable_by(path: &Path, user: &SquidUser) -> Result<(), ProviderError> {
    use std::os::unix::fs::MetadataExt;
    for folder in path.ancestors() {
        let metadata = fs::metadata(folder)
            .map_err(|err| ProviderError::Backend(format!("cannot read {}: {err}", folder.display())))?;
        let mode = metadata.mode();
        let searchable = mode & 0o001 != 0
            || (metadata.uid() == user.uid && mode & 0o100 != 0)
            || (metadata.gid() == user.gid && mode & 0o010 != 0);
        if !searchable {
            return Err(ProviderError::Misconfigured(format!(
                "Squid runs as user {:?}, which cannot reach stateDir {}: {} has mode {:o}",
                user.name,
                path.display(),
                folder.display(),
                mode & 0o7777
            )));
        }
    }
    Ok(())
}

/// Removes the trash of interrupted deletes and temporary folders of creates that crashed
/// long ago.
fn remove_stale_temp_folders(state_dir: &Path) {
    let Ok(entries) = fs::read_dir(state_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        // Trash is never needed again; a temporary folder may still be in use by a create
        // unless it is old.
        let is_trash = file_name.starts_with(TRASH_PREFIX);
        let is_temp = file_name.starts_with(TEMP_PREFIX);
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|modified| modified.elapsed().ok())
            .is_some_and(|age| age >= STALE_TEMP_AGE);
        if (is_trash || (is_temp && stale))
            && let Err(err) = fs::remove_dir_all(entry.path())
        {
            tracing::warn!(path = %entry.path().display(), error = %err, "cannot remove stale temporary folder");
        }
    }
}

async fn remove_folder(path: &Path) {
    let path = path.to_owned();
    let result =
        tokio::task::spawn_blocking(move || fs::remove_dir_all(&path).map_err(|err| (path, err))).await;
    if let Ok(Err((path, err))) = result {
        tracing::error!(path = %path.display(), error = %err, "cannot remove folder");
    }
}

/// Locks a std mutex, continuing past poisoning: every critical section leaves the data
/// consistent (single inserts, removes and counter updates).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One async lock per instance name, dropped from the map when nobody holds or waits for it.
#[derive(Default)]
struct NameLocks {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

struct NameGuard<'a> {
    locks: &'a NameLocks,
    name: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl NameLocks {
    fn entry(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.locks).entry(name.to_owned()).or_default().clone()
    }

    async fn lock(&self, name: &str) -> NameGuard<'_> {
        let guard = self.entry(name).lock_owned().await;
        NameGuard {
            locks: self,
            name: name.to_owned(),
            guard: Some(guard),
        }
    }

    fn try_lock(&self, name: &str) -> Option<NameGuard<'_>> {
        let guard = self.entry(name).try_lock_owned().ok()?;
        Some(NameGuard {
            locks: self,
            name: name.to_owned(),
            guard: Some(guard),
        })
    }
}

impl Drop for NameGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut locks = lock(&self.locks.locks);
        // Only the map holds it now: nobody waits, so the entry can go.
        if locks.get(&self.name).is_some_and(|m| Arc::strong_count(m) == 1) {
            locks.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests;
