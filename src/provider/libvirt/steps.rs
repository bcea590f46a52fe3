//! The small decisions of the libvirt provisioning algorithm ([`super::driver`]), apart from
//! the driver so they read (and test) without a backend: what a name lookup means, which
//! domains `delete` leaves alone, what a new domain is made of, when an address is discovered,
//! how long a backend call may take and how seed failures are reported. Nothing here calls
//! libvirt.

use std::time::Duration;

use super::{DomainPlan, Stamp, StampError, VolumeNames, domain_xml, plan_host_forward};
use crate::{
    config::{KvmSettings, NetworkSettings, is_dns_label},
    provider::{Installation, InstanceRequest, InstanceState, ProviderError, libvirt::seed::SeedError},
};

/// A domain of a given name, as a libvirt provider sees it; `D` is the access path's handle
/// to the domain (`()` where the name is the handle).
pub enum Lookup<D> {
    /// No domain of that name.
    Missing,
    /// A domain without the provider type's stamp: not ours, never touched.
    Foreign,
    /// A domain the provider type made, with its stamp (boxed: it dwarfs the other variants).
    Ours(D, Box<Result<Stamp, StampError>>),
}

/// For `create`: the error if `name` cannot be a domain name.
pub fn check_create_name(name: &str) -> Result<(), ProviderError> {
    if is_dns_label(name) {
        Ok(())
    } else {
        Err(ProviderError::Misconfigured(format!(
            "instance name {name:?} is not a DNS label"
        )))
    }
}

/// Whether `stamp` names another installation than `installation` (a damaged stamp names none).
pub fn is_foreign(installation: &Installation, stamp: &Result<Stamp, StampError>) -> bool {
    stamp
        .as_ref()
        .is_ok_and(|stamp| installation.is_foreign(stamp.installation.as_ref()))
}

/// Whether `delete` of `name` removes what `lookup` found: never a domain without our stamp or
/// one of another installation (said in the log); a missing domain still has its volumes removed.
pub fn delete_removes<D>(
    lookup: &Lookup<D>,
    installation: &Installation,
    name: &str,
    provider_type: &str,
) -> bool {
    match lookup {
        Lookup::Foreign => {
            tracing::debug!(
                instance = name,
                "delete: the domain of that name is not {provider_type}'s; left alone"
            );
            false
        }
        Lookup::Ours(_, stamp) if is_foreign(installation, stamp) => {
            tracing::info!(
                instance = name,
                "delete: the domain of that name belongs to another installation; left alone"
            );
            false
        }
        Lookup::Missing | Lookup::Ours(..) => true,
    }
}

/// Whether planning a new domain needs the stamps of the existing ones (user-mode networking
/// picks a host port none of them holds).
pub fn needs_existing_stamps(settings: &KvmSettings) -> bool {
    matches!(settings.network, NetworkSettings::User { .. })
}

/// Everything a new domain is made of, decided before any backend call that makes something.
pub struct NewDomain {
    /// The owner stamp it carries.
    pub stamp: Stamp,
    /// Its volumes.
    pub volumes: VolumeNames,
    /// Its definition.
    pub xml: String,
}

/// What keeps the two provider types' domains apart.
#[derive(Clone, Copy, Debug)]
pub struct Kind {
    /// The provider type (`kvm`, `kvm2`): part of every volume name.
    pub provider_type: &'static str,
    /// The provider type's metadata namespace for the owner stamp.
    pub namespace: &'static str,
}

impl Kind {
    /// Provider type `provider_type`, stamping in `namespace`.
    pub const fn new(provider_type: &'static str, namespace: &'static str) -> Self {
        Self {
            provider_type,
            namespace,
        }
    }
}

/// How long one backend call (and the seed build) may take: `timeoutSeconds`, at least 1 s.
pub fn call_timeout(settings: &KvmSettings) -> Duration {
    Duration::from_secs(settings.timeout_seconds.max(1))
}

/// The new domain of provider instance `instance` (with `settings`, for `installation`) for
/// `request`, created at `created_at`. `existing` holds the stamps of the provider's domains
/// when [`needs_existing_stamps`] says so.
pub fn new_domain(
    settings: &KvmSettings,
    installation: &Installation,
    instance: &str,
    kind: Kind,
    request: &InstanceRequest,
    created_at: jiff::Timestamp,
    existing: Option<Vec<Result<Stamp, StampError>>>,
) -> Result<NewDomain, ProviderError> {
    let host_forward = match &settings.network {
        NetworkSettings::User {
            host_forward_address,
            host_forward_ports,
        } => Some(plan_host_forward(
            request,
            *host_forward_address,
            *host_forward_ports,
            existing.unwrap_or_default(),
        )?),
        _ => None,
    };
    let stamp = Stamp::for_request(installation, instance, request, created_at, host_forward);
    let volumes = VolumeNames::new(&request.name, kind.provider_type);
    let xml = domain_xml(&DomainPlan {
        name: &request.name,
        settings,
        stamp: &stamp,
        namespace: kind.namespace,
        volumes: &volumes,
    });
    Ok(NewDomain { stamp, volumes, xml })
}

/// The port to pair with a discovered guest address, if the address is to be discovered:
/// only when asked (`discover`), for a running domain whose stamp names no endpoint.
pub fn discovery_port(
    stamp: &Result<Stamp, StampError>,
    state: &InstanceState,
    discover: bool,
) -> Option<u16> {
    let needs_discovery = stamp.as_ref().map_or(true, |stamp| stamp.endpoint().is_none());
    (discover && needs_discovery && *state == InstanceState::Running)
        .then(|| stamp.as_ref().map_or(0, |stamp| stamp.port))
}

/// A seed that cannot be built, as a provider error: a missing tool is a configuration
/// problem, a request Squid cannot carry is the Proxy's (as on every provider, see
/// [`crate::provider::squid::SquidError`]), the rest backend failures.
pub fn seed_error(err: SeedError) -> ProviderError {
    match err {
        SeedError::ToolMissing => ProviderError::Misconfigured(err.to_string()),
        SeedError::Squid(err) => err.into(),
        other => ProviderError::Backend(other.to_string()),
    }
}
