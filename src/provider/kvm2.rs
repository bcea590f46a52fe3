//! The `kvm2` provider: proxies as libvirt domains, driven through libvirt's API (the `virt`
//! crate) on a local or remote URI (`qemu:///system`, `qemu+ssh://host/system`).
//!
//! Each operation opens its own connection on a blocking thread (libvirt's API blocks) under
//! the configured timeout, so a hung libvirt costs a thread, never the async runtime, and the
//! caller gets `Unavailable`. Everything travels over the libvirt connection, the seed
//! included (`virStorageVolUpload`), so a remote URI needs nothing else on the operator's host
//! than `genisoimage`. What the domain, its volumes and its owner stamp look like is shared with
//! `kvm` (see [`super::libvirt`]); the stamp's namespace is kvm2's own, [`KVM2_NAMESPACE`].

use std::{
    sync::{Arc, Once},
    time::Duration,
};

use async_trait::async_trait;
use virt::{
    connect::Connect,
    domain::{Domain, DomainState},
    enumutil::Enum,
    error::{Error as VirtError, ErrorDomain, ErrorNumber},
    storage_pool::StoragePool,
    storage_vol::StorageVol,
    stream::Stream,
    sys,
};

use super::{
    Endpoint, Installation, Instance, InstanceRequest, InstanceState, ProbeReport, Provider, ProviderError,
    ProviderId,
    libvirt::{
        self, BaseVolume, KVM2_NAMESPACE, Kind, NewDomain, Stamp, StampError, VolumeNames, seed::Seed,
    },
    locks::NameLocks,
};
use crate::config::{KvmSettings, NetworkSettings, is_dns_label};

/// The provider type's name.
pub const PROVIDER_TYPE: &str = "kvm2";

/// kvm2's volume names and stamp namespace.
const KIND: Kind = Kind {
    provider_type: PROVIDER_TYPE,
    namespace: KVM2_NAMESPACE,
};

/// The `kvm2` provider instance.
pub struct Kvm2Provider {
    instance: String,
    installation: Arc<Installation>,
    settings: Arc<KvmSettings>,
    locks: NameLocks,
}

impl Kvm2Provider {
    /// A provider instance named `instance_name` (from the providers config) with `settings`.
    /// Connects lazily: a wrong URI shows on the first call (or [`Provider::probe`]).
    pub fn new(instance_name: &str, settings: KvmSettings) -> Self {
        static QUIET: Once = Once::new();
        // libvirt's default handler prints every error to stderr; ours are returned instead.
        QUIET.call_once(virt::error::clear_error_callback);
        Self {
            instance: instance_name.to_owned(),
            installation: Arc::new(Installation::default()),
            settings: Arc::new(settings),
            locks: NameLocks::default(),
        }
    }

    /// Stamp `installation` instead of the default one.
    pub fn with_installation(mut self, installation: Installation) -> Self {
        self.installation = Arc::new(installation);
        self
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.settings.timeout_seconds.max(1))
    }

    fn session(&self) -> Session {
        Session {
            instance: self.instance.clone(),
            installation: Arc::clone(&self.installation),
            settings: Arc::clone(&self.settings),
        }
    }

    /// Runs `work` with a fresh connection on a blocking thread, under the timeout.
    async fn blocking<T: Send + 'static>(
        &self,
        what: &'static str,
        work: impl FnOnce(&Session, &Connect) -> Result<T, ProviderError> + Send + 'static,
    ) -> Result<T, ProviderError> {
        let session = self.session();
        let uri = self.settings.uri.clone();
        let timeout = self.timeout();
        let task = tokio::task::spawn_blocking(move || {
            let connection = session.connect()?;
            work(&session, &connection)
        });
        match tokio::time::timeout(timeout, task).await {
            Err(_) => Err(ProviderError::Unavailable(format!(
                "libvirt at {uri} did not finish {what} within {timeout:?}"
            ))),
            Ok(Err(join)) => Err(ProviderError::Backend(format!(
                "{what} failed on its thread: {join}"
            ))),
            Ok(Ok(result)) => result,
        }
    }
}

