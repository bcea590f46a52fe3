//! The `kvm` provider: proxies as libvirt domains, driven through the `virsh` command line on
//! a local or remote URI (`qemu+ssh://user@host/system` works as it does for `virsh` itself).
//!
//! Every call runs `virsh --connect URI ...` under the configured timeout (the child is killed
//! when it runs over), with `LC_ALL=C` so its messages can be recognised. Files virsh reads
//! (volume and domain XML, the seed ISO) are written to a private temporary folder on the
//! operator's host; `vol-upload` streams the seed over the libvirt connection, so nothing is
//! copied to a remote host by other means. The domain, its volumes and its owner stamp look
//! like `kvm2`'s (see [`super::libvirt`]) but carry kvm's own namespace, [`KVM_NAMESPACE`], and
//! volume names: the two providers never adopt each other's domains.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::Duration,
};

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};

use super::{
    Endpoint, Installation, Instance, InstanceRequest, InstanceState, ProbeReport, Provider, ProviderError,
    ProviderId,
    libvirt::{self, BaseVolume, KVM_NAMESPACE, Kind, NewDomain, Stamp, StampError, VolumeNames, seed::Seed},
    locks::NameLocks,
};
use crate::config::{KvmSettings, NetworkSettings, is_dns_label};

/// The provider type's name.
pub const PROVIDER_TYPE: &str = "kvm";

/// kvm's volume names and stamp namespace.
const KIND: Kind = Kind {
    provider_type: PROVIDER_TYPE,
    namespace: KVM_NAMESPACE,
};

/// How many `virsh` children `list` runs at once.
const LIST_CONCURRENCY: usize = 4;

/// A `virsh` run that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum VirshError {
    /// virsh could not be started.
    #[error("cannot run {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
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
}

/// A virsh failure as a provider error.
fn classify(context: impl std::fmt::Display, err: VirshError) -> ProviderError {
    match &err {
        VirshError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            ProviderError::Misconfigured(format!("{context}: {err}; install libvirt-clients"))
        }
        VirshError::Timeout { .. } => ProviderError::Unavailable(format!("{context}: {err}")),
        _ if err.is_connection_trouble() => ProviderError::Unavailable(format!("{context}: {err}")),
        _ => ProviderError::Backend(format!("{context}: {err}")),
    }
}

/// The `kvm` provider instance.
pub struct KvmProvider {
    instance: String,
    installation: Installation,
    settings: Arc<KvmSettings>,
    locks: NameLocks,
    virsh: PathBuf,
}

/// A domain of a given name, as kvm sees it (the name is the handle).
type Lookup = libvirt::Lookup<()>;

impl KvmProvider {
    /// A provider instance named `instance_name` (from the providers config) with `settings`,
    /// running the `virsh` found on `PATH`.
    pub fn new(instance_name: &str, settings: KvmSettings) -> Self {
        Self {
            instance: instance_name.to_owned(),
            installation: Installation::default(),
            settings: Arc::new(settings),
            locks: NameLocks::default(),
            virsh: PathBuf::from("virsh"),
        }
    }

    /// Stamp `installation` instead of the default one.
    pub fn with_installation(mut self, installation: Installation) -> Self {
        self.installation = installation;
        self
    }

    /// Whether `stamp` names another installation (a damaged stamp names none).
    fn is_foreign(&self, stamp: &Result<Stamp, StampError>) -> bool {
        libvirt::is_foreign(&self.installation, stamp)
    }

