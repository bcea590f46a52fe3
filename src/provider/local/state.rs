//! The state folder of one local instance: where each file lives, the owner and process
//! records, and atomic writes.
//!
//! ```text
//! <stateDir>/<instance-name>/
//!   owner.json      owner UID, namespace/name, installation, spec hash, created_at, address,
//!                   port (for GC)
//!   squid.conf      the generated Squid config
//!   passwords       htpasswd-style SHA-512-crypt hashes, only for Proxies with credentials
//!   process.json    the pid of the Squid this provider started last
//!   deleting        marker: a delete is in progress, never restart
//!   run/            owned by the Squid user: squid.pid, cache.log, access.log, squid.out
//! /dev/shm/epo<hash of the folder's path>-*   the Squid's shared memory (`squid -n`)
//! <stateDir>/.tmp-<name>-<random>/    a create assembling the folder above
//! <stateDir>/.trash-<name>-<random>/  a delete removing it (renamed first: one atomic step)
//! ```

use std::{
    fs,
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::provider::{Installation, Owner};

/// Version of the owner record's layout, written into it.
pub(super) const OWNER_RECORD_VERSION: u32 = 1;

/// Prefix of folders that are being assembled by `create` and are not instances yet.
pub(super) const TEMP_PREFIX: &str = ".tmp-";

/// Prefix of folders of deleted instances that are being removed.
pub(super) const TRASH_PREFIX: &str = ".trash-";

/// Paths inside one instance folder.
#[derive(Clone, Debug)]
pub(super) struct InstanceDir {
    root: PathBuf,
}

impl InstanceDir {
    /// The folder rooted at `root`.
    pub(super) fn at(root: PathBuf) -> Self {
        Self { root }
    }

    pub(super) fn root(&self) -> &Path {
        &self.root
    }
}

/// The files of an instance folder, one method each: `method => "path below the folder"`.
macro_rules! instance_files {
    ($($(#[$doc:meta])* $method:ident => $path:literal;)*) => {
        impl InstanceDir {
            $(
                $(#[$doc])*
                pub(super) fn $method(&self) -> PathBuf {
                    self.root.join($path)
                }
            )*
        }
    };
}

instance_files! {
    /// Who owns the instance (orphan GC reads it).
    owner_file => "owner.json";
    /// Squid's config.
    config_file => "squid.conf";
    /// The basic-auth password file.
    passwords_file => "passwords";
    /// The running Squid's process record.
    process_file => "process.json";
    /// Present once a delete has begun.
    deleting_marker => "deleting";
    /// Squid's own run-time files.
    run_dir => "run";
    /// Squid's pid file.
    squid_pid_file => "run/squid.pid";
    /// Squid's `cache_log`.
    cache_log => "run/cache.log";
    /// Squid's `access_log`.
    access_log => "run/access.log";
    /// Squid's standard output and error.
    output_file => "run/squid.out";
}

impl InstanceDir {
    /// Whether a delete of this instance has begun.
    pub(super) fn is_deleting(&self) -> bool {
        self.deleting_marker().exists()
    }

    /// Whether this provider made the folder: it carries one of the files only it writes.
    pub(super) fn is_ours(&self) -> bool {
        self.owner_file().exists() || self.config_file().exists() || self.is_deleting()
    }

    /// The service name (`squid -n`) of this instance's Squid. Squid names its shared-memory
    /// segments after it and creates them exclusively, so Squids sharing the default name
    /// (`squid`) race when they start at once and the loser dies with `shm_open(...): File
    /// exists`. Alphanumeric (Squid refuses anything else) and fixed by the folder's path, so
    /// a restarted Squid takes over its predecessor's names.
    pub(super) fn squid_service_name(&self) -> String {
        let digest = Sha256::digest(self.root.as_os_str().as_encoded_bytes());
        let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("epo{hash}")
    }

    /// Squid's shared-memory segments (`/dev/shm/<service>-*`): a Squid removes them when it
    /// stops, one killed leaves them behind.
    pub(super) fn shared_memory_segments(&self) -> Vec<PathBuf> {
        let prefix = format!("{}-", self.squid_service_name());
        let Ok(entries) = fs::read_dir(SHARED_MEMORY_DIR) else {
            return Vec::new();
        };
        entries
            .filter_map(|entry| {
                let entry = entry.ok()?;
                entry
                    .file_name()
                    .to_str()?
                    .starts_with(&prefix)
                    .then(|| entry.path())
            })
            .collect()
    }
}

/// Where POSIX shared memory (`shm_open`) lives on Linux.
const SHARED_MEMORY_DIR: &str = "/dev/shm";

/// Who an instance belongs to and what it runs: written before Squid starts, so an instance
/// can always be attributed by orphan GC.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct OwnerRecord {
    /// [`OWNER_RECORD_VERSION`].
    pub version: u32,
    /// The provider instance (from the providers config) that made it.
    pub provider_instance: String,
    /// The installation that made (or adopted) it; absent in a legacy record.
    pub installation: Option<Installation>,
    /// The owning Proxy.
    pub owner: Owner,
    /// Spec hash of what it runs.
    pub spec_hash: String,
    /// When it was created.
    pub created_at: jiff::Timestamp,
    /// Listen address.
    pub address: String,
    /// Listen port.
    pub port: u16,
    /// Source address for outgoing connections, if set.
    pub outgoing_address: Option<String>,
    /// Whether clients must authenticate.
    pub authenticated: bool,
}

/// The Squid process this provider started last.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ProcessRecord {
    /// Its pid (checked against `/proc/PID/cmdline` before it is trusted).
    pub pid: i32,
    /// When it was started.
    pub started_at: jiff::Timestamp,
    /// Its start time in clock ticks after boot (`/proc/PID/stat`), which tells the process
    /// from a later one with a recycled pid.
    #[serde(default)]
    pub start_ticks: Option<u64>,
}

/// Reads and parses a JSON record.
pub(super) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> io::Result<T> {
    let bytes = fs::read(path)?;
    serde_json::from_slice(&bytes).map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))
}

/// Writes a JSON record atomically.
pub(super) fn write_json<T: Serialize>(path: &Path, value: &T) -> io::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    write_atomic(path, &bytes, 0o644)
}

/// Writes `bytes` to `path` so that a reader sees the old content or the new, never a part:
/// write a temporary file beside it, flush it to disk, rename it over, flush the folder.
pub(super) fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let folder = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent folder"))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let temp = folder.join(format!(".{}.tmp", file_name.to_string_lossy()));
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&temp)?;
    // `mode` is filtered by the umask at creation; set it exactly.
    file.set_permissions(fs::Permissions::from_mode(mode))?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&temp, path)?;
    sync_dir(folder)
}

/// Flushes a folder's entries (a rename or a new file in it) to disk.
pub(super) fn sync_dir(folder: &Path) -> io::Result<()> {
    fs::File::open(folder)?.sync_all()
}

/// Creates a folder with exactly `mode`.
pub(super) fn create_dir_with_mode(path: &Path, mode: u32) -> io::Result<()> {
    fs::create_dir(path)?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}