#[async_trait]
impl Provider for Kvm2Provider {
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
        libvirt::check_create_name(&request.name)?;
        let seed = Seed::for_request(request).map_err(libvirt::seed_error)?;
        let iso = seed
            .build_iso(self.timeout())
            .await
            .map_err(libvirt::seed_error)?;
        let guard = self.locks.lock(&request.name).await;
        let request = request.clone();
        let created_at = jiff::Timestamp::now();
        self.blocking("create", move |session, connection| {
            // Held until the work ends, even if the caller stopped waiting for it.
            let _guard = guard;
            session.create(connection, &request, &iso, created_at)
        })
        .await
    }

    async fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let name = name.to_owned();
        self.blocking("get", move |session, connection| {
            match session.lookup(connection, &name)? {
                Lookup::Ours(_, stamp) if session.is_foreign(&stamp) => Err(ProviderError::NotFound(name)),
                Lookup::Ours(domain, stamp) => match session.describe(&domain, &name, *stamp, true) {
                    // Deleted between the lookup and the description.
                    Err(_) if session.vanished(connection, &name) => Err(ProviderError::NotFound(name)),
                    described => described,
                },
                Lookup::Missing | Lookup::Foreign => Err(ProviderError::NotFound(name)),
            }
        })
        .await
    }

    async fn delete(&self, name: &str) -> Result<(), ProviderError> {
        if !is_dns_label(name) {
            return Ok(());
        }
        let guard = self.locks.lock(name).await;
        let name = name.to_owned();
        self.blocking("delete", move |session, connection| {
            let _guard = guard;
            session.delete(connection, &name)
        })
        .await
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        self.blocking("list", |session, connection| {
            let mut instances = Vec::new();
            for (domain, name, stamp) in session.stamped_domains(connection)? {
                match session.describe(&domain, &name, stamp, false) {
                    Ok(instance) => instances.push(instance),
                    // Deleted while we listed.
                    Err(_) if session.vanished(connection, &name) => {}
                    Err(err) => return Err(err),
                }
            }
            Ok(instances)
        })
        .await
    }

    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let guard = self.locks.lock(name).await;
        let name = name.to_owned();
        self.blocking("adopt", move |session, connection| {
            let _guard = guard;
            session.adopt(connection, &name)
        })
        .await
    }

    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        self.blocking("probe", |session, connection| {
            let count = session.stamped_domains(connection)?.len();
            let pool = session.pool(connection)?;
            session.base_volume(&pool)?;
            let version = |v: u32| format!("{}.{}.{}", v / 1_000_000, v / 1000 % 1000, v % 1000);
            let library = connection
                .lib_version()
                .map_err(|err| classify("reading libvirt's version", &err))?;
            let driver = connection
                .driver_type()
                .unwrap_or_else(|_| "hypervisor".to_owned());
            let hypervisor = connection
                .hyp_version()
                .map(|v| format!(", hypervisor {driver} {}", version(v)))
                .unwrap_or_default();
            Ok(ProbeReport {
                instance_count: count,
                detail: format!(
                    "libvirt {}{hypervisor} at {}; pool {} with base image {}",
                    version(library),
                    session.settings.uri,
                    session.settings.pool,
                    session.settings.base_image
                ),
            })
        })
        .await
    }
}

/// What one blocking operation knows: which provider instance it works for and its settings.
struct Session {
    instance: String,
    installation: Arc<Installation>,
    settings: Arc<KvmSettings>,
}

/// A domain carrying kvm2's stamp: the domain, its name and its stamp.
type StampedDomain = (Domain, String, Result<Stamp, StampError>);

/// A domain of a given name, as kvm2 sees it.
type Lookup = libvirt::Lookup<Domain>;

impl Session {
    fn connect(&self) -> Result<Connect, ProviderError> {
        Connect::open(Some(&self.settings.uri)).map_err(|err| {
            ProviderError::Unavailable(format!(
                "cannot connect to libvirt at {}: {}",
                self.settings.uri,
                err.message()
            ))
        })
    }

    fn id(&self, name: &str) -> ProviderId {
        ProviderId::new(PROVIDER_TYPE, &self.instance, name)
    }

    /// Whether `stamp` names another installation (a damaged stamp names none).
    fn is_foreign(&self, stamp: &Result<Stamp, StampError>) -> bool {
        libvirt::is_foreign(&self.installation, stamp)
    }

