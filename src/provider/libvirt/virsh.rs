//! The `virsh` access path, behind the `kvm` provider type: every backend call is a
//! `virsh --connect URI ...` child on a local or remote URI (`qemu+ssh://user@host/system`
//! works as it does for `virsh` itself).
//!
//! Each child runs under the configured timeout (it is killed when it runs over), with
//! `LC_ALL=C` so its messages can be recognised. Files virsh reads (volume and domain XML, the
//! seed ISO) are written to a private temporary folder on the operator's host; `vol-upload`
//! streams the seed over the libvirt connection, so nothing is copied to a remote host by
//! other means. kvm's domains carry their own stamp namespace, [`KVM_NAMESPACE`], and volume
//! names: `kvm` and `kvm2` never adopt each other's domains. What this file must not hold is
//! the algorithm: that is [`super::driver`]'s.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use futures::{StreamExt, TryStreamExt};
use tokio::runtime::Handle;

use super::{
    KVM_NAMESPACE, Kind, Lookup, STAMP_PREFIX, Stamp, call_timeout,
    driver::{Access, LibvirtProvider, NewVolume, Session, Stamped},
    pick_address,
};
use crate::{
    config::KvmSettings,
    provider::{InstanceState, ProviderError},
};

/// The provider type's name.
pub const PROVIDER_TYPE: &str = "kvm";

/// How many `virsh` children listing runs at once.
const LIST_CONCURRENCY: usize = 4;

/// The `kvm` provider: the libvirt algorithm over `virsh`.
pub type KvmProvider = LibvirtProvider<Virsh>;

impl KvmProvider {
    /// A provider instance named `instance_name` (from the providers config) with `settings`,
    /// running the `virsh` found on `PATH`.
    pub fn new(instance_name: &str, settings: KvmSettings) -> Self {
        Self::with_access(
            instance_name,
            settings,
            Virsh {
                program: PathBuf::from("virsh"),
            },
        )
    }

    /// Runs this `virsh` binary instead of the one on `PATH`.
    pub fn with_virsh(self, virsh: impl Into<PathBuf>) -> Self {
        self.replace_access(Virsh {
            program: virsh.into(),
        })
    }
}

/// The `virsh` access path: which program to run.
pub struct Virsh {
    program: PathBuf,
}

impl Access for Virsh {
    const KIND: Kind = Kind::new(PROVIDER_TYPE, KVM_NAMESPACE);
    type Session = VirshSession;

    fn open(&self, settings: &KvmSettings) -> Result<VirshSession, ProviderError> {
        Ok(VirshSession {
            program: self.program.clone(),
            uri: settings.uri.clone(),
            timeout: call_timeout(settings),
            handle: Handle::current(),
        })
    }

    /// Each child has its own timeout, so a slow operation of many calls still finishes.
    fn operation_timeout(&self, _settings: &KvmSettings) -> Option<Duration> {
        None
    }
}

/// A `virsh` run that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum VirshError {
    /// virsh could not be started.
    #[error("cannot run {program}: {cause}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        cause: std::io::Error,
    },
    /// virsh ran over the timeout and was killed.
    #[error("virsh {command} did not finish within {timeout:?}")]
    Timeout {
        /// The virsh command (first argument).
        command: String,
        /// The timeout.
        timeout: Duration,
    },
    /// virsh exited with an error.
    #[error("virsh {command} failed: {message}")]
    Failed {
        /// The virsh command (first argument).
        command: String,
        /// Its error lines, joined.
        message: String,
    },
}

impl VirshError {
    fn message(&self) -> &str {
        match self {
            Self::Failed { message, .. } => message,
            _ => "",
        }
    }

    /// virsh could not reach libvirt (or lost it).
    fn is_connection_trouble(&self) -> bool {
        const MARKERS: [&str; 9] = [
            "failed to connect to the hypervisor",
            "Failed to connect socket",
            "End of file while reading data",
            "Cannot recv data",
            "Cannot write data",
            "unable to connect to server",
            "authentication failed",
            "Connection reset",
            "no connection driver available",
        ];
        MARKERS.iter().any(|marker| self.message().contains(marker))
    }

