//! A private libvirt daemon for tests: `libvirtd` running as `nobody` with its home, runtime,
//! config and cache folders in a temporary folder, serving the QEMU session driver on its own
//! socket. Domains it runs are real QEMU processes (type `qemu`, TCG: an unprivileged daemon
//! cannot open `/dev/kvm`).
//!
//! A root `libvirtd` with a private socket hangs at start on these machines, and the embedded
//! driver (`qemu:///embed`) keeps domains only while its process lives, which a `virsh`-driven
//! provider cannot use; an unprivileged session daemon serves both providers.
//!
//! Include with `#[path = "support/libvirtd.rs"] mod libvirtd;`.

#![allow(dead_code)]

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

/// How long the daemon may take to create its socket.
const START_DEADLINE: Duration = Duration::from_secs(30);

/// How long the daemon may take to exit after SIGTERM before it is killed.
const STOP_DEADLINE: Duration = Duration::from_secs(5);

/// A running private libvirtd; dropping it kills the daemon and the QEMU processes it started
/// and removes its folder. [`Self::stop`] and [`Self::restart`] take the daemon away and bring
/// it back on the same folder and socket, as an outage of a libvirt host would.
pub struct PrivateLibvirtd {
    child: Option<Child>,
    root: tempfile::TempDir,
    uri: String,
}