    /// Restamps legacy domain `name` with this installation (live and persistent definition).
    fn adopt(&self, connection: &Connect, name: &str) -> Result<Instance, ProviderError> {
        let (domain, stamp) = match self.lookup(connection, name)? {
            Lookup::Ours(domain, stamp) => (domain, *stamp),
            Lookup::Missing | Lookup::Foreign => return Err(ProviderError::NotFound(name.to_owned())),
        };
        let (stamp, changed) = libvirt::adoption_stamp(name, stamp, &self.installation)?;
        if !changed {
            return self.describe(&domain, name, Ok(stamp), false);
        }
        let active = domain
            .is_active()
            .map_err(|err| classify(format!("reading the state of domain {name}"), &err))?;
        let mut flags = sys::VIR_DOMAIN_AFFECT_CONFIG;
        if active {
            flags |= sys::VIR_DOMAIN_AFFECT_LIVE;
        }
        domain
            .set_metadata(
                sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                Some(&stamp.to_element()),
                Some(libvirt::STAMP_PREFIX),
                Some(KVM2_NAMESPACE),
                flags,
            )
            .map_err(|err| classify(format!("restamping domain {name}"), &err))?;
        self.describe(&domain, name, Ok(stamp), false)
    }

    fn lookup(&self, connection: &Connect, name: &str) -> Result<Lookup, ProviderError> {
        let domain = match connection.lookup_domain_by_name(name) {
            Ok(domain) => domain,
            Err(err) if has_code(&err, ErrorNumber::NoDomain) => return Ok(Lookup::Missing),
            Err(err) => return Err(classify(format!("looking up domain {name}"), &err)),
        };
        match read_stamp(&domain) {
            Ok(Some(stamp)) => Ok(Lookup::Ours(domain, Box::new(stamp))),
            Ok(None) => Ok(Lookup::Foreign),
            Err(err) if has_code(&err, ErrorNumber::NoDomain) => Ok(Lookup::Missing),
            Err(err) => Err(classify(format!("reading the metadata of domain {name}"), &err)),
        }
    }

    /// Whether domain `name` certainly no longer exists.
    fn vanished(&self, connection: &Connect, name: &str) -> bool {
        matches!(connection.lookup_domain_by_name(name), Err(err) if has_code(&err, ErrorNumber::NoDomain))
    }

    /// Every domain carrying kvm2's stamp, with its name.
    fn stamped_domains(&self, connection: &Connect) -> Result<Vec<StampedDomain>, ProviderError> {
        let domains = connection
            .list_all_domains(0)
            .map_err(|err| classify("listing domains", &err))?;
        let mut stamped = Vec::new();
        for domain in domains {
            match read_stamp(&domain) {
                Ok(Some(stamp)) => {
                    let name = domain
                        .name()
                        .map_err(|err| classify("reading a domain's name", &err))?;
                    stamped.push((domain, name, stamp));
                }
                Ok(None) => {}
                // Deleted while we listed: not there any more.
                Err(err) if has_code(&err, ErrorNumber::NoDomain) => {}
                Err(err) => return Err(classify("reading domain metadata", &err)),
            }
        }
        Ok(stamped)
    }

    fn describe(
        &self,
        domain: &Domain,
        name: &str,
        stamp: Result<Stamp, StampError>,
        discover: bool,
    ) -> Result<Instance, ProviderError> {
        let info = domain
            .info()
            .map_err(|err| classify(format!("reading the state of domain {name}"), &err))?;
        let state = match info.state {
            Enum::Known(DomainState::Running | DomainState::Blocked) => InstanceState::Running,
            Enum::Known(DomainState::NoState) => InstanceState::Starting,
            _ => InstanceState::Stopped,
        };
        let discovered = libvirt::discovery_port(&stamp, &state, discover)
            .and_then(|port| discover_address(domain).map(|host| Endpoint { host, port }));
        Ok(libvirt::instance_from_stamp(
            self.id(name),
            stamp,
            state,
            discovered,
        ))
    }

    /// The configured pool, active; `None` if it does not exist.
    fn find_pool(&self, connection: &Connect) -> Result<Option<StoragePool>, ProviderError> {
        let name = &self.settings.pool;
        let pool = match connection.lookup_storage_pool_by_name(name) {
            Ok(pool) => pool,
            Err(err) if has_code(&err, ErrorNumber::NoStoragePool) => return Ok(None),
            Err(err) => return Err(classify(format!("looking up storage pool {name}"), &err)),
        };
        let active = pool
            .is_active()
            .map_err(|err| classify(format!("reading the state of storage pool {name}"), &err))?;
        if !active {
            return Err(ProviderError::Misconfigured(format!(
                "storage pool {name} at {} is not active (virsh pool-start {name})",
                self.settings.uri
            )));
        }
        Ok(Some(pool))
    }

