//! A test's long-running child (the operator binary, mostly) started one way everywhere: the
//! leader of a process group of its own, stdin closed, stdout and stderr in a log file, and
//! killed with its whole group when the guard drops, or when the test process dies (the
//! parent-death signal), so no outcome leaves it running.
//!
//! The parent-death signal fires when the *thread* that spawned the child exits: spawn from the
//! test's own thread (an async test's body runs there), not from a short-lived worker.

#![allow(dead_code)]

use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

/// A running child in its own process group; dropping it kills the group.
pub struct GroupChild {
    child: Option<Child>,
    log: PathBuf,
}

impl GroupChild {
    /// Spawns `command` with its output in `log` (created afresh). Panics if it cannot start.
    pub fn spawn(command: &mut Command, log: &Path) -> Self {
        let out = std::fs::File::create(log).expect("log file");
        command
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file handle"))
            .stderr(out)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {:?}: {e}", command.get_program()));
        Self {
            child: Some(child),
            log: log.to_owned(),
        }
    }

    /// Its process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Everything the child wrote so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where the child writes.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The exit status, if the child exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// SIGTERM (as systemd or Ctrl-C would) and wait up to `within` for the exit, blocking
    /// this thread; `None` if it still runs (it is killed on drop).
    pub fn terminate(&mut self, within: Duration) -> Option<ExitStatus> {
        self.signal_term()?;
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.reap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// [`GroupChild::terminate`] without blocking the async runtime (for tests whose runtime
    /// serves the child meanwhile, e.g. a collector answering its last export).
    pub async fn terminate_async(&mut self, within: Duration) -> Option<ExitStatus> {
        self.signal_term()?;
        self.exit_within(within).await
    }

    /// The exit status once the child exits, waiting up to `within` without blocking the async
    /// runtime; `None` if it still runs then.
    pub async fn exit_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = self.reap() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    fn signal_term(&mut self) -> Option<()> {
        let child = self.child.as_ref()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        Some(())
    }

    fn reap(&mut self) -> Option<ExitStatus> {
        let status = self.exited()?;
        self.child = None;
        Some(status)
    }
}

impl Drop for GroupChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The arguments of a live process (none for a zombie or a vanished pid).
pub fn argv(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Live processes (Squid, its helpers, anything) whose arguments mention `path`, sorted.
pub fn processes_mentioning(path: &Path) -> Vec<i32> {
    let needle = path.to_string_lossy().into_owned();
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .expect("read /proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| argv(*pid).iter().any(|arg| arg.contains(&needle)))
        .collect();
    pids.sort_unstable();
    pids
}

/// Live Squid main processes (`squid -N ...`, not their helpers) whose arguments name a path
/// under `dir` (their config), sorted.
pub fn squids(dir: &Path) -> Vec<i32> {
    processes_mentioning(dir)
        .into_iter()
        .filter(|pid| {
            let argv = argv(*pid);
            argv.first().is_some_and(|p| p.ends_with("squid")) && argv.iter().any(|a| a == "-N")
        })
        .collect()
}

/// Kills every Squid under the folder when dropped, whatever the test's outcome: the local
/// provider leaves its Squids running when the operator stops (the next start adopts them), so
/// a test that fails before deleting its Proxies would leave them on the host.
pub struct KillSquidsUnder(pub std::path::PathBuf);

impl Drop for KillSquidsUnder {
    fn drop(&mut self) {
        kill_squids_under(&self.0);
    }
}

/// Kills every Squid main process under `dir` ([`squids`]) and removes its shared memory.
pub fn kill_squids_under(dir: &Path) {
    for pid in squids(dir) {
        kill_squid(pid);
    }
}

/// Sends SIGKILL to `pid`.
pub fn kill(pid: i32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// The service name (`-n NAME`) the Squid `pid` was started with, if it was given one.
pub fn squid_service(pid: i32) -> Option<String> {
    argv(pid)
        .windows(2)
        .find(|pair| pair[0] == "-n")
        .map(|pair| pair[1].clone())
}

/// The shared-memory segments of the Squid service `service` (`/dev/shm/SERVICE-*`), sorted.
pub fn squid_segments(service: &str) -> Vec<PathBuf> {
    let prefix = format!("{service}-");
    let mut segments: Vec<PathBuf> = std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix))
        .map(|entry| entry.path())
        .collect();
    segments.sort();
    segments
}

/// SIGKILLs `pid` and, if it is a Squid started with a service name (`-n NAME`), removes the
/// shared-memory segments (`/dev/shm/NAME-*`) a killed Squid leaves behind, as the local
/// provider's delete does: a test that kills Squids leaves nothing on the host.
pub fn kill_squid(pid: i32) {
    let service = squid_service(pid);
    kill(pid);
    if let Some(service) = service {
        remove_squid_segments(&service);
    }
}

/// Removes the shared-memory segments of the Squid service `service`.
pub fn remove_squid_segments(service: &str) {
    for segment in squid_segments(service) {
        let _ = std::fs::remove_file(segment);
    }
}
