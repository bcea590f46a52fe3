//! The Debian guest image that real-VM tests boot, built once and cached, and the NoCloud seed
//! they boot it with.
//!
//! The image is a `mmdebstrap --variant=minbase` tree of [`SUITE`] with [`PACKAGES`] (a kernel,
//! systemd, cloud-init reading only a NoCloud seed, Squid, DHCP on `eth0`), turned into a raw
//! ext4 file system for `root=/dev/vda`, with the kernel and initramfs beside it for direct
//! kernel boot. `guest_image.sh` does the building; this module owns the cache:
//! `CACHE_ROOT/SUITE-KEY/` where KEY hashes the package list, the suite and the script's text,
//! built in a temporary folder and renamed into place under a lock, so concurrent tests build it
//! once. The cached image is never written to: each VM boots a qcow2 overlay of it
//! ([`create_overlay`]).

#![allow(dead_code)] // Each test binary uses a different part of the support code.

use std::{
    fs::{self, File},
    io::{self, Read, Seek, SeekFrom},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use egress_proxies_operator::provider::libvirt::seed::{Seed, SeedError};
use sha2::{Digest, Sha256};

/// The Debian release the image is built from.
pub const SUITE: &str = "bookworm";

/// What is installed on top of `minbase`: a kernel for direct boot, an init that brings up the
/// network and runs cloud-init, and Squid.
pub const PACKAGES: &[&str] = &[
    "linux-image-amd64",
    "systemd-sysv",
    "udev",
    "dbus",
    "squid",
    "cloud-init",
    "ifupdown",
    "isc-dhcp-client",
    "iproute2",
    "netbase",
    "procps",
];

/// The kernel command line the image boots with: the root file system is the whole first
/// virtio disk, the console the first serial port; a panic stops the VM (with QEMU's
/// `-no-reboot`) instead of looping. `root=/dev/vda console=ttyS0` alone boots it too.
pub const KERNEL_CMDLINE: &str = "root=/dev/vda rw console=ttyS0 panic=-1";

/// The build script; its text is part of the cache key.
const BUILD_SCRIPT: &str = include_str!("guest_image.sh");

/// Bump when this module changes what ends up in a cache entry (the script is hashed anyway).
const CACHE_LAYOUT: &str = "1";

const KERNEL_FILE: &str = "vmlinuz";
const INITRD_FILE: &str = "initrd.img";
const ROOTFS_FILE: &str = "rootfs.ext4";

/// A built guest image. Its files are shared by every test: never write to them.
#[derive(Debug, Clone)]
pub struct GuestImage {
    /// The kernel, for direct boot.
    pub kernel: PathBuf,
    /// Its initramfs.
    pub initrd: PathBuf,
    /// The root file system: a raw ext4 image (the base of each VM's qcow2 overlay).
    pub rootfs: PathBuf,
    /// The kernel command line to boot it with.
    pub cmdline: String,
    /// True when this call built the image, false when it came from the cache.
    pub built: bool,
    /// Time spent in [`ensure_guest_image`] (the build, or the cache look-up).
    pub build_time: Duration,
}

/// Building or preparing a guest image failed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        source: io::Error,
    },
    /// A tool the build needs is missing.
    #[error("{0} is not installed (scripts/lib/install.sh installs it)")]
    MissingTool(&'static str),
    /// mmdebstrap and mke2fs need root here (no user namespaces for an unprivileged build).
    #[error("building the guest image needs root")]
    NotRoot,
    /// The build script failed.
    #[error("the guest image build failed ({status}); the end of {log}:\n{tail}")]
    BuildFailed {
        /// Its exit status.
        status: String,
        /// Its full log (kept for inspection).
        log: PathBuf,
        /// The last lines of the log.
        tail: String,
    },
    /// The seed ISO could not be built.
    #[error("cloud-init seed: {0}")]
    Seed(#[from] SeedError),
    /// A tool other than the build failed.
    #[error("{tool} failed ({status}): {stderr}")]
    ToolFailed {
        /// The tool.
        tool: &'static str,
        /// Its exit status.
        status: String,
        /// Its error output.
        stderr: String,
    },
}

fn io_error(context: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}

/// Where images are cached unless a test says otherwise: `$EPO_CACHE_DIR` if set, else
/// `~/.cache/egress-proxies-operator/guest-images`.
pub fn default_cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("EPO_CACHE_DIR").filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/egress-proxies-operator/guest-images")
}

