//! Process supervision for the `local` provider: starting an instance's Squid (or adopting
//! the one already running), waiting for it to accept connections, stopping it and removing
//! its folder, and the background pass that restarts dead Squids with backoff. The low-level
//! process calls (spawn, `/proc` checks, signals) are in [`super::process`].

use std::{
    fs, io,
    net::SocketAddr,
    time::{Duration, Instant},
};

use super::{
    Inner, process,
    state::{self, InstanceDir, OwnerRecord, ProcessRecord, TRASH_PREFIX},
    table::{listen_of, remove_folder},
};
use crate::{provider::ProviderError, sync::lock};

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

/// What supervision has done for one instance (for diagnostics and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SupervisionStatus {
    /// Restarts that started a Squid (since this process started supervising).
    pub restarts: u64,
    /// When the last of them happened (wall clock, for the status page).
    pub last_restart_at: Option<jiff::Timestamp>,
    /// Restart attempts since the instance last stayed up for [`STABLE_AFTER`].
    pub consecutive_attempts: u32,
    /// Why the last attempt failed, if it did.
    pub last_error: Option<String>,
    /// When the next attempt may happen, from now, if one is pending.
    pub next_attempt_in: Option<Duration>,
}

#[derive(Default)]
pub(super) struct Supervision {
    pub(super) restarts: u64,
    pub(super) last_restart_at: Option<jiff::Timestamp>,
    pub(super) attempts: u32,
    pub(super) last_attempt: Option<Instant>,
    pub(super) next_attempt: Option<Instant>,
    pub(super) last_error: Option<String>,
}

impl Inner {
    /// Starts the Squid of an existing folder (or adopts one already running) and returns its
    /// pid. The caller holds the name's lock.
    pub(super) async fn start(&self, name: &str, dir: &InstanceDir) -> Result<i32, ProviderError> {
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

    pub(super) fn record_pid(&self, dir: &InstanceDir, pid: i32) {
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
    pub(super) fn prepare_run_dir(&self, dir: &InstanceDir) -> Result<(), ProviderError> {
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
    pub(super) async fn start_and_wait(
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
                return Err(process::startup_failure(dir, listen));
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
    pub(super) async fn remove_instance(&self, dir: &InstanceDir) -> Result<(), ProviderError> {
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
        // A Squid that stopped cleanly removed them; one killed (by us or anyone) did not.
        for segment in dir.shared_memory_segments() {
            if let Err(err) = fs::remove_file(&segment)
                && err.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(instance = %self.instance, segment = %segment.display(), error = %err, "cannot remove a shared-memory segment of a stopped squid");
            }
        }
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
    pub(super) async fn supervise_once(&self) {
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
    pub(super) async fn supervise(&self, name: &str) {
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
                s.last_restart_at = Some(jiff::Timestamp::now());
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