    /// virsh says the `kind` (`domain`, `pool`, `vol`, `network`) it was asked for does not
    /// exist (and the connection is fine).
    fn is_missing(&self, kind: &str) -> bool {
        !self.is_connection_trouble() && self.message().contains(&format!("failed to get {kind} '"))
    }

    /// The domain asked for does not exist, whether virsh found no domain by that name or the
    /// domain went away between virsh's lookup and its call (libvirt's "Domain not found", seen
    /// when another installation's GC undefined a domain we were listing).
    fn is_gone_domain(&self) -> bool {
        self.is_missing("domain")
            || (!self.is_connection_trouble() && self.message().contains("Domain not found"))
    }
}

/// A virsh failure as a provider error.
fn classify(context: impl std::fmt::Display, err: VirshError) -> ProviderError {
    match &err {
        VirshError::Spawn { cause, .. } if cause.kind() == std::io::ErrorKind::NotFound => {
            ProviderError::Misconfigured(format!("{context}: {err}; install libvirt-clients"))
        }
        VirshError::Timeout { .. } => ProviderError::Unavailable(format!("{context}: {err}")),
        _ if err.is_connection_trouble() => ProviderError::Unavailable(format!("{context}: {err}")),
        _ => ProviderError::Backend(format!("{context}: {err}")),
    }
}

/// The calls of one operation. It runs on a blocking thread and waits there for its async
/// children through `handle`, so `kill_on_drop` and the timeout work as they do anywhere.
pub struct VirshSession {
    program: PathBuf,
    uri: String,
    timeout: Duration,
    handle: Handle,
}

impl VirshSession {
    /// Runs `virsh --connect URI ARGS...`, returning its standard output.
    fn virsh(&self, args: &[&str]) -> Result<String, VirshError> {
        self.handle.block_on(self.run(args))
    }

    async fn run(&self, args: &[&str]) -> Result<String, VirshError> {
        let command = args.first().copied().unwrap_or_default().to_owned();
        let timeout = self.timeout;
        let mut child = tokio::process::Command::new(&self.program);
        child
            .arg("--connect")
            .arg(&self.uri)
            .arg("--quiet")
            .args(args)
            .env("LC_ALL", "C")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let output = match tokio::time::timeout(timeout, child.output()).await {
            Err(_) => return Err(VirshError::Timeout { command, timeout }),
            Ok(Err(cause)) => {
                return Err(VirshError::Spawn {
                    program: self.program.display().to_string(),
                    cause,
                });
            }
            Ok(Ok(output)) => output,
        };
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let mut message = stderr
                .lines()
                .map(|line| line.trim().trim_start_matches("error: "))
                .filter(|line| !line.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            if message.is_empty() {
                message = output.status.to_string();
            }
            Err(VirshError::Failed { command, message })
        }
    }

    /// Names of every domain (persistent or not, running or not).
    fn domain_names(&self) -> Result<Vec<String>, ProviderError> {
        let output = self
            .virsh(&["list", "--all", "--name"])
            .map_err(|err| classify("listing domains", err))?;
        Ok(output
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect())
    }

    /// Runs virsh with the files `files` (name, content) written to a private temporary
    /// folder; `args` gets their paths.
    fn with_files<T>(
        &self,
        files: &[(&str, &[u8])],
        args: impl FnOnce(&[String]) -> Result<T, ProviderError>,
    ) -> Result<T, ProviderError> {
        let folder = tempfile::Builder::new()
            .prefix("epo-kvm-")
            .tempdir()
            .map_err(|err| ProviderError::Backend(format!("creating a temporary folder: {err}")))?;
        let mut paths = Vec::with_capacity(files.len());
        for (file, content) in files {
            let path = folder.path().join(file);
            write_private(&path, content)
                .map_err(|err| ProviderError::Backend(format!("writing {}: {err}", path.display())))?;
            paths.push(path.to_string_lossy().into_owned());
        }
        args(&paths)
    }
}

