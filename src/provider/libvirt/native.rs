//! The native access path, behind the `kvm2` provider type: libvirt's API through the `virt`
//! crate on a local or remote URI (`qemu:///system`, `qemu+ssh://host/system`).
//!
//! Each operation opens its own connection on its blocking thread (libvirt's API blocks) and
//! the caller waits at most the configured timeout for the whole operation, so a hung libvirt
//! costs a thread, never the async runtime, and the caller gets `Unavailable`. Everything
//! travels over the libvirt connection, the seed included (`virStorageVolUpload`), so a
//! remote URI needs nothing else on the operator's host than `genisoimage`. kvm2's domains
//! carry their own stamp namespace, [`KVM2_NAMESPACE`]. What this file must not hold is the
//! algorithm: that is [`super::driver`]'s.

use std::{sync::Once, time::Duration};

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
    KVM2_NAMESPACE, Kind, Lookup, STAMP_PREFIX, Stamp, StampError, call_timeout,
    driver::{Access, LibvirtProvider, NewVolume, Session, Stamped},
    pick_address,
};
use crate::{
    config::KvmSettings,
    provider::{InstanceState, ProviderError},
};

/// The provider type's name.
pub const PROVIDER_TYPE: &str = "kvm2";

/// The `kvm2` provider: the libvirt algorithm over libvirt's API.
pub type Kvm2Provider = LibvirtProvider<Native>;

impl Kvm2Provider {
    /// A provider instance named `instance_name` (from the providers config) with `settings`.
    /// Connects lazily: a wrong URI shows on the first call (or `probe`).
    pub fn new(instance_name: &str, settings: KvmSettings) -> Self {
        static QUIET: Once = Once::new();
        // libvirt's default handler prints every error to stderr; ours are returned instead.
        QUIET.call_once(virt::error::clear_error_callback);
        Self::with_access(instance_name, settings, Native)
    }
}

/// The native access path (libvirt's API).
pub struct Native;

impl Access for Native {
    const KIND: Kind = Kind::new(PROVIDER_TYPE, KVM2_NAMESPACE);
    type Session = NativeSession;

    fn open(&self, settings: &KvmSettings) -> Result<NativeSession, ProviderError> {
        let connection = Connect::open(Some(&settings.uri)).map_err(|err| {
            ProviderError::Unavailable(format!(
                "cannot connect to libvirt at {}: {}",
                settings.uri,
                err.message()
            ))
        })?;
        Ok(NativeSession {
            connection,
            uri: settings.uri.clone(),
        })
    }

    /// A blocked libvirt call cannot be interrupted: the caller stops waiting instead.
    fn operation_timeout(&self, settings: &KvmSettings) -> Option<Duration> {
        Some(call_timeout(settings))
    }
}

/// The connection of one operation.
pub struct NativeSession {
    connection: Connect,
    uri: String,
}

impl Session for NativeSession {
    type Domain = Domain;
    type Pool = StoragePool;

