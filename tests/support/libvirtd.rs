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

/// A file in the daemon's folder naming the test process that owns it, for [`reap_orphans`].
const MARKER: &str = "epo-private-libvirtd";

/// A running private libvirtd; dropping it kills the daemon, the QEMU processes it started and
/// its log daemon, and removes its folder. [`Self::stop`] and [`Self::restart`] take the daemon
/// away and bring it back on the same folder and socket, as an outage of a libvirt host would.
///
/// If the test process dies without dropping it (killed by a timeout), the daemon dies with
/// the thread that started it (parent-death signal), and the next [`PrivateLibvirtd::start`]
/// (of any test) reaps the QEMU processes and the folder it left (see [`reap_orphans`]).
pub struct PrivateLibvirtd {
    child: Option<Child>,
    root: tempfile::TempDir,
    uri: String,
}

impl PrivateLibvirtd {
    /// Starts the daemon and waits for its socket. Panics with the daemon's log if it exits or
    /// does not create its socket within the deadline.
    pub fn start() -> Self {
        reap_orphans();
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
        fs::write(
            root.path().join(MARKER),
            owner_mark(std::process::id()).unwrap_or_default(),
        )
        .expect("marker file");
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
            // The parent-death signal is set after the change of user (which clears it): the
            // daemon dies with the thread that started it even if no Drop runs.
            .args([
                "--reuid=nobody",
                "--regid=nogroup",
                "--clear-groups",
                "--pdeathsig=KILL",
                "libvirtd",
            ])
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

    /// The daemon's folder (removed on drop).
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// A folder `name` in the daemon's folder owned by the daemon's user, for files QEMU reads
    /// or writes (kernels, console logs).
    pub fn nobody_folder(&self, name: &str) -> PathBuf {
        let folder = self.root.path().join(name);
        fs::create_dir(&folder).expect("create folder");
        chown_nobody(&folder);
        folder
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
        self.define_dir_pool(name, &folder, &image);
        folder
    }

    /// Defines and starts a dir storage pool `name` in the daemon's folder holding a copy of
    /// `image` as volume `volume` (sparse: a copy of the test guest's root file system takes
    /// about a second). Returns the pool's folder.
    pub fn dir_pool_with_copy(&self, name: &str, volume: &str, image: &Path) -> PathBuf {
        let folder = self.root.path().join("pools").join(name);
        fs::create_dir(&folder).expect("pool folder");
        let copy = folder.join(volume);
        let output = Command::new("cp")
            .args(["--sparse=always", "--reflink=auto"])
            .arg(image)
            .arg(&copy)
            .output()
            .expect("run cp");
        assert!(
            output.status.success(),
            "copying {} into the pool: {}",
            image.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        self.define_dir_pool(name, &folder, &copy);
        folder
    }

    fn define_dir_pool(&self, name: &str, folder: &Path, image: &Path) {
        for path in [folder, image] {
            chown_nobody(path);
        }
        self.virsh_ok(
            &["pool-define-as", "--name", name, "--type", "dir", "--target"]
                .into_iter()
                .chain([folder.to_str().expect("UTF-8 path")])
                .collect::<Vec<_>>(),
        );
        self.virsh_ok(&["pool-start", "--pool", name]);
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

    /// The UUID of domain `name`, if it exists.
    pub fn domain_uuid(&self, name: &str) -> Option<String> {
        let output = self.virsh(&["domuuid", "--domain", name]);
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    /// Whether a domain with `uuid` exists.
    pub fn has_domain_uuid(&self, uuid: &str) -> bool {
        self.virsh(&["domname", "--domain", uuid]).status.success()
    }
}

impl Drop for PrivateLibvirtd {
    fn drop(&mut self) {
        // QEMU processes and the log daemon outlive a session daemon: end them first.
        kill_helpers(self.root.path());
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

/// Kills, by their pid files, the QEMU processes and the log daemon of the daemon folder
/// `root`, checking that each pid still runs that program for this folder (not a reused
/// number): QEMU's command line names the folder's paths.
fn kill_helpers(root: &Path) {
    let mut pids: Vec<(u32, &str)> = Vec::new();
    if let Ok(entries) = fs::read_dir(root.join("r/libvirt/qemu/run")) {
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|ext| ext == "pid")
                && let Some(pid) = read_pid(&entry.path())
            {
                pids.push((pid, "qemu"));
            }
        }
    }
    if let Some(pid) = read_pid(&root.join("r/libvirt/virtlogd.pid")) {
        pids.push((pid, "virtlogd"));
    }
    let folder = root.to_string_lossy().into_owned();
    for (pid, program) in pids {
        let cmdline = String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
            .replace('\0', " ");
        // virtlogd's command line names no path; its pid file is in the folder and it is
        // checked to be a virtlogd of the daemon's user.
        let ours = cmdline.contains(program) && (program == "virtlogd" || cmdline.contains(&folder));
        if ours && is_alive(pid) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    }
}

/// Stops what the daemons of killed test processes left behind: a test process killed by a
/// timeout runs no Drop, and while its daemon dies with it (parent-death signal), the QEMU
/// processes and the log daemon it started would run on. A folder is an orphan when its
/// [`MARKER`] names an owner process that is gone (a pid that no longer runs, or runs another
/// program since a different start time); a folder whose owner runs is left alone, even while
/// its daemon is stopped on purpose ([`PrivateLibvirtd::stop`]). A folder without a readable
/// marker (being created, or made by an older version of this code) is left alone too.
pub fn reap_orphans() {
    let Ok(entries) = fs::read_dir("/tmp") else {
        return;
    };
    for entry in entries.flatten() {
        let root = entry.path();
        if !entry.file_name().to_string_lossy().starts_with("lv") {
            continue;
        }
        let Ok(mark) = fs::read_to_string(root.join(MARKER)) else {
            continue;
        };
        let Some(owner) = mark.split_whitespace().next().and_then(|pid| pid.parse().ok()) else {
            continue;
        };
        if is_alive(owner) && owner_mark(owner).as_deref() == Some(mark.as_str()) {
            continue;
        }
        eprintln!(
            "reaping what the private libvirtd of a killed test left in {}",
            root.display()
        );
        if let Some(daemon) = read_pid(&root.join("r/libvirt/libvirtd.pid")) {
            let cmdline = fs::read(format!("/proc/{daemon}/cmdline")).unwrap_or_default();
            if is_alive(daemon) && String::from_utf8_lossy(&cmdline).contains("libvirtd") {
                let _ = Command::new("kill").args(["-KILL", &daemon.to_string()]).status();
            }
        }
        kill_helpers(&root);
        let _ = fs::remove_dir_all(&root);
    }
}

/// `"<pid> <start time>"` of process `pid`: the start time (in clock ticks since boot, from
/// `/proc/<pid>/stat`) tells a process from a later one that reuses its number.
fn owner_mark(pid: u32) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name, which may hold spaces: state is the 3rd
    // field of the line, start time the 22nd.
    let (_, rest) = stat.rsplit_once(')')?;
    let start_time = rest.split_whitespace().nth(19)?;
    Some(format!("{pid} {start_time}"))
}

fn read_pid(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (exists and is not a zombie waiting to be reaped).
fn is_alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name, which may itself hold spaces.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn chown_nobody(path: &Path) {
    let (uid, gid) = (id_of("/etc/passwd", "nobody"), id_of("/etc/group", "nogroup"));
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown to nobody");
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