/// The cache key: a hash of everything that decides the image's content.
pub fn cache_key() -> String {
    let mut hasher = Sha256::new();
    for part in [CACHE_LAYOUT, SUITE, &PACKAGES.join(","), BUILD_SCRIPT] {
        hasher.update(part.as_bytes());
        hasher.update([0]);
    }
    hasher.finalize()[..8]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The image for the current build inputs: from `cache_root` if there, else built (about a
/// minute and a half on two cores) and cached. Concurrent callers wait for a single build.
pub fn ensure_guest_image(cache_root: &Path) -> Result<GuestImage, ImageError> {
    let start = Instant::now();
    let name = format!("{SUITE}-{}", cache_key());
    let entry = cache_root.join(&name);
    if is_complete(&entry) {
        return Ok(image_in(&entry, false, start.elapsed()));
    }
    fs::create_dir_all(cache_root).map_err(io_error(format!("creating {}", cache_root.display())))?;
    let lock_path = cache_root.join(format!(".{name}.lock"));
    let lock = File::create(&lock_path).map_err(io_error(format!("creating {}", lock_path.display())))?;
    lock.lock()
        .map_err(io_error(format!("locking {}", lock_path.display())))?;
    // Another process may have built it while this one waited for the lock.
    if is_complete(&entry) {
        return Ok(image_in(&entry, false, start.elapsed()));
    }
    build_into(cache_root, &name, &entry)?;
    Ok(image_in(&entry, true, start.elapsed()))
}

fn is_complete(entry: &Path) -> bool {
    [KERNEL_FILE, INITRD_FILE, ROOTFS_FILE]
        .iter()
        .all(|file| entry.join(file).is_file())
}

fn image_in(entry: &Path, built: bool, build_time: Duration) -> GuestImage {
    GuestImage {
        kernel: entry.join(KERNEL_FILE),
        initrd: entry.join(INITRD_FILE),
        rootfs: entry.join(ROOTFS_FILE),
        cmdline: KERNEL_CMDLINE.to_owned(),
        built,
        build_time,
    }
}

/// Removes a folder (see [`remove_tree`]) when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        remove_tree(&self.0);
    }
}

/// Removes `path` recursively, unless file systems are mounted under it: mmdebstrap bind-mounts
/// the host's /dev nodes, /proc and /sys into the tree it builds, and a build killed before its
/// clean-up leaves them there. Deleting through those would delete the host's.
fn remove_tree(path: &Path) {
    let mounted = fs::read_to_string("/proc/self/mountinfo").map_or(true, |info| {
        info.lines()
            .filter_map(|line| line.split(' ').nth(4))
            .any(|mount_point| Path::new(mount_point).starts_with(path))
    });
    if mounted {
        eprintln!(
            "guest image: leaving {}: file systems are mounted under it",
            path.display()
        );
        return;
    }
    let _ = fs::remove_dir_all(path);
}

/// Prefix of the scratch folders holding root trees being built.
const SCRATCH_PREFIX: &str = "epo-guest-rootfs-";

/// Builds into a staging folder beside `entry` (same file system, so the final rename is
/// atomic). Called with the cache lock held.
fn build_into(cache_root: &Path, name: &str, entry: &Path) -> Result<(), ImageError> {
    if fs::metadata("/proc/self")
        .map_err(io_error("reading /proc/self"))?
        .uid()
        != 0
    {
        return Err(ImageError::NotRoot);
    }
    for tool in ["mmdebstrap", "mke2fs"] {
        if !on_path(tool) {
            return Err(ImageError::MissingTool(tool));
        }
    }
    // Leftovers of builds that were killed (the lock says none is running).
    let staging_prefix = format!(".{name}.tmp-");
    if let Ok(entries) = fs::read_dir(cache_root) {
        for stale in entries.flatten() {
            if stale.file_name().to_string_lossy().starts_with(&staging_prefix) {
                remove_tree(&stale.path());
            }
        }
    }
    let staging = cache_root.join(format!("{staging_prefix}{}", std::process::id()));
    fs::create_dir(&staging).map_err(io_error(format!("creating {}", staging.display())))?;
    let staging_guard = RemoveOnDrop(staging.clone());
    let out = staging.join("image");
    fs::create_dir(&out).map_err(io_error(format!("creating {}", out.display())))?;
    let script = staging.join("guest_image.sh");
    fs::write(&script, BUILD_SCRIPT).map_err(io_error(format!("writing {}", script.display())))?;

    // The root tree is scratch: in memory where possible (dpkg syncs every file it writes).
    let scratch_parent = scratch_parent(&staging);
    remove_stale_scratch(&scratch_parent);
    let scratch = scratch_parent.join(format!("{SCRATCH_PREFIX}{name}-{}", std::process::id()));
    fs::create_dir(&scratch).map_err(io_error(format!("creating {}", scratch.display())))?;
    let scratch_guard = RemoveOnDrop(scratch.clone());
    let rootfs = scratch.join("rootfs");

    let log = staging.join("build.log");
    let log_file = File::create(&log).map_err(io_error(format!("creating {}", log.display())))?;
    let log_err = log_file
        .try_clone()
        .map_err(io_error("duplicating the log handle"))?;
    let status = Command::new("bash")
        .arg(&script)
        .arg("build")
        .arg(SUITE)
        .arg(PACKAGES.join(","))
        .arg(&rootfs)
        .arg(&out)
        .args(debian_sources(SUITE))
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(log_err)
        .status()
        .map_err(io_error("running guest_image.sh"))?;
    drop(scratch_guard);
    let failure = if !status.success() {
        Some(status.to_string())
    } else if !is_complete(&out) {
        Some("the script did not produce vmlinuz, initrd.img and rootfs.ext4".to_owned())
    } else {
        None
    };
    if let Some(status) = failure {
        // Keep the log where the error points: the staging folder goes.
        let kept = cache_root.join(format!(".{name}.failed-build.log"));
        let log = fs::rename(&log, &kept).map_or(log, |()| kept);
        return Err(ImageError::BuildFailed {
            status,
            tail: tail_of(&log, 40),
            log,
        });
    }
    fs::rename(&log, out.join("build.log")).map_err(io_error("keeping the build log"))?;
    fs::rename(&out, entry).map_err(io_error(format!("renaming the build to {}", entry.display())))?;
    drop(staging_guard);
    Ok(())
}

