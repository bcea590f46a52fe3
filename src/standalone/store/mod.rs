//! Standalone mode's embedded store: everything the cluster keeps in the API server, kept in a
//! folder on the host (`--state DIR`): each Proxy's identity and status, and its audit trail.
//!
//! Layout: `proxies/<namespace>_<name>.json` (one record per Proxy, replaced atomically by
//! writing a temporary file and renaming it, so a crash leaves the old or the new record, never a
//! torn one) and `audit/<namespace>_<name>.jsonl` (append-only, one transition per line). A lock
//! file keeps a second operator from using the same folder at once.

use std::{
    collections::BTreeMap,
    fs::{self, File, OpenOptions},
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{api::ProxyKey, api::ProxyStatus, machine::AuditEntry};

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Filesystem trouble.
    #[error("{action} {path}: {cause}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// Another process holds the folder.
    #[error("state folder {0} is in use by another egress-proxies-operator process")]
    Locked(PathBuf),
    /// A record does not parse.
    #[error("corrupt record {path}: {cause}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: serde_json::Error,
    },
}

/// What standalone mode keeps about one Proxy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyRecord {
    /// The identity the instance is owned by (a cluster's `metadata.uid`).
    pub uid: String,
    /// Bumped whenever the manifest's spec changes.
    pub generation: i64,
    /// The spec as last applied, to notice changes (JSON).
    pub spec: serde_json::Value,
    /// The manifest file it came from.
    pub source: String,
    /// The manifest's `metadata.annotations` (as an API server keeps them; they move no
    /// generation).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// The operator's finalizer is set: the instance may exist and must be cleaned up.
    pub finalizer: bool,
    /// The manifest vanished: the Proxy is being deleted.
    pub deleting: bool,
    /// When deletion started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_time: Option<jiff::Timestamp>,
    /// When the record was created.
    pub created: jiff::Timestamp,
    /// The status, as the cluster would hold it.
    #[serde(default)]
    pub status: Option<ProxyStatus>,
    /// A recycle request of the gateway's rules, standing in for the manifest's annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_recycle: Option<GatewayRecycle>,
}

/// A recycle request the gateway's rules made ([`super::recycle`]): the Proxy carries it as
/// its recycle annotation until the manifest's own annotation is no longer `over`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayRecycle {
    /// The request's value.
    pub value: String,
    /// The manifest's recycle annotation when it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
}

impl ProxyRecord {
    /// The provider instance the stored spec names, if it names one.
    pub fn provider(&self) -> Option<&str> {
        self.spec.get("provider").and_then(|p| p.as_str())
    }
}

/// One line of the audit trail.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditLine {
    /// The transition.
    #[serde(flatten)]
    pub entry: AuditEntry,
    /// Detail (never secret content).
    pub message: String,
}

/// The store.
pub struct Store {
    dir: PathBuf,
    // Held for the store's lifetime: the OS releases the lock if the process dies.
    _lock: File,
}

impl Store {
    /// Opens (creating if needed) the state folder and locks it.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        for sub in ["proxies", "audit"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(|cause| StoreError::Io {
                action: "creating",
                path,
                cause,
            })?;
        }
        let lock_path = dir.join("lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|cause| StoreError::Io {
                action: "opening",
                path: lock_path.clone(),
                cause,
            })?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(StoreError::Locked(dir.to_owned())),
            Err(fs::TryLockError::Error(cause)) => {
                return Err(StoreError::Io {
                    action: "locking",
                    path: lock_path,
                    cause,
                });
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            _lock: lock,
        })
    }

    /// Reads a store without locking it (for `status`, which only reads).
    pub fn read_only(dir: &Path) -> Result<ReadOnlyStore, StoreError> {
        if !dir.join("proxies").is_dir() {
            return Err(StoreError::Io {
                action: "reading",
                path: dir.join("proxies"),
                cause: std::io::Error::new(std::io::ErrorKind::NotFound, "not a state folder"),
            });
        }
        Ok(ReadOnlyStore { dir: dir.to_owned() })
    }

    /// Saves a record (atomically).
    pub fn save(&self, key: &ProxyKey, record: &ProxyRecord) -> Result<(), StoreError> {
        let path = record_path(&self.dir, key);
        let temp = path.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(record).map_err(|cause| StoreError::Corrupt {
            path: path.clone(),
            cause,
        })?;
        let write = || -> std::io::Result<()> {
            let mut file = File::create(&temp)?;
            file.write_all(&body)?;
            file.sync_all()?;
            fs::rename(&temp, &path)
        };
        write().map_err(|cause| StoreError::Io {
            action: "writing",
            path,
            cause,
        })
    }

    /// Removes a record (the Proxy is fully deleted); the audit trail stays.
    pub fn remove(&self, key: &ProxyKey) -> Result<(), StoreError> {
        let path = record_path(&self.dir, key);
        match fs::remove_file(&path) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(StoreError::Io {
                action: "removing",
                path,
                cause: err,
            }),
            _ => Ok(()),
        }
    }

    /// Appends one transition to the Proxy's audit trail.
    pub fn append_audit(&self, key: &ProxyKey, line: &AuditLine) -> Result<(), StoreError> {
        let path = audit_path(&self.dir, key);
        let mut text = serde_json::to_string(line).map_err(|cause| StoreError::Corrupt {
            path: path.clone(),
            cause,
        })?;
        text.push('\n');
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .map_err(|cause| StoreError::Io {
                action: "appending to",
                path,
                cause,
            })
    }

    /// The state folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A reader over the same folder.
    pub fn reader(&self) -> ReadOnlyStore {
        ReadOnlyStore {
            dir: self.dir.clone(),
        }
    }
}