impl Session for VirshSession {
    type Domain = ();
    type Pool = String;

    fn lookup(&self, name: &str) -> Result<Lookup<()>, ProviderError> {
        match self.virsh(&["metadata", "--domain", name, "--uri", KVM_NAMESPACE]) {
            Ok(xml) => Ok(Lookup::Ours((), Box::new(Stamp::parse(xml.trim())))),
            Err(err) if err.message().contains("metadata not found") => Ok(Lookup::Foreign),
            Err(err) if err.is_gone_domain() => {
                // virsh says "failed to get domain" for more than absence; a listing that
                // succeeds without the name proves it.
                if self.domain_names()?.iter().any(|listed| listed == name) {
                    Err(classify(format!("looking up domain {name}"), err))
                } else {
                    Ok(Lookup::Missing)
                }
            }
            Err(err) => Err(classify(format!("reading the metadata of domain {name}"), err)),
        }
    }

    fn vanished(&self, name: &str) -> Result<bool, ProviderError> {
        Ok(matches!(self.lookup(name)?, Lookup::Missing))
    }

    fn stamped(&self) -> Result<Vec<Stamped<()>>, ProviderError> {
        let names = self.domain_names()?;
        let found: Vec<Option<Stamped<()>>> = self.handle.block_on(
            futures::stream::iter(names)
                .map(|name| async move {
                    match self
                        .run(&["metadata", "--domain", &name, "--uri", KVM_NAMESPACE])
                        .await
                    {
                        Ok(xml) => Ok(Some(Stamped {
                            domain: (),
                            stamp: Stamp::parse(xml.trim()),
                            name,
                        })),
                        Err(err) if err.message().contains("metadata not found") => Ok(None),
                        // Deleted while we listed.
                        Err(err) if err.is_gone_domain() => Ok(None),
                        Err(err) => Err(classify(format!("reading the metadata of domain {name}"), err)),
                    }
                })
                .buffered(LIST_CONCURRENCY)
                .try_collect(),
        )?;
        Ok(found.into_iter().flatten().collect())
    }

    fn state(&self, (): &(), name: &str) -> Result<InstanceState, ProviderError> {
        let output = self
            .virsh(&["domstate", "--domain", name])
            .map_err(|err| classify(format!("reading the state of domain {name}"), err))?;
        Ok(match output.trim() {
            "running" | "idle" | "blocked" => InstanceState::Running,
            "no state" => InstanceState::Starting,
            _ => InstanceState::Stopped,
        })
    }

    fn is_active(&self, domain: &(), name: &str) -> Result<bool, ProviderError> {
        Ok(self.state(domain, name)? != InstanceState::Stopped)
    }

    fn discover_address(&self, (): &(), name: &str) -> Option<String> {
        for source in ["lease", "agent"] {
            match self.virsh(&["domifaddr", "--domain", name, "--source", source]) {
                Ok(table) => {
                    let found = pick_address(parse_domifaddr(&table));
                    if found.is_some() {
                        return found;
                    }
                }
                Err(err) => tracing::trace!(error = %err, source, "no address from this source"),
            }
        }
        None
    }

    fn pool(&self, name: &str) -> Result<Option<(String, bool)>, ProviderError> {
        match self.virsh(&["pool-info", "--pool", name]) {
            Ok(info) => Ok(Some((name.to_owned(), field(&info, "State") == Some("running")))),
            Err(err) if err.is_missing("pool") => Ok(None),
            Err(err) => Err(classify(format!("reading storage pool {name}"), err)),
        }
    }

    fn volume_xml(&self, pool: &String, name: &str) -> Result<Option<String>, ProviderError> {
        match self.virsh(&["vol-dumpxml", "--vol", name, "--pool", pool]) {
            Ok(xml) => Ok(Some(xml)),
            Err(err) if err.is_missing("vol") => Ok(None),
            Err(err) => Err(classify(format!("reading volume {name}"), err)),
        }
    }

