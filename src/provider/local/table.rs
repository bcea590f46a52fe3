//! The `local` provider's instance table: the folders under `stateDir` (layout in
//! [`super::state`]) read as instances, which of them are this installation's, and how
//! `create` assembles a new one under a temporary name and moves it into place.

use std::{
    fs, io,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::{Duration, SystemTime},
};

use super::{
    Inner, PROVIDER_TYPE,
    config::{Plan, check_reachable_by, plan, squid_conf},
    process,
    state::{self, InstanceDir, OWNER_RECORD_VERSION, OwnerRecord, ProcessRecord, TEMP_PREFIX, TRASH_PREFIX},
};
use crate::{
    config::is_dns_label,
    provider::{
        Endpoint, Installation, Instance, InstanceRequest, InstanceState, ProviderError, ProviderId,
        squid::Prepared,
    },
};

/// Temporary folders older than this are leftovers of a crashed create.
const STALE_TEMP_AGE: Duration = Duration::from_secs(600);

impl Inner {
    pub(super) fn dir(&self, name: &str) -> InstanceDir {
        InstanceDir::at(self.settings.state_dir.join(name))
    }

    pub(super) fn id(&self, name: &str) -> ProviderId {
        ProviderId::new(PROVIDER_TYPE, &self.instance, name)
    }

    /// The installation `dir`'s owner record names (`None`: legacy or unreadable).
    pub(super) fn stamped_installation(&self, dir: &InstanceDir) -> Option<Installation> {
        state::read_json::<OwnerRecord>(&dir.owner_file())
            .ok()
            .and_then(|record| record.installation)
    }

    /// Whether `dir` is another installation's instance.
    pub(super) fn is_foreign(&self, dir: &InstanceDir) -> bool {
        self.installation
            .is_foreign(self.stamped_installation(dir).as_ref())
    }

    /// For `create` of `name`: the error if another installation made `dir`.
    pub(super) fn refuse_foreign(&self, name: &str, dir: &InstanceDir) -> Result<(), ProviderError> {
        self.installation
            .refuse_foreign(name, self.stamped_installation(dir).as_ref())
    }

    /// The folder of this installation's instance `name` and its owner record, for a call on a
    /// running instance (the caller holds the name's lock): `NotFound` for a name no instance
    /// can have, a folder that is not ours or another installation's.
    pub(super) fn owned_folder(&self, name: &str) -> Result<(InstanceDir, OwnerRecord), ProviderError> {
        let not_found = || ProviderError::NotFound(name.to_owned());
        if !is_dns_label(name) {
            return Err(not_found());
        }
        let dir = self.dir(name);
        if !dir.is_ours() || self.is_foreign(&dir) {
            return Err(not_found());
        }
        let record = state::read_json(&dir.owner_file()).map_err(|err| match err.kind() {
            io::ErrorKind::NotFound => not_found(),
            _ => ProviderError::Backend(format!("cannot read the owner record of {name}: {err}")),
        })?;
        Ok((dir, record))
    }

    /// Folder names that are instances made by this provider (they hold an owner record or a
    /// config); temporary and foreign folders are skipped.
    pub(super) fn instance_names(&self) -> Result<Vec<String>, ProviderError> {
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
    pub(super) async fn read_instance(&self, name: &str) -> Result<Instance, ProviderError> {
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
    pub(super) fn live_pid(&self, dir: &InstanceDir) -> Option<i32> {
        let config = dir.config_file();
        let recorded = state::read_json::<ProcessRecord>(&dir.process_file())
            .ok()
            .map(|record| record.pid);
        [recorded, process::read_pid_file(&dir.squid_pid_file())]
            .into_iter()
            .flatten()
            .find(|pid| process::is_our_squid(*pid, &self.settings.squid_path, &config))
    }

    /// Creates the stateDir if needed and, when Squid drops privileges, checks its user can
    /// reach it.
    pub(super) fn ensure_state_dir(&self) -> Result<(), ProviderError> {
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
    pub(super) async fn create_new(
        &self,
        request: &InstanceRequest,
        prepared: Prepared,
        dir: &InstanceDir,
    ) -> Result<Instance, ProviderError> {
        let name = request.name.as_str();
        let plan = plan(request, prepared, self.bind_address)?;
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
    pub(super) async fn assemble(
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
        let config = squid_conf(
            &request.name,
            plan,
            dir,
            &self.settings,
            self.squid_user.as_ref().map(|u| u.name.as_str()),
        );
        state::write_atomic(&temp.config_file(), config.as_bytes(), 0o644)
            .map_err(|err| backend("squid.conf", err))?;
        process::parse_config(&self.settings.squid_path, &temp.config_file()).await
    }
}

pub(super) fn listen_of(record: &OwnerRecord) -> Result<SocketAddr, ProviderError> {
    let ip: IpAddr = record.address.parse().map_err(|_| {
        ProviderError::Backend(format!("owner record has a bad address {:?}", record.address))
    })?;
    Ok(SocketAddr::new(ip, record.port))
}

/// Removes the trash of interrupted deletes and temporary folders of creates that crashed
/// long ago.
pub(super) fn remove_stale_temp_folders(state_dir: &Path) {
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

pub(super) async fn remove_folder(path: &Path) {
    let path = path.to_owned();
    let result =
        tokio::task::spawn_blocking(move || fs::remove_dir_all(&path).map_err(|err| (path, err))).await;
    if let Ok(Err((path, err))) = result {
        tracing::error!(path = %path.display(), error = %err, "cannot remove folder");
    }
}