impl PrivateLibvirtd {
    /// Starts the daemon and waits for its socket. Panics with the daemon's log if it exits or
    /// does not create its socket within the deadline.
    pub fn start() -> Self {
        // Short paths: QEMU's UNIX sockets (monitor, guest agent channel) live below the
        // config folder, and a socket path may not exceed 107 bytes.
        let root = tempfile::Builder::new()
            .prefix("lv")
            .tempdir_in("/tmp")
            .expect("temporary folder");
        // nobody must reach into the folder.
        fs::set_permissions(root.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        let (uid, gid) = (id_of("/etc/passwd", "nobody"), id_of("/etc/group", "nogroup"));
        for folder in ["h", "r", "c", "k", "pools"] {
            let path = root.path().join(folder);
            fs::create_dir(&path).expect("create folder");
            std::os::unix::fs::chown(&path, Some(uid), Some(gid)).expect("chown to nobody");
        }
        let uri = format!(
            "qemu+unix:///session?socket={}",
            Self::socket_in(root.path()).display()
        );
        let mut daemon = Self {
            child: None,
            root,
            uri,
        };
        daemon.spawn();
        daemon
    }

    fn socket_in(root: &Path) -> PathBuf {
        root.join("r/libvirt/libvirt-sock")
    }

    /// Runs libvirtd on the folder and waits until it answers.
    fn spawn(&mut self) {
        let root = self.root.path();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(root.join("libvirtd.log"))
            .expect("log file");
        let mut command = Command::new("setpriv");
        command
            .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", "libvirtd"])
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .envs(Self::env_in(root))
            .current_dir(root)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            // Its own process group, so a test harness never waits on it.
            .process_group(0);
        let socket = Self::socket_in(root);
        // A socket left by a daemon that was killed must not pass for a fresh one.
        let _ = fs::remove_file(&socket);
        self.child = Some(command.spawn().expect("spawn setpriv libvirtd"));
        let started = Instant::now();
        loop {
            if socket.exists() {
                break;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "libvirtd exited ({status}) before creating its socket:\n{}",
                    self.log()
                );
            }
            if started.elapsed() > START_DEADLINE {
                panic!(
                    "libvirtd created no socket at {} within {START_DEADLINE:?}:\n{}",
                    socket.display(),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // The socket appears before the daemon serves; wait until a client gets an answer.
        loop {
            let output = self.virsh(&["uri"]);
            if output.status.success() {
                break;
            }
            if started.elapsed() > START_DEADLINE {
                panic!(
                    "libvirtd did not answer within {START_DEADLINE:?}: {}\n{}",
                    String::from_utf8_lossy(&output.stderr),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the daemon (SIGTERM, then SIGKILL after a deadline) and waits until clients are
    /// refused. Its folder, definitions and any running QEMU stay, as after a daemon crash.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let stopping = Instant::now();
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if stopping.elapsed() > STOP_DEADLINE {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        assert!(
            !self.virsh(&["uri"]).status.success(),
            "libvirtd still answers after it stopped"
        );
    }

    /// Starts the daemon again on the same folder and socket (after [`Self::stop`]), and
    /// restarts the storage pools that were active (a session daemon does not autostart them).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        let inactive = self.virsh_ok(&["pool-list", "--inactive", "--name"]);
        for pool in inactive.lines().map(str::trim).filter(|p| !p.is_empty()) {
            self.virsh_ok(&["pool-start", "--pool", pool]);
        }
    }

    /// The URI clients (this process, running as root, included) connect with.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The environment the daemon runs in; a client running as the daemon's user with it may
    /// also connect to plain `qemu:///session`.
    pub fn env(&self) -> Vec<(&'static str, PathBuf)> {
        Self::env_in(self.root.path())
    }

    fn env_in(root: &Path) -> Vec<(&'static str, PathBuf)> {
        vec![
            ("HOME", root.join("h")),
            ("XDG_RUNTIME_DIR", root.join("r")),
            ("XDG_CONFIG_HOME", root.join("c")),
            ("XDG_CACHE_HOME", root.join("k")),
        ]
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.root.path().join("libvirtd.log")).unwrap_or_default()
    }

    /// Runs `virsh` against the daemon.
    pub fn virsh(&self, args: &[&str]) -> Output {
        Command::new("virsh")
            .arg("--connect")
            .arg(&self.uri)
            .arg("--quiet")
            .args(args)
            .env("LC_ALL", "C")
            .stdin(Stdio::null())
            .output()
            .expect("run virsh")
    }

    /// Runs `virsh` and returns its output, panicking (with its error) if it fails.
    pub fn virsh_ok(&self, args: &[&str]) -> String {
        let output = self.virsh(args);
        assert!(
            output.status.success(),
            "virsh {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Defines and starts a dir storage pool `name` in the daemon's folder, with a small qcow2
    /// base image volume `base` (no OS in it: the contract needs a disk, not a boot). Returns
    /// the pool's folder.
    pub fn dir_pool_with_base(&self, name: &str, base: &str) -> PathBuf {
        let folder = self.root.path().join("pools").join(name);
        fs::create_dir(&folder).expect("pool folder");
        let image = folder.join(base);
        let output = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&image)
            .arg("16M")
            .output()
            .expect("run qemu-img");
        assert!(
            output.status.success(),
            "qemu-img: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let (uid, gid) = (id_of("/etc/passwd", "nobody"), id_of("/etc/group", "nogroup"));
        for path in [&folder, &image] {
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown to nobody");
        }
        self.virsh_ok(
            &["pool-define-as", "--name", name, "--type", "dir", "--target"]
                .into_iter()
                .chain([folder.to_str().expect("UTF-8 path")])
                .collect::<Vec<_>>(),
        );
        self.virsh_ok(&["pool-start", "--pool", name]);
        folder
    }

    /// Names of the volumes in `pool`.
    pub fn volumes(&self, pool: &str) -> Vec<String> {
        self.virsh_ok(&["pool-refresh", "--pool", pool]);
        self.virsh_ok(&["vol-list", "--pool", pool])
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .map(str::to_owned)
            .collect()
    }

    /// Names of every domain.
    pub fn domains(&self) -> Vec<String> {
        self.virsh_ok(&["list", "--all", "--name"])
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// QEMU processes the daemon started, from its pid files.
    fn qemu_pids(&self) -> Vec<u32> {
        let folder = self.root.path().join("r/libvirt/qemu/run");
        let Ok(entries) = fs::read_dir(folder) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "pid"))
            .filter_map(|entry| fs::read_to_string(entry.path()).ok()?.trim().parse().ok())
            .collect()
    }
}

impl Drop for PrivateLibvirtd {
    fn drop(&mut self) {
        // QEMU processes outlive a session daemon: end them first, by pid, checking that the
        // pid is still a QEMU (not a reused number).
        for pid in self.qemu_pids() {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains("qemu") {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
        }
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let stopping = Instant::now();
        while stopping.elapsed() < STOP_DEADLINE {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// The numeric ID of `name` in an `/etc/passwd`-style file.
fn id_of(file: &str, name: &str) -> u32 {
    fs::read_to_string(file)
        .expect("readable account database")
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            (fields.next() == Some(name)).then(|| fields.nth(1)?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("{name} is not in {file}"))
}