    fn network_active(&self, name: &str) -> Result<Option<bool>, ProviderError> {
        match self.virsh(&["net-info", "--network", name]) {
            Ok(info) => Ok(Some(field(&info, "Active") == Some("yes"))),
            Err(err) if err.is_missing("network") => Ok(None),
            Err(err) => Err(classify(format!("reading libvirt network {name}"), err)),
        }
    }

    fn create_volume(&self, pool: &String, new: &NewVolume<'_>) -> Result<(), ProviderError> {
        let name = new.name;
        let mut files: Vec<(&str, &[u8])> = vec![("volume.xml", new.xml.as_bytes())];
        files.extend(new.content.map(|content| ("content", content)));
        self.with_files(&files, |paths| {
            self.virsh(&["vol-create", "--pool", pool, "--file", &paths[0]])
                .map_err(|err| classify(format!("creating volume {name}"), err))?;
            if let Some(content) = paths.get(1) {
                self.virsh(&["vol-upload", "--vol", name, "--pool", pool, "--file", content])
                    .map_err(|err| classify(format!("uploading volume {name}"), err))?;
            }
            Ok(())
        })
    }

    fn delete_volume(&self, pool: &String, name: &str) -> Result<(), ProviderError> {
        match self.virsh(&["vol-delete", "--vol", name, "--pool", pool]) {
            Ok(_) => Ok(()),
            // A pool that does not exist holds no volumes.
            Err(err) if err.is_missing("vol") || err.is_missing("pool") => Ok(()),
            Err(err) => Err(classify(format!("deleting volume {name}"), err)),
        }
    }

    fn define(&self, name: &str, xml: &str) -> Result<(), ProviderError> {
        self.with_files(&[("domain.xml", xml.as_bytes())], |paths| {
            self.virsh(&["define", "--file", &paths[0]])
                .map(drop)
                .map_err(|err| classify(format!("defining domain {name}"), err))
        })
    }

    fn start(&self, (): &(), name: &str) -> Result<(), ProviderError> {
        match self.virsh(&["start", "--domain", name]) {
            Ok(_) => Ok(()),
            Err(err) if err.is_connection_trouble() => Err(classify(format!("starting domain {name}"), err)),
            // A start that fails is about the domain (a kernel path, a taken port).
            Err(err) => Err(ProviderError::Backend(format!(
                "starting domain {name}: {}",
                err.message()
            ))),
        }
    }

    fn remove_domain(&self, name: &str) -> Result<(), ProviderError> {
        if let Err(err) = self.virsh(&["destroy", "--domain", name])
            && !err.is_missing("domain")
            && !err.message().contains("not running")
        {
            return Err(classify(format!("stopping domain {name}"), err));
        }
        // Every flag that removes what the domain left first; a driver that does not know a
        // flag gets a plainer call.
        let attempts: [&[&str]; 3] = [
            &[
                "undefine",
                "--domain",
                name,
                "--managed-save",
                "--snapshots-metadata",
                "--checkpoints-metadata",
                "--nvram",
            ],
            &[
                "undefine",
                "--domain",
                name,
                "--managed-save",
                "--snapshots-metadata",
            ],
            &["undefine", "--domain", name],
        ];
        for args in attempts {
            match self.virsh(args) {
                Ok(_) => return Ok(()),
                Err(err) if err.is_missing("domain") => return Ok(()),
                Err(err)
                    if err.message().contains("unsupported flags")
                        || err.message().contains("not supported") => {}
                Err(err) => return Err(classify(format!("undefining domain {name}"), err)),
            }
        }
        Err(ProviderError::Backend(format!(
            "domain {name} could not be undefined"
        )))
    }