/// Read access to a state folder.
pub struct ReadOnlyStore {
    dir: PathBuf,
}

impl ReadOnlyStore {
    /// Every record, sorted by key.
    pub fn list(&self) -> Result<Vec<(ProxyKey, ProxyRecord)>, StoreError> {
        let dir = self.dir.join("proxies");
        let entries = fs::read_dir(&dir).map_err(|cause| StoreError::Io {
            action: "listing",
            path: dir.clone(),
            cause,
        })?;
        let mut records = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(key) = path.file_name().and_then(|n| n.to_str()).and_then(key_from_file) else {
                continue;
            };
            if let Some(record) = read_record(&path)? {
                records.push((key, record));
            }
        }
        records.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(records)
    }

    /// One record.
    pub fn get(&self, key: &ProxyKey) -> Result<Option<ProxyRecord>, StoreError> {
        read_record(&record_path(&self.dir, key))
    }

    /// The audit trail of one Proxy (unparsable lines, e.g. a torn last line after a crash, are
    /// skipped).
    pub fn audit(&self, key: &ProxyKey) -> Result<Vec<AuditLine>, StoreError> {
        let path = audit_path(&self.dir, key);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(cause) => {
                return Err(StoreError::Io {
                    action: "reading",
                    path,
                    cause,
                });
            }
        };
        Ok(BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| serde_json::from_str(&line).ok())
            .collect())
    }
}

fn read_record(path: &Path) -> Result<Option<ProxyRecord>, StoreError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|cause| StoreError::Corrupt {
                path: path.to_owned(),
                cause,
            }),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(cause) => Err(StoreError::Io {
            action: "reading",
            path: path.to_owned(),
            cause,
        }),
    }
}

// Namespaces and names are DNS labels/subdomains, so '_' cannot occur in them and separates
// the two unambiguously.
fn file_stem(key: &ProxyKey) -> String {
    format!("{}_{}", key.namespace(), key.name())
}

fn key_from_file(file: &str) -> Option<ProxyKey> {
    let stem = file.strip_suffix(".json")?;
    let (namespace, name) = stem.split_once('_')?;
    Some(ProxyKey::new(namespace, name))
}

fn record_path(dir: &Path, key: &ProxyKey) -> PathBuf {
    dir.join("proxies").join(format!("{}.json", file_stem(key)))
}

fn audit_path(dir: &Path, key: &ProxyKey) -> PathBuf {
    dir.join("audit").join(format!("{}.jsonl", file_stem(key)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ProxyKey {
        ProxyKey::new("default", "web-1")
    }

    #[test]
    fn records_round_trip_and_survive_reopening() {
        let dir = tempfile::tempdir().expect("temp dir");
        let record = ProxyRecord {
            uid: "u-1".into(),
            generation: 2,
            finalizer: true,
            created: jiff::Timestamp::UNIX_EPOCH,
            ..ProxyRecord::default()
        };
        {
            let store = Store::open(dir.path()).expect("opens");
            store.save(&key(), &record).expect("saves");
        }
        let store = Store::open(dir.path()).expect("reopens after the first is dropped");
        assert_eq!(store.reader().get(&key()).expect("reads"), Some(record.clone()));
        assert_eq!(store.reader().list().expect("lists"), vec![(key(), record)]);
        store.remove(&key()).expect("removes");
        store.remove(&key()).expect("removing twice is fine");
        assert!(store.reader().list().expect("lists").is_empty());
    }

    #[test]
    fn a_second_process_cannot_open_the_same_folder() {
        let dir = tempfile::tempdir().expect("temp dir");
        let _first = Store::open(dir.path()).expect("opens");
        assert!(matches!(Store::open(dir.path()), Err(StoreError::Locked(_))));
        // Reading (the `status` command) needs no lock.
        assert!(Store::read_only(dir.path()).is_ok());
    }

    #[test]
    fn a_torn_audit_line_is_skipped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Store::open(dir.path()).expect("opens");
        let entry = AuditEntry {
            at: jiff::Timestamp::UNIX_EPOCH,
            from: crate::machine::Phase::Pending,
            event: crate::machine::Event::SpecObserved,
            to: crate::machine::Phase::Provisioning,
            guard: Vec::new(),
            effects: vec![],
            reason: "ProvisioningStarted".into(),
            note: String::new(),
            cause: None,
        };
        store
            .append_audit(
                &key(),
                &AuditLine {
                    entry: entry.clone(),
                    message: "m".into(),
                },
            )
            .expect("appends");
        fs::OpenOptions::new()
            .append(true)
            .open(audit_path(dir.path(), &key()))
            .and_then(|mut f| f.write_all(b"{\"at\":"))
            .expect("tears");
        let trail = store.reader().audit(&key()).expect("reads");
        assert_eq!(trail.len(), 1);
        assert_eq!(trail[0].entry, entry);
    }
}