    /// The configured pool, active.
    fn pool(&self, connection: &Connect) -> Result<StoragePool, ProviderError> {
        self.find_pool(connection)?.ok_or_else(|| {
            ProviderError::Misconfigured(format!(
                "storage pool {} does not exist at {}",
                self.settings.pool, self.settings.uri
            ))
        })
    }

    fn base_volume(&self, pool: &StoragePool) -> Result<BaseVolume, ProviderError> {
        let name = &self.settings.base_image;
        let volume = pool.lookup_storage_vol_by_name(name).map_err(|err| {
            if has_code(&err, ErrorNumber::NoStorageVolume) {
                ProviderError::Misconfigured(format!(
                    "base image {name} is not a volume of storage pool {}",
                    self.settings.pool
                ))
            } else {
                classify(format!("looking up base image {name}"), &err)
            }
        })?;
        let xml = volume
            .xml_desc(0)
            .map_err(|err| classify(format!("reading base image {name}"), &err))?;
        BaseVolume::parse(&xml)
            .map_err(|err| ProviderError::Backend(format!("base image {name}'s description: {err}")))
    }

    fn check_network(&self, connection: &Connect) -> Result<(), ProviderError> {
        let NetworkSettings::Libvirt { name } = &self.settings.network else {
            return Ok(());
        };
        let network = connection.lookup_network_by_name(name).map_err(|err| {
            if has_code(&err, ErrorNumber::NoNetwork) {
                ProviderError::Misconfigured(format!(
                    "libvirt network {name} does not exist at {}",
                    self.settings.uri
                ))
            } else {
                classify(format!("looking up libvirt network {name}"), &err)
            }
        })?;
        let active = network
            .is_active()
            .map_err(|err| classify(format!("reading the state of network {name}"), &err))?;
        if active {
            Ok(())
        } else {
            Err(ProviderError::Misconfigured(format!(
                "libvirt network {name} is not active (virsh net-start {name})"
            )))
        }
    }