    fn set_stamp(&self, (): &(), name: &str, element: &str, live: bool) -> Result<(), ProviderError> {
        let mut args = vec![
            "metadata",
            "--domain",
            name,
            "--uri",
            KVM_NAMESPACE,
            "--key",
            STAMP_PREFIX,
            "--set",
            element,
            "--config",
        ];
        if live {
            args.push("--live");
        }
        self.virsh(&args)
            .map(drop)
            .map_err(|err| classify(format!("restamping domain {name}"), err))
    }

    fn versions(&self) -> Result<String, ProviderError> {
        let version = self
            .virsh(&["version"])
            .map_err(|err| classify("reading libvirt's version", err))?;
        let library = field(&version, "Using library").unwrap_or("libvirt (version unknown)");
        let hypervisor = field(&version, "Running hypervisor")
            .map(|h| format!(", hypervisor {h}"))
            .unwrap_or_default();
        Ok(format!("{library}{hypervisor} at {} (virsh)", self.uri))
    }
}

/// The value of `Key:   value` in virsh's `*-info` and `version` output.
fn field<'a>(output: &'a str, key: &str) -> Option<&'a str> {
    output.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// Addresses in `virsh domifaddr` output (`name mac protocol address/prefix`, continuation
/// lines start with `-`), skipping the loopback interface.
fn parse_domifaddr(table: &str) -> Vec<&str> {
    table
        .lines()
        .filter_map(|line| {
            let columns: Vec<&str> = line.split_whitespace().collect();
            match columns.as_slice() {
                [interface, _, protocol, address] if *interface != "lo" && protocol.starts_with("ipv") => {
                    Some(*address)
                }
                _ => None,
            }
        })
        .collect()
}

fn write_private(path: &Path, content: &[u8]) -> std::io::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domifaddr_output_yields_addresses_without_loopback() {
        let table = " lo         00:00:00:00:00:00    ipv4         127.0.0.1/8\n \
                     -          -                    ipv6         ::1/128\n \
                     eth0       52:54:00:12:34:56    ipv4         192.168.122.23/24\n \
                     -          -                    ipv6         fe80::5054:ff:fe12:3456/64\n";
        let addresses = parse_domifaddr(table);
        assert_eq!(
            addresses,
            ["::1/128", "192.168.122.23/24", "fe80::5054:ff:fe12:3456/64"]
        );
        // The continuation line of lo slips through the column filter; pick_address drops it.
        assert_eq!(pick_address(addresses).as_deref(), Some("192.168.122.23"));
    }

    #[test]
    fn info_fields_are_read_by_key() {
        let info = "Name:           default-pool\nState:          running\nAutostart:      no\n";
        assert_eq!(field(info, "State"), Some("running"));
        assert_eq!(field(info, "Persistent"), None);
    }

    #[test]
    fn virsh_failures_are_classified() {
        let failed = |message: &str| VirshError::Failed {
            command: "list".into(),
            message: message.into(),
        };
        let unreachable =
            failed("failed to connect to the hypervisor; Failed to connect socket to '/x': No such file");
        assert!(matches!(
            classify("x", unreachable),
            ProviderError::Unavailable(_)
        ));
        assert!(failed("failed to get domain 'epo-a'").is_missing("domain"));
        // Undefined between virsh's lookup by name and its call (tests/gc.rs saw it: another
        // installation's GC deleted a domain this one was listing).
        let gone = "error: Domain not found: no domain with matching uuid '654378bb-7bdf-4167-8e8f-1fea48a869d7' (epo-crawl-p-orphan-cee99d83)";
        assert!(failed(gone).is_gone_domain() && !failed(gone).is_missing("domain"));
        assert!(!failed("Domain not found; End of file while reading data").is_gone_domain());
        assert!(!failed("failed to get domain 'a'; End of file while reading data").is_missing("domain"));
        assert!(matches!(
            classify("x", failed("internal error: something")),
            ProviderError::Backend(_)
        ));
        let timeout = VirshError::Timeout {
            command: "list".into(),
            timeout: Duration::from_secs(1),
        };
        assert!(matches!(classify("x", timeout), ProviderError::Unavailable(_)));
    }
}