/// Where the root tree is assembled: `$EPO_GUEST_SCRATCH_DIR`, else `/dev/shm` (tmpfs) when it
/// has room for it, else the staging folder.
fn scratch_parent(staging: &Path) -> PathBuf {
    if let Some(dir) = std::env::var_os("EPO_GUEST_SCRATCH_DIR").filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    if available_mib(shm).is_some_and(|mib| mib >= SCRATCH_NEED_MIB) {
        shm.to_owned()
    } else {
        staging.to_owned()
    }
}

/// Room the root tree needs while it is built (it peaks near 1 GiB with the package cache).
const SCRATCH_NEED_MIB: u64 = 2048;

fn available_mib(dir: &Path) -> Option<u64> {
    let output = Command::new("df")
        .arg("-Pm")
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()
}

/// Scratch trees of builds that died more than an hour ago (a build takes minutes; a live
/// one of another checkout may be running beside this one).
fn remove_stale_scratch(parent: &Path) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry.file_name().to_string_lossy().starts_with(SCRATCH_PREFIX)
            && entry
                .metadata()
                .and_then(|metadata| metadata.modified())
                .is_ok_and(|modified| {
                    modified
                        .elapsed()
                        .is_ok_and(|age| age > Duration::from_secs(3600))
                });
        if stale {
            remove_tree(&entry.path());
        }
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| dir.join(tool).is_file())
            || ["/usr/sbin", "/sbin"]
                .iter()
                .any(|dir| Path::new(dir).join(tool).is_file())
    })
}

/// The apt sources for `suite` on the Debian mirror this machine's apt uses (the only package
/// registry reachable here): one-line entries for the release, its updates and its security
/// archive. Empty (mmdebstrap's default, deb.debian.org) when the machine's sources name none.
fn debian_sources(suite: &str) -> Vec<String> {
    let mut texts = Vec::new();
    if let Ok(text) = fs::read_to_string("/etc/apt/sources.list") {
        texts.push(text);
    }
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<PathBuf> = entries.flatten().map(|entry| entry.path()).collect();
        paths.sort();
        for path in paths {
            let name = path.to_string_lossy();
            if (name.ends_with(".sources") || name.ends_with(".list"))
                && let Ok(text) = fs::read_to_string(&path)
            {
                texts.push(text);
            }
        }
    }
    let pairs: Vec<(String, String)> = texts.iter().flat_map(|text| uri_suite_pairs(text)).collect();
    let release = pairs
        .iter()
        .find(|(uri, suite)| uri.ends_with("/debian") && !suite.contains('-'));
    let security = pairs.iter().find(|(_, suite)| suite.ends_with("-security"));
    let Some((main_uri, _)) = release else {
        return Vec::new();
    };
    let mut sources = vec![
        format!("deb {main_uri} {suite} main"),
        format!("deb {main_uri} {suite}-updates main"),
    ];
    if let Some((security_uri, _)) = security {
        sources.push(format!("deb {security_uri} {suite}-security main"));
    }
    sources
}