    fn create(
        &self,
        connection: &Connect,
        request: &InstanceRequest,
        iso: &[u8],
        created_at: jiff::Timestamp,
    ) -> Result<Instance, ProviderError> {
        let name = &request.name;
        match self.lookup(connection, name)? {
            Lookup::Ours(domain, stamp) => {
                if let Ok(stamp) = &*stamp {
                    self.installation
                        .refuse_foreign(name, stamp.installation.as_ref())?;
                }
                // Made by an earlier attempt (perhaps one that crashed before starting it).
                let active = domain
                    .is_active()
                    .map_err(|err| classify(format!("reading the state of domain {name}"), &err))?;
                if !active {
                    domain
                        .create()
                        .map_err(|err| classify(format!("starting existing domain {name}"), &err))?;
                }
                return self.describe(&domain, name, *stamp, true);
            }
            Lookup::Foreign => return Err(libvirt::foreign_domain(name, KVM2_NAMESPACE)),
            Lookup::Missing => {}
        }
        let pool = self.pool(connection)?;
        let base = self.base_volume(&pool)?;
        self.check_network(connection)?;
        let existing = if libvirt::needs_existing_stamps(&self.settings) {
            let stamped = self.stamped_domains(connection)?;
            Some(stamped.into_iter().map(|(_, _, stamp)| stamp).collect())
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
        self.delete_volumes(&pool, &volumes)?;
        let domain = self.make_domain(connection, &pool, &base, &volumes, iso, &xml, name)?;
        self.describe(&domain, name, Ok(stamp), true)
    }

    /// Makes the volumes, defines and starts the domain. Whatever fails, what this call made
    /// is removed before the error returns, so nothing leaks.
    #[allow(clippy::too_many_arguments)]
    fn make_domain(
        &self,
        connection: &Connect,
        pool: &StoragePool,
        base: &BaseVolume,
        volumes: &VolumeNames,
        iso: &[u8],
        xml: &str,
        name: &str,
    ) -> Result<Domain, ProviderError> {
        let cleanup_volumes = |err: ProviderError| {
            if let Err(cleanup) = self.delete_volumes(pool, volumes) {
                tracing::warn!(instance = name, error = %cleanup, "deleting volumes after a failed create");
            }
            err
        };
        StorageVol::create_xml(pool, &libvirt::overlay_volume_xml(&volumes.disk, base), 0).map_err(
            |err| cleanup_volumes(classify(format!("creating disk volume {}", volumes.disk), &err)),
        )?;
        let seed = StorageVol::create_xml(
            pool,
            &libvirt::seed_volume_xml(&volumes.seed, iso.len() as u64),
            0,
        )
        .map_err(|err| cleanup_volumes(classify(format!("creating seed volume {}", volumes.seed), &err)))?;
        self.upload(connection, &seed, &volumes.seed, iso)
            .map_err(cleanup_volumes)?;
        let domain = match connection.define_domain_xml(xml) {
            Ok(domain) => domain,
            // Someone else defined this name meanwhile: everything of that name is theirs now.
            Err(err) if !self.vanished(connection, name) => {
                return Err(ProviderError::Backend(format!(
                    "defining domain {name}: {}; a domain of that name appeared meanwhile",
                    err.message()
                )));
            }
            Err(err) => return Err(cleanup_volumes(classify(format!("defining domain {name}"), &err))),
        };
        if let Err(err) = domain.create() {
            // A failed start leaves a defined domain: undefine it and delete its volumes.
            if let Err(cleanup) = self.remove(connection, name, Some(pool)) {
                tracing::warn!(instance = name, error = %cleanup, "cleaning up after a failed start");
            }
            return Err(ProviderError::Backend(format!(
                "starting domain {name}: {}",
                err.message()
            )));
        }
        Ok(domain)
    }

    /// Streams the seed into its volume over the libvirt connection (so it works remotely).
    fn upload(
        &self,
        connection: &Connect,
        volume: &StorageVol,
        name: &str,
        data: &[u8],
    ) -> Result<(), ProviderError> {
        let stream = Stream::new(connection, 0).map_err(|err| classify("opening an upload stream", &err))?;
        if let Err(err) = volume.upload(&stream, 0, data.len() as u64, 0) {
            let _ = stream.abort();
            // libvirt's test driver keeps no volume contents, so it cannot take uploads; there
            // the seed volume stays empty, which is all a mock hypervisor can use.
            let test_driver = connection.uri().is_ok_and(|uri| uri.starts_with("test:"));
            if has_code(&err, ErrorNumber::NoSupport) && test_driver {
                tracing::debug!(volume = name, "test driver: seed volume left empty");
                return Ok(());
            }
            return Err(classify(format!("uploading seed volume {name}"), &err));
        }
        let mut sent = 0;
        while sent < data.len() {
            match stream.send(&data[sent..]) {
                Ok(count) if count > 0 => sent += count as usize,
                Ok(_) => {
                    let _ = stream.abort();
                    return Err(ProviderError::Backend(format!(
                        "uploading seed volume {name}: the stream took no data"
                    )));
                }
                Err(err) => {
                    let _ = stream.abort();
                    return Err(classify(format!("uploading seed volume {name}"), &err));
                }
            }
        }
        stream
            .finish()
            .map_err(|err| classify(format!("finishing the upload of seed volume {name}"), &err))
    }

    fn delete(&self, connection: &Connect, name: &str) -> Result<(), ProviderError> {
        let lookup = self.lookup(connection, name)?;
        if libvirt::delete_removes(&lookup, &self.installation, name, PROVIDER_TYPE) {
            self.remove(connection, name, None)
        } else {
            Ok(())
        }
    }

    /// Destroys and undefines domain `name` (if it exists) and deletes its volumes. Callers
    /// have checked that the domain, if any, is ours.
    fn remove(
        &self,
        connection: &Connect,
        name: &str,
        pool: Option<&StoragePool>,
    ) -> Result<(), ProviderError> {
        match connection.lookup_domain_by_name(name) {
            Ok(domain) => {
                if let Err(err) = domain.destroy()
                    && !has_code(&err, ErrorNumber::OperationInvalid)
                    && !has_code(&err, ErrorNumber::NoDomain)
                {
                    return Err(classify(format!("stopping domain {name}"), &err));
                }
                undefine(&domain, name)?;
            }
            Err(err) if has_code(&err, ErrorNumber::NoDomain) => {}
            Err(err) => return Err(classify(format!("looking up domain {name}"), &err)),
        }
        let volumes = VolumeNames::new(name, PROVIDER_TYPE);
        match pool {
            Some(pool) => self.delete_volumes(pool, &volumes),
            None => match self.find_pool(connection)? {
                Some(pool) => self.delete_volumes(&pool, &volumes),
                // A pool that does not exist holds no volumes.
                None => {
                    tracing::warn!(instance = name, pool = %self.settings.pool, "delete: no such pool, so no volumes");
                    Ok(())
                }
            },
        }
    }

    fn delete_volumes(&self, pool: &StoragePool, volumes: &VolumeNames) -> Result<(), ProviderError> {
        for name in volumes.all() {
            match pool.lookup_storage_vol_by_name(name) {
                Ok(volume) => match volume.delete(0) {
                    Ok(()) => {}
                    Err(err) if has_code(&err, ErrorNumber::NoStorageVolume) => {}
                    Err(err) => return Err(classify(format!("deleting volume {name}"), &err)),
                },
                Err(err) if has_code(&err, ErrorNumber::NoStorageVolume) => {}
                Err(err) => return Err(classify(format!("looking up volume {name}"), &err)),
            }
        }
        Ok(())
    }
}

/// kvm2's stamp of `domain`: `None` if it has none (not ours), `Some(Err)` if it is damaged.
fn read_stamp(domain: &Domain) -> Result<Option<Result<Stamp, StampError>>, VirtError> {
    match domain.metadata(sys::VIR_DOMAIN_METADATA_ELEMENT as i32, Some(KVM2_NAMESPACE), 0) {
        Ok(xml) => Ok(Some(Stamp::parse(&xml))),
        Err(err) if has_code(&err, ErrorNumber::NoDomainMetadata) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Undefines with every flag that removes what the domain left (managed save, snapshot and
/// checkpoint metadata, NVRAM); drivers that do not know a flag get a plainer call.
fn undefine(domain: &Domain, name: &str) -> Result<(), ProviderError> {
    let attempts = [
        sys::VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
            | sys::VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
            | sys::VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
            | sys::VIR_DOMAIN_UNDEFINE_NVRAM,
        sys::VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | sys::VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA,
    ];
    for flags in attempts {
        match domain.undefine_flags(flags) {
            Ok(()) => return Ok(()),
            Err(err) if has_code(&err, ErrorNumber::NoDomain) => return Ok(()),
            Err(err) if has_code(&err, ErrorNumber::InvalidArg) || has_code(&err, ErrorNumber::NoSupport) => {
            }
            Err(err) => return Err(classify(format!("undefining domain {name}"), &err)),
        }
    }
    match domain.undefine() {
        Ok(()) => Ok(()),
        Err(err) if has_code(&err, ErrorNumber::NoDomain) => Ok(()),
        Err(err) => Err(classify(format!("undefining domain {name}"), &err)),
    }
}

/// The guest's address from the DHCP leases of its libvirt network, else from the guest
/// agent. Either may know nothing (user-mode NIC, no agent): that is no error.
fn discover_address(domain: &Domain) -> Option<String> {
    for source in [
        sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
        sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
    ] {
        match domain.interface_addresses(source, 0) {
            Ok(interfaces) => {
                let found = libvirt::pick_address(
                    interfaces
                        .iter()
                        .filter(|interface| interface.name != "lo")
                        .flat_map(|interface| interface.addrs.iter().map(|address| address.addr.as_str())),
                );
                if found.is_some() {
                    return found;
                }
            }
            Err(err) => tracing::trace!(error = %err.message(), source, "no address from this source"),
        }
    }
    None
}

fn has_code(err: &VirtError, code: ErrorNumber) -> bool {
    err.code() == Enum::Known(code)
}

/// A libvirt error as a provider error: connection trouble is `Unavailable` (retry later);
/// anything else is a backend error.
fn classify(context: impl std::fmt::Display, err: &VirtError) -> ProviderError {
    let message = format!("{context}: {}", err.message());
    let connection_trouble = matches!(
        err.code(),
        Enum::Known(
            ErrorNumber::NoConnect
                | ErrorNumber::InvalidConn
                | ErrorNumber::Rpc
                | ErrorNumber::AuthFailed
                | ErrorNumber::AuthUnavailable
                | ErrorNumber::AuthCancelled
                | ErrorNumber::OperationTimeout
                | ErrorNumber::NoServer
                | ErrorNumber::Ssh
                | ErrorNumber::Libssh
        )
    ) || (err.code() == Enum::Known(ErrorNumber::SystemError)
        && matches!(err.domain(), Enum::Known(ErrorDomain::Rpc | ErrorDomain::Remote)));
    if connection_trouble {
        ProviderError::Unavailable(message)
    } else {
        ProviderError::Backend(message)
    }
}