    fn lookup(&self, name: &str) -> Result<Lookup<Domain>, ProviderError> {
        let domain = match self.connection.lookup_domain_by_name(name) {
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

    fn vanished(&self, name: &str) -> Result<bool, ProviderError> {
        Ok(matches!(
            self.connection.lookup_domain_by_name(name),
            Err(err) if has_code(&err, ErrorNumber::NoDomain)
        ))
    }

    fn stamped(&self) -> Result<Vec<Stamped<Domain>>, ProviderError> {
        let domains = self
            .connection
            .list_all_domains(0)
            .map_err(|err| classify("listing domains", &err))?;
        let mut stamped = Vec::new();
        for domain in domains {
            match read_stamp(&domain) {
                Ok(Some(stamp)) => {
                    let name = domain
                        .name()
                        .map_err(|err| classify("reading a domain's name", &err))?;
                    stamped.push(Stamped { domain, name, stamp });
                }
                Ok(None) => {}
                // Deleted while we listed: not there any more.
                Err(err) if has_code(&err, ErrorNumber::NoDomain) => {}
                Err(err) => return Err(classify("reading domain metadata", &err)),
            }
        }
        Ok(stamped)
    }

    fn state(&self, domain: &Domain, name: &str) -> Result<InstanceState, ProviderError> {
        let info = domain
            .info()
            .map_err(|err| classify(format!("reading the state of domain {name}"), &err))?;
        Ok(match info.state {
            Enum::Known(DomainState::Running | DomainState::Blocked) => InstanceState::Running,
            Enum::Known(DomainState::NoState) => InstanceState::Starting,
            _ => InstanceState::Stopped,
        })
    }

    fn is_active(&self, domain: &Domain, name: &str) -> Result<bool, ProviderError> {
        domain
            .is_active()
            .map_err(|err| classify(format!("reading the state of domain {name}"), &err))
    }

    /// Either source may know nothing (user-mode NIC, no agent): that is no error.
    fn discover_address(&self, domain: &Domain, _name: &str) -> Option<String> {
        for source in [
            sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
            sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
        ] {
            match domain.interface_addresses(source, 0) {
                Ok(interfaces) => {
                    let found = pick_address(
                        interfaces
                            .iter()
                            .filter(|interface| interface.name != "lo")
                            .flat_map(|interface| {
                                interface.addrs.iter().map(|address| address.addr.as_str())
                            }),
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

    fn pool(&self, name: &str) -> Result<Option<(StoragePool, bool)>, ProviderError> {
        let pool = match self.connection.lookup_storage_pool_by_name(name) {
            Ok(pool) => pool,
            Err(err) if has_code(&err, ErrorNumber::NoStoragePool) => return Ok(None),
            Err(err) => return Err(classify(format!("looking up storage pool {name}"), &err)),
        };
        let active = pool
            .is_active()
            .map_err(|err| classify(format!("reading the state of storage pool {name}"), &err))?;
        Ok(Some((pool, active)))
    }

    fn volume_xml(&self, pool: &StoragePool, name: &str) -> Result<Option<String>, ProviderError> {
        let volume = match pool.lookup_storage_vol_by_name(name) {
            Ok(volume) => volume,
            Err(err) if has_code(&err, ErrorNumber::NoStorageVolume) => return Ok(None),
            Err(err) => return Err(classify(format!("looking up volume {name}"), &err)),
        };
        volume
            .xml_desc(0)
            .map(Some)
            .map_err(|err| classify(format!("reading volume {name}"), &err))
    }

    fn network_active(&self, name: &str) -> Result<Option<bool>, ProviderError> {
        let network = match self.connection.lookup_network_by_name(name) {
            Ok(network) => network,
            Err(err) if has_code(&err, ErrorNumber::NoNetwork) => return Ok(None),
            Err(err) => return Err(classify(format!("looking up libvirt network {name}"), &err)),
        };
        network
            .is_active()
            .map(Some)
            .map_err(|err| classify(format!("reading the state of network {name}"), &err))
    }

    fn create_volume(&self, pool: &StoragePool, new: &NewVolume<'_>) -> Result<(), ProviderError> {
        let volume = StorageVol::create_xml(pool, new.xml, 0)
            .map_err(|err| classify(format!("creating volume {}", new.name), &err))?;
        match new.content {
            Some(content) => self.upload(&volume, new.name, content),
            None => Ok(()),
        }
    }

    fn delete_volume(&self, pool: &StoragePool, name: &str) -> Result<(), ProviderError> {
        match pool.lookup_storage_vol_by_name(name) {
            Ok(volume) => match volume.delete(0) {
                Ok(()) => Ok(()),
                Err(err) if has_code(&err, ErrorNumber::NoStorageVolume) => Ok(()),
                Err(err) => Err(classify(format!("deleting volume {name}"), &err)),
            },
            Err(err) if has_code(&err, ErrorNumber::NoStorageVolume) => Ok(()),
            Err(err) => Err(classify(format!("looking up volume {name}"), &err)),
        }
    }

    fn define(&self, name: &str, xml: &str) -> Result<Domain, ProviderError> {
        self.connection
            .define_domain_xml(xml)
            .map_err(|err| classify(format!("defining domain {name}"), &err))
    }

    fn start(&self, domain: &Domain, name: &str) -> Result<(), ProviderError> {
        domain
            .create()
            .map(drop)
            .map_err(|err| classify(format!("starting domain {name}"), &err))
    }

    fn remove_domain(&self, name: &str) -> Result<(), ProviderError> {
        let domain = match self.connection.lookup_domain_by_name(name) {
            Ok(domain) => domain,
            Err(err) if has_code(&err, ErrorNumber::NoDomain) => return Ok(()),
            Err(err) => return Err(classify(format!("looking up domain {name}"), &err)),
        };
        if let Err(err) = domain.destroy()
            && !has_code(&err, ErrorNumber::OperationInvalid)
            && !has_code(&err, ErrorNumber::NoDomain)
        {
            return Err(classify(format!("stopping domain {name}"), &err));
        }
        undefine(&domain, name)
    }

    fn set_stamp(&self, domain: &Domain, name: &str, element: &str, live: bool) -> Result<(), ProviderError> {
        let mut flags = sys::VIR_DOMAIN_AFFECT_CONFIG;
        if live {
            flags |= sys::VIR_DOMAIN_AFFECT_LIVE;
        }
        domain
            .set_metadata(
                sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                Some(element),
                Some(STAMP_PREFIX),
                Some(KVM2_NAMESPACE),
                flags,
            )
            .map_err(|err| classify(format!("restamping domain {name}"), &err))
    }

    fn versions(&self) -> Result<String, ProviderError> {
        let version = |v: u32| format!("{}.{}.{}", v / 1_000_000, v / 1000 % 1000, v % 1000);
        let library = self
            .connection
            .lib_version()
            .map_err(|err| classify("reading libvirt's version", &err))?;
        let driver = self
            .connection
            .driver_type()
            .unwrap_or_else(|_| "hypervisor".to_owned());
        let hypervisor = self
            .connection
            .hyp_version()
            .map(|v| format!(", hypervisor {driver} {}", version(v)))
            .unwrap_or_default();
        Ok(format!(
            "libvirt {}{hypervisor} at {}",
            version(library),
            self.uri
        ))
    }
}

impl NativeSession {
    /// Streams `data` into `volume` over the libvirt connection (so it works remotely).
    fn upload(&self, volume: &StorageVol, name: &str, data: &[u8]) -> Result<(), ProviderError> {
        let stream =
            Stream::new(&self.connection, 0).map_err(|err| classify("opening an upload stream", &err))?;
        if let Err(err) = volume.upload(&stream, 0, data.len() as u64, 0) {
            let _ = stream.abort();
            // libvirt's test driver keeps no volume contents, so it cannot take uploads; there
            // the seed volume stays empty, which is all a mock hypervisor can use.
            let test_driver = self.connection.uri().is_ok_and(|uri| uri.starts_with("test:"));
            if has_code(&err, ErrorNumber::NoSupport) && test_driver {
                tracing::debug!(volume = name, "test driver: seed volume left empty");
                return Ok(());
            }
            return Err(classify(format!("uploading volume {name}"), &err));
        }
        let mut sent = 0;
        while sent < data.len() {
            match stream.send(&data[sent..]) {
                Ok(count) if count > 0 => sent += count as usize,
                Ok(_) => {
                    let _ = stream.abort();
                    return Err(ProviderError::Backend(format!(
                        "uploading volume {name}: the stream took no data"
                    )));
                }
                Err(err) => {
                    let _ = stream.abort();
                    return Err(classify(format!("uploading volume {name}"), &err));
                }
            }
        }
        stream
            .finish()
            .map_err(|err| classify(format!("finishing the upload of volume {name}"), &err))
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