/// (URI, suite) of each enabled binary entry of a sources file, one-line or deb822.
fn uri_suite_pairs(text: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    for line in text.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        // Options come first, in brackets, and may span words: `[arch=amd64 signed-by=...]`.
        let rest = rest.trim_start();
        let rest = match rest.strip_prefix('[') {
            Some(options) => options.split_once(']').map_or("", |(_, rest)| rest),
            None => rest,
        };
        if let [uri, suite, ..] = rest.split_whitespace().collect::<Vec<_>>().as_slice() {
            pairs.push((uri.trim_end_matches('/').to_owned(), (*suite).to_owned()));
        }
    }
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                key.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| value.trim().to_owned())
            })
        };
        let is_binary = field("Types").is_some_and(|types| types.split_whitespace().any(|t| t == "deb"));
        let enabled = field("Enabled").is_none_or(|value| !value.eq_ignore_ascii_case("no"));
        if !(is_binary && enabled) {
            continue;
        }
        let (Some(uris), Some(suites)) = (field("URIs"), field("Suites")) else {
            continue;
        };
        for uri in uris.split_whitespace() {
            for suite in suites.split_whitespace() {
                pairs.push((uri.trim_end_matches('/').to_owned(), suite.to_owned()));
            }
        }
    }
    pairs
}

/// The last `lines` lines of a text file (empty if unreadable).
pub fn tail_of(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |metadata| metadata.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Creates `overlay` (qcow2) on top of the image's root file system: the disk one VM boots
/// and writes, leaving the cached image untouched.
pub fn create_overlay(image: &GuestImage, overlay: &Path) -> Result<(), ImageError> {
    let output = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&image.rootfs)
        .arg(overlay)
        .stdin(Stdio::null())
        .output()
        .map_err(|err| match err.kind() {
            io::ErrorKind::NotFound => ImageError::MissingTool("qemu-img"),
            _ => ImageError::Io {
                context: "running qemu-img".to_owned(),
                source: err,
            },
        })?;
    check_output("qemu-img", &output)
}

/// Writes `dir/seed.iso`, a NoCloud seed holding `user-data` and `meta-data`, and returns its
/// path. It is the kvm providers' own seed builder (`provider::libvirt::seed`: an ISO 9660
/// labelled `cidata`, with Joliet and Rock Ridge, through `genisoimage`), so a test boots the
/// seed format the providers ship.
pub fn build_seed_iso(dir: &Path, user_data: &str, meta_data: &str) -> Result<PathBuf, ImageError> {
    let seed = Seed {
        user_data: user_data.to_owned(),
        meta_data: meta_data.to_owned(),
    };
    // Callers may be plain #[test]s: run the async builder on a runtime of its own.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io_error("starting a runtime for the seed builder"))?;
    let bytes = runtime.block_on(seed.build_iso(SEED_TIMEOUT))?;
    let iso = dir.join("seed.iso");
    fs::write(&iso, bytes).map_err(io_error(format!("writing {}", iso.display())))?;
    Ok(iso)
}

/// `genisoimage` takes milliseconds; this only bounds a hang.
const SEED_TIMEOUT: Duration = Duration::from_secs(60);

fn check_output(tool: &'static str, output: &std::process::Output) -> Result<(), ImageError> {
    if output.status.success() {
        return Ok(());
    }
    Err(ImageError::ToolFailed {
        tool,
        status: output.status.to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_one_line_and_deb822_sources() {
        let one_line = "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://m.example/debian/ bookworm main\n\
                        deb-src http://m.example/debian bookworm main\n";
        assert_eq!(
            uri_suite_pairs(one_line),
            vec![("http://m.example/debian".to_owned(), "bookworm".to_owned())]
        );
        let deb822 = "Types: deb\nURIs: http://m.example/debian\nSuites: bookworm bookworm-updates\n\
                      Components: main\n\nTypes: deb\nURIs: http://m.example/debian-security\n\
                      Suites: bookworm-security\nComponents: main\n\nTypes: deb\nEnabled: no\n\
                      URIs: http://off.example/debian\nSuites: bookworm\n";
        assert_eq!(
            uri_suite_pairs(deb822),
            vec![
                ("http://m.example/debian".to_owned(), "bookworm".to_owned()),
                (
                    "http://m.example/debian".to_owned(),
                    "bookworm-updates".to_owned()
                ),
                (
                    "http://m.example/debian-security".to_owned(),
                    "bookworm-security".to_owned()
                ),
            ]
        );
    }
}