    /// Runs this `virsh` binary instead of the one on `PATH`.
    pub fn with_virsh(mut self, virsh: impl Into<PathBuf>) -> Self {
        self.virsh = virsh.into();
        self
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.settings.timeout_seconds.max(1))
    }

    /// Runs `virsh --connect URI ARGS...`, returning its standard output.
    async fn virsh(&self, args: &[&str]) -> Result<String, VirshError> {
        let command = args.first().copied().unwrap_or_default().to_owned();
        let timeout = self.timeout();
        let mut child = tokio::process::Command::new(&self.virsh);
        child
            .arg("--connect")
            .arg(&self.settings.uri)
            .arg("--quiet")
            .args(args)
            .env("LC_ALL", "C")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let output = match tokio::time::timeout(timeout, child.output()).await {
            Err(_) => return Err(VirshError::Timeout { command, timeout }),
            Ok(Err(source)) => {
                return Err(VirshError::Spawn {
                    program: self.virsh.display().to_string(),
                    source,
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

    fn id(&self, name: &str) -> ProviderId {
        ProviderId::new(PROVIDER_TYPE, &self.instance, name)
    }

    /// Names of every domain (persistent or not, running or not).
    async fn domain_names(&self) -> Result<Vec<String>, ProviderError> {
        let output = self
            .virsh(&["list", "--all", "--name"])
            .await
            .map_err(|err| classify("listing domains", err))?;
        Ok(output
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect())
    }

    async fn lookup(&self, name: &str) -> Result<Lookup, ProviderError> {
        match self
            .virsh(&["metadata", "--domain", name, "--uri", KVM_NAMESPACE])
            .await
        {
            Ok(xml) => Ok(Lookup::Ours((), Box::new(Stamp::parse(xml.trim())))),
            Err(err) if err.message().contains("metadata not found") => Ok(Lookup::Foreign),
            Err(err) if err.is_missing("domain") => {
                // virsh says "failed to get domain" for more than absence; a listing that
                // succeeds without the name proves it.
                if self.domain_names().await?.iter().any(|listed| listed == name) {
                    Err(classify(format!("looking up domain {name}"), err))
                } else {
                    Ok(Lookup::Missing)
                }
            }
            Err(err) => Err(classify(format!("reading the metadata of domain {name}"), err)),
        }
    }

    async fn state(&self, name: &str) -> Result<InstanceState, ProviderError> {
        let output = self
            .virsh(&["domstate", "--domain", name])
            .await
            .map_err(|err| classify(format!("reading the state of domain {name}"), err))?;
        Ok(match output.trim() {
            "running" | "idle" | "blocked" => InstanceState::Running,
            "no state" => InstanceState::Starting,
            _ => InstanceState::Stopped,
        })
    }

    async fn describe(
        &self,
        name: &str,
        stamp: Result<Stamp, StampError>,
        discover: bool,
    ) -> Result<Instance, ProviderError> {
        let state = self.state(name).await?;
        let discovered = match libvirt::discovery_port(&stamp, &state, discover) {
            Some(port) => self
                .discover_address(name)
                .await
                .map(|host| Endpoint { host, port }),
            None => None,
        };
        Ok(libvirt::instance_from_stamp(
            self.id(name),
            stamp,
            state,
            discovered,
        ))
    }

    /// The guest's address from its network's DHCP leases, else from the guest agent.
    async fn discover_address(&self, name: &str) -> Option<String> {
        for source in ["lease", "agent"] {
            match self
                .virsh(&["domifaddr", "--domain", name, "--source", source])
                .await
            {
                Ok(table) => {
                    let found = libvirt::pick_address(parse_domifaddr(&table));
                    if found.is_some() {
                        return found;
                    }
                }
                Err(err) => tracing::trace!(error = %err, source, "no address from this source"),
            }
        }
        None
    }

    /// Every domain carrying kvm's stamp.
    async fn stamped(&self) -> Result<Vec<(String, Result<Stamp, StampError>)>, ProviderError> {
        let names = self.domain_names().await?;
        let found: Vec<Option<(String, Result<Stamp, StampError>)>> = futures::stream::iter(names)
            .map(|name| async move {
                match self
                    .virsh(&["metadata", "--domain", &name, "--uri", KVM_NAMESPACE])
                    .await
                {
                    Ok(xml) => Ok(Some((name, Stamp::parse(xml.trim())))),
                    Err(err) if err.message().contains("metadata not found") => Ok(None),
                    // Deleted while we listed.
                    Err(err) if err.is_missing("domain") => Ok(None),
                    Err(err) => Err(classify(format!("reading the metadata of domain {name}"), err)),
                }
            })
            .buffered(LIST_CONCURRENCY)
            .try_collect()
            .await?;
        Ok(found.into_iter().flatten().collect())
    }

    async fn check_pool(&self) -> Result<(), ProviderError> {
        let pool = &self.settings.pool;
        let info = self.virsh(&["pool-info", "--pool", pool]).await.map_err(|err| {
            if err.is_missing("pool") {
                ProviderError::Misconfigured(format!(
                    "storage pool {pool} does not exist at {}",
                    self.settings.uri
                ))
            } else {
                classify(format!("reading storage pool {pool}"), err)
            }
        })?;
        if field(&info, "State") == Some("running") {
            Ok(())
        } else {
            Err(ProviderError::Misconfigured(format!(
                "storage pool {pool} at {} is not active (virsh pool-start {pool})",
                self.settings.uri
            )))
        }
    }

    async fn base_volume(&self) -> Result<BaseVolume, ProviderError> {
        let (pool, base) = (&self.settings.pool, &self.settings.base_image);
        let xml = self
            .virsh(&["vol-dumpxml", "--vol", base, "--pool", pool])
            .await
            .map_err(|err| {
                if err.is_missing("vol") {
                    ProviderError::Misconfigured(format!(
                        "base image {base} is not a volume of storage pool {pool}"
                    ))
                } else {
                    classify(format!("reading base image {base}"), err)
                }
            })?;
        BaseVolume::parse(&xml)
            .map_err(|err| ProviderError::Backend(format!("base image {base}'s description: {err}")))
    }

    async fn check_network(&self) -> Result<(), ProviderError> {
        let NetworkSettings::Libvirt { name } = &self.settings.network else {
            return Ok(());
        };
        let info = self
            .virsh(&["net-info", "--network", name])
            .await
            .map_err(|err| {
                if err.is_missing("network") {
                    ProviderError::Misconfigured(format!(
                        "libvirt network {name} does not exist at {}",
                        self.settings.uri
                    ))
                } else {
                    classify(format!("reading libvirt network {name}"), err)
                }
            })?;
        if field(&info, "Active") == Some("yes") {
            Ok(())
        } else {
            Err(ProviderError::Misconfigured(format!(
                "libvirt network {name} is not active (virsh net-start {name})"
            )))
        }
    }

    async fn create_new(
        &self,
        request: &InstanceRequest,
        iso: &[u8],
        created_at: jiff::Timestamp,
    ) -> Result<Instance, ProviderError> {
        let name = &request.name;
        self.check_pool().await?;
        let base = self.base_volume().await?;
        self.check_network().await?;
        let existing = if libvirt::needs_existing_stamps(&self.settings) {
            Some(
                self.stamped()
                    .await?
                    .into_iter()
                    .map(|(_, stamp)| stamp)
                    .collect(),
            )
        } else {
            None
        };
        let NewDomain { stamp, volumes, xml } = libvirt::new_domain(
            &self.settings,
            &self.installation,
            &self.instance,
            KIND,
            request,
            created_at,
            existing,
        )?;
        // No domain of this name exists, so volumes of its names are left from an interrupted
        // attempt and unused: start afresh.
        self.delete_volumes(&volumes).await?;
        self.make_domain(&base, &volumes, iso, &xml, name).await?;
        self.describe(name, Ok(stamp), true).await
    }

    /// Makes the volumes, defines and starts the domain. Whatever fails, what this call made
    /// is removed before the error returns, so nothing leaks.
    async fn make_domain(
        &self,
        base: &BaseVolume,
        volumes: &VolumeNames,
        iso: &[u8],
        xml: &str,
        name: &str,
    ) -> Result<(), ProviderError> {
        let pool = self.settings.pool.as_str();
        let folder = tempfile::Builder::new()
            .prefix("epo-kvm-")
            .tempdir()
            .map_err(|err| ProviderError::Backend(format!("creating a temporary folder: {err}")))?;
        let write = |file: &str, content: &[u8]| -> Result<String, ProviderError> {
            let path = folder.path().join(file);
            write_private(&path, content)
                .map_err(|err| ProviderError::Backend(format!("writing {}: {err}", path.display())))?;
            Ok(path.to_string_lossy().into_owned())
        };
        let disk_xml = write(
            "disk.xml",
            libvirt::overlay_volume_xml(&volumes.disk, base).as_bytes(),
        )?;
        let seed_xml = write(
            "seed.xml",
            libvirt::seed_volume_xml(&volumes.seed, iso.len() as u64).as_bytes(),
        )?;
        let seed_iso = write("seed.iso", iso)?;
        let domain_xml = write("domain.xml", xml.as_bytes())?;
        let steps: [(&[&str], String); 3] = [
            (
                &["vol-create", "--pool", pool, "--file", &disk_xml],
                format!("creating disk volume {}", volumes.disk),
            ),
            (
                &["vol-create", "--pool", pool, "--file", &seed_xml],
                format!("creating seed volume {}", volumes.seed),
            ),
            (
                &[
                    "vol-upload",
                    "--vol",
                    &volumes.seed,
                    "--pool",
                    pool,
                    "--file",
                    &seed_iso,
                ],
                format!("uploading seed volume {}", volumes.seed),
            ),
        ];
        for (args, context) in steps {
            if let Err(err) = self.virsh(args).await {
                let err = classify(context, err);
                if let Err(cleanup) = self.delete_volumes(volumes).await {
                    tracing::warn!(instance = name, error = %cleanup, "deleting volumes after a failed create");
                }
                return Err(err);
            }
        }
        if let Err(err) = self.virsh(&["define", "--file", &domain_xml]).await {
            let err = classify(format!("defining domain {name}"), err);
            // Someone else defined this name meanwhile: everything of that name is theirs now.
            if !matches!(self.lookup(name).await, Ok(Lookup::Missing)) {
                return Err(ProviderError::Backend(format!(
                    "{err}; a domain of that name appeared meanwhile"
                )));
            }
            if let Err(cleanup) = self.delete_volumes(volumes).await {
                tracing::warn!(instance = name, error = %cleanup, "deleting volumes after a failed create");
            }
            return Err(err);
        }
        if let Err(err) = self.virsh(&["start", "--domain", name]).await {
            // A failed start leaves a defined domain: undefine it and delete its volumes.
            if let Err(cleanup) = self.remove(name).await {
                tracing::warn!(instance = name, error = %cleanup, "cleaning up after a failed start");
            }
            return Err(if err.is_connection_trouble() {
                classify(format!("starting domain {name}"), err)
            } else {
                // A start that fails is about the domain (a kernel path, a taken port).
                ProviderError::Backend(format!("starting domain {name}: {}", err.message()))
            });
        }
        Ok(())
    }

    /// Destroys and undefines domain `name` (if it exists) and deletes its volumes. Callers
    /// have checked that the domain, if any, is ours.
    async fn remove(&self, name: &str) -> Result<(), ProviderError> {
        if let Err(err) = self.virsh(&["destroy", "--domain", name]).await
            && !err.is_missing("domain")
            && !err.message().contains("not running")
        {
            return Err(classify(format!("stopping domain {name}"), err));
        }
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
        let mut undefined = false;
        for args in attempts {
            match self.virsh(args).await {
                Ok(_) => {
                    undefined = true;
                    break;
                }
                Err(err) if err.is_missing("domain") => {
                    undefined = true;
                    break;
                }
                // A driver that does not know a flag: try a plainer call.
                Err(err)
                    if err.message().contains("unsupported flags")
                        || err.message().contains("not supported") => {}
                Err(err) => return Err(classify(format!("undefining domain {name}"), err)),
            }
        }
        if !undefined {
            return Err(ProviderError::Backend(format!(
                "domain {name} could not be undefined"
            )));
        }
        self.delete_volumes(&VolumeNames::new(name, PROVIDER_TYPE)).await
    }

    async fn delete_volumes(&self, volumes: &VolumeNames) -> Result<(), ProviderError> {
        let pool = self.settings.pool.as_str();
        for volume in volumes.all() {
            match self.virsh(&["vol-delete", "--vol", volume, "--pool", pool]).await {
                Ok(_) => {}
                Err(err) if err.is_missing("vol") => {}
                // A pool that does not exist holds no volumes.
                Err(err) if err.is_missing("pool") => {
                    tracing::warn!(pool, "no such pool, so no volumes to delete");
                    return Ok(());
                }
                Err(err) => return Err(classify(format!("deleting volume {volume}"), err)),
            }
        }
        Ok(())
    }
}

#[async_trait]
impl Provider for KvmProvider {
    fn provider_type(&self) -> &'static str {
        PROVIDER_TYPE
    }

    fn instance(&self) -> &str {
        &self.instance
    }

    fn installation(&self) -> &Installation {
        &self.installation
    }

    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError> {
        let name = &request.name;
        libvirt::check_create_name(name)?;
        let seed = Seed::for_request(request).map_err(libvirt::seed_error)?;
        let iso = seed
            .build_iso(self.timeout())
            .await
            .map_err(libvirt::seed_error)?;
        let _guard = self.locks.lock(name).await;
        match self.lookup(name).await? {
            Lookup::Ours((), stamp) => {
                if let Ok(stamp) = &*stamp {
                    self.installation
                        .refuse_foreign(name, stamp.installation.as_ref())?;
                }
                // Made by an earlier attempt (perhaps one that crashed before starting it).
                if self.state(name).await? == InstanceState::Stopped {
                    self.virsh(&["start", "--domain", name])
                        .await
                        .map_err(|err| classify(format!("starting existing domain {name}"), err))?;
                }
                self.describe(name, *stamp, true).await
            }
            Lookup::Foreign => Err(libvirt::foreign_domain(name, KVM_NAMESPACE)),
            Lookup::Missing => self.create_new(request, &iso, jiff::Timestamp::now()).await,
        }
    }

    async fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        match self.lookup(name).await? {
            Lookup::Ours((), stamp) if self.is_foreign(&stamp) => {
                Err(ProviderError::NotFound(name.to_owned()))
            }
            Lookup::Ours((), stamp) => match self.describe(name, *stamp, true).await {
                // Deleted between the two calls.
                Err(_) if matches!(self.lookup(name).await?, Lookup::Missing) => {
                    Err(ProviderError::NotFound(name.to_owned()))
                }
                other => other,
            },
            Lookup::Missing | Lookup::Foreign => Err(ProviderError::NotFound(name.to_owned())),
        }
    }

    async fn delete(&self, name: &str) -> Result<(), ProviderError> {
        if !is_dns_label(name) {
            return Ok(());
        }
        let _guard = self.locks.lock(name).await;
        let lookup = self.lookup(name).await?;
        if libvirt::delete_removes(&lookup, &self.installation, name, PROVIDER_TYPE) {
            self.remove(name).await
        } else {
            Ok(())
        }
    }

    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let _guard = self.locks.lock(name).await;
        let stamp = match self.lookup(name).await? {
            Lookup::Ours((), stamp) => *stamp,
            Lookup::Missing | Lookup::Foreign => return Err(ProviderError::NotFound(name.to_owned())),
        };
        let (stamp, changed) = libvirt::adoption_stamp(name, stamp, &self.installation)?;
        if changed {
            let xml = stamp.to_element();
            let mut args = vec![
                "metadata",
                "--domain",
                name,
                "--uri",
                KVM_NAMESPACE,
                "--key",
                libvirt::STAMP_PREFIX,
                "--set",
                &xml,
                "--config",
            ];
            // The running definition too, or the restamp would show only after a restart.
            if self.state(name).await? != InstanceState::Stopped {
                args.push("--live");
            }
            self.virsh(&args)
                .await
                .map_err(|err| classify(format!("restamping domain {name}"), err))?;
        }
        self.describe(name, Ok(stamp), false).await
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        let stamped = self.stamped().await?;
        let mut instances = Vec::with_capacity(stamped.len());
        for (name, stamp) in stamped {
            match self.describe(&name, stamp, false).await {
                Ok(instance) => instances.push(instance),
                // Deleted while we listed.
                Err(_) if matches!(self.lookup(&name).await?, Lookup::Missing) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(instances)
    }

    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        let version = self
            .virsh(&["version"])
            .await
            .map_err(|err| classify("reading libvirt's version", err))?;
        let count = self.stamped().await?.len();
        self.check_pool().await?;
        self.base_volume().await?;
        let library = field(&version, "Using library").unwrap_or("libvirt (version unknown)");
        let hypervisor = field(&version, "Running hypervisor")
            .map(|h| format!(", hypervisor {h}"))
            .unwrap_or_default();
        Ok(ProbeReport {
            instance_count: count,
            detail: format!(
                "{library}{hypervisor} at {} (virsh); pool {} with base image {}",
                self.settings.uri, self.settings.pool, self.settings.base_image
            ),
        })
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
        assert_eq!(
            libvirt::pick_address(addresses).as_deref(),
            Some("192.168.122.23")
        );
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
