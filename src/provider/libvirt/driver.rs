//! The provisioning algorithm of the libvirt providers, once: [`LibvirtProvider`] over an
//! [`Access`] path (`virsh` for `kvm`, the `virt` crate for `kvm2`).
//!
//! The driver owns every decision: the order of the steps, what a lookup means, what `create`
//! takes over and what it makes, what `delete` leaves alone, what is cleaned up when a step
//! fails, and the provider errors users read about pools, base images and networks. An access
//! path owns only the backend calls ([`Session`]) and how a failed call is classified; it must
//! not decide anything the two types would then do differently.
//!
//! Each operation runs as one blocking task with its own [`Session`] (libvirt's API blocks; the
//! `virsh` path waits on its children from there). A task that changes a domain owns the name
//! lock, so the lock is held until the work ends, even when the caller stopped waiting for it
//! (after [`Access::operation_timeout`]).

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;

use super::{
    BaseVolume, Kind, Lookup, NewDomain, Stamp, StampError, VolumeNames, adoption_stamp, call_timeout,
    check_create_name, delete_removes, discovery_port, foreign_domain, instance_from_stamp, is_foreign,
    needs_existing_stamps, new_domain, overlay_volume_xml, seed::Seed, seed_error, seed_volume_xml,
};
use crate::{
    config::{KvmSettings, NetworkSettings, is_dns_label},
    provider::{
        Endpoint, Installation, Instance, InstanceRequest, InstanceState, ProbeReport, Provider,
        ProviderError, ProviderId,
        locks::{NameGuard, NameLocks},
    },
};

/// A domain the provider type made, as [`Session::stamped`] finds it: its handle, its name and
/// its stamp.
pub struct Stamped<D> {
    /// The access path's handle to the domain.
    pub domain: D,
    /// The domain's name.
    pub name: String,
    /// Its owner stamp (perhaps damaged).
    pub stamp: Result<Stamp, StampError>,
}

/// One way of reaching libvirt: what a provider type is made of besides the algorithm.
/// A volume to create: named fields, so the name and the XML (both text) cannot swap places.
pub struct NewVolume<'a> {
    pub name: &'a str,
    /// libvirt's volume XML.
    pub xml: &'a str,
    /// Uploaded into the new volume, if any.
    pub content: Option<&'a [u8]>,
}

pub trait Access: Send + Sync + 'static {
    /// The provider type's name and stamp namespace.
    const KIND: Kind;
    /// The backend calls of one operation.
    type Session: Session;

    /// Opens the session of one operation (on its blocking thread).
    fn open(&self, settings: &KvmSettings) -> Result<Self::Session, ProviderError>;

    /// How long the caller waits for a whole operation before it gets `Unavailable`; `None`
    /// where each backend call keeps its own timeout.
    fn operation_timeout(&self, settings: &KvmSettings) -> Option<Duration>;
}

/// The backend calls of one operation. Every call classifies its own failures (connection
/// trouble is `Unavailable`, the rest `Backend`); "missing" answers are values, not errors.
pub trait Session {
    /// The handle to a domain (`()` where the name is the handle).
    type Domain;
    /// The handle to the storage pool.
    type Pool;

    /// The domain of `name` with the provider type's stamp, if any.
    fn lookup(&self, name: &str) -> Result<Lookup<Self::Domain>, ProviderError>;
    /// Whether domain `name` certainly does not exist.
    fn vanished(&self, name: &str) -> Result<bool, ProviderError>;
    /// Every domain carrying the provider type's stamp.
    fn stamped(&self) -> Result<Vec<Stamped<Self::Domain>>, ProviderError>;
    /// The domain's state.
    fn state(&self, domain: &Self::Domain, name: &str) -> Result<InstanceState, ProviderError>;
    /// Whether the domain is running (or paused): `create` starts it otherwise.
    fn is_active(&self, domain: &Self::Domain, name: &str) -> Result<bool, ProviderError>;
    /// The guest's address from DHCP leases, else from the guest agent.
    fn discover_address(&self, domain: &Self::Domain, name: &str) -> Option<String>;
    /// Pool `name` and whether it is active; `None` if it does not exist.
    fn pool(&self, name: &str) -> Result<Option<(Self::Pool, bool)>, ProviderError>;
    /// The XML of volume `name` in `pool`; `None` if it does not exist.
    fn volume_xml(&self, pool: &Self::Pool, name: &str) -> Result<Option<String>, ProviderError>;
    /// Whether libvirt network `name` is active; `None` if it does not exist.
    fn network_active(&self, name: &str) -> Result<Option<bool>, ProviderError>;
    /// Creates `volume` in `pool` from its XML, then uploads its content (over the libvirt
    /// connection, so a remote host needs nothing else).
    fn create_volume(&self, pool: &Self::Pool, volume: &NewVolume<'_>) -> Result<(), ProviderError>;
    /// Deletes volume `name` of `pool`; a missing one is no error.
    fn delete_volume(&self, pool: &Self::Pool, name: &str) -> Result<(), ProviderError>;
    /// Defines domain `name` from `xml`.
    fn define(&self, name: &str, xml: &str) -> Result<Self::Domain, ProviderError>;
    /// Starts the domain (context: "starting domain NAME").
    fn start(&self, domain: &Self::Domain, name: &str) -> Result<(), ProviderError>;
    /// Stops and undefines domain `name` with everything libvirt keeps for it; a missing one
    /// is no error.
    fn remove_domain(&self, name: &str) -> Result<(), ProviderError>;
    /// Replaces the stamp element of the domain's persistent definition (and the running one,
    /// when `live`).
    fn set_stamp(
        &self,
        domain: &Self::Domain,
        name: &str,
        element: &str,
        live: bool,
    ) -> Result<(), ProviderError>;
    /// Which libvirt (and hypervisor) answers, and how: for the probe's report.
    fn versions(&self) -> Result<String, ProviderError>;
}

/// What every operation of one provider instance knows.
struct Context {
    instance: String,
    installation: Installation,
    settings: KvmSettings,
}

/// A libvirt provider: the algorithm over access path `A`.
pub struct LibvirtProvider<A: Access> {
    access: Arc<A>,
    context: Arc<Context>,
    locks: NameLocks,
}

impl<A: Access> LibvirtProvider<A> {
    /// A provider instance named `instance_name` (from the providers config) with `settings`,
    /// reaching libvirt through `access`. Connects lazily: a wrong URI shows on the first call
    /// (or [`Provider::probe`]).
    pub fn with_access(instance_name: &str, settings: KvmSettings, access: A) -> Self {
        Self {
            access: Arc::new(access),
            context: Arc::new(Context {
                instance: instance_name.to_owned(),
                installation: Installation::default(),
                settings,
            }),
            locks: NameLocks::default(),
        }
    }

    /// Stamp `installation` instead of the default one.
    pub fn with_installation(self, installation: Installation) -> Self {
        let context = Context {
            instance: self.context.instance.clone(),
            installation,
            settings: self.context.settings.clone(),
        };
        Self {
            context: Arc::new(context),
            ..self
        }
    }

    /// The same provider reaching libvirt through `access` instead.
    pub(super) fn replace_access(self, access: A) -> Self {
        Self {
            access: Arc::new(access),
            ..self
        }
    }

    /// Runs `work` as a blocking task with a fresh session; `guard` (the name lock) goes with
    /// it and is released when the work ends, not when the caller stops waiting.
    async fn run<T: Send + 'static>(
        &self,
        what: &'static str,
        guard: Option<NameGuard>,
        work: impl FnOnce(&Operation<'_, A::Session>) -> Result<T, ProviderError> + Send + 'static,
    ) -> Result<T, ProviderError> {
        let access = Arc::clone(&self.access);
        let context = Arc::clone(&self.context);
        let task = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            let session = access.open(&context.settings)?;
            work(&Operation {
                session,
                context: &context,
                kind: A::KIND,
            })
        });
        let joined = match self.access.operation_timeout(&self.context.settings) {
            Some(timeout) => tokio::time::timeout(timeout, task).await.map_err(|_| {
                ProviderError::Unavailable(format!(
                    "libvirt at {} did not finish {what} within {timeout:?}",
                    self.context.settings.uri
                ))
            })?,
            None => task.await,
        };
        joined.map_err(|join| ProviderError::Backend(format!("{what} failed on its thread: {join}")))?
    }
}

#[async_trait]
impl<A: Access> Provider for LibvirtProvider<A> {
    fn provider_type(&self) -> &'static str {
        A::KIND.provider_type
    }

    fn instance(&self) -> &str {
        &self.context.instance
    }

    fn installation(&self) -> &Installation {
        &self.context.installation
    }

    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError> {
        check_create_name(&request.name)?;
        let seed = Seed::for_request(request).map_err(seed_error)?;
        let iso = seed
            .build_iso(call_timeout(&self.context.settings))
            .await
            .map_err(seed_error)?;
        let guard = self.locks.lock(&request.name).await;
        let request = request.clone();
        let created_at = jiff::Timestamp::now();
        self.run("create", Some(guard), move |op| {
            op.create(&request, &iso, created_at)
        })
        .await
    }

    async fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let name = name.to_owned();
        self.run("get", None, move |op| op.get(&name)).await
    }

    async fn delete(&self, name: &str) -> Result<(), ProviderError> {
        if !is_dns_label(name) {
            return Ok(());
        }
        let guard = self.locks.lock(name).await;
        let name = name.to_owned();
        self.run("delete", Some(guard), move |op| op.delete(&name)).await
    }

    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        if !is_dns_label(name) {
            return Err(ProviderError::NotFound(name.to_owned()));
        }
        let guard = self.locks.lock(name).await;
        let name = name.to_owned();
        self.run("adopt", Some(guard), move |op| op.adopt(&name)).await
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        self.run("list", None, |op| op.list()).await
    }

    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        self.run("probe", None, |op| op.probe()).await
    }
}

/// One operation: its session and what the provider instance knows.
struct Operation<'a, S> {
    session: S,
    context: &'a Context,
    kind: Kind,
}

impl<S: Session> Operation<'_, S> {
    fn settings(&self) -> &KvmSettings {
        &self.context.settings
    }

    fn id(&self, name: &str) -> ProviderId {
        ProviderId::new(self.kind.provider_type, &self.context.instance, name)
    }

    fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        let not_found = || ProviderError::NotFound(name.to_owned());
        match self.session.lookup(name)? {
            Lookup::Ours(_, stamp) if is_foreign(&self.context.installation, &stamp) => Err(not_found()),
            Lookup::Ours(domain, stamp) => match self.describe(&domain, name, *stamp, true) {
                // Deleted between the lookup and the description.
                Err(_) if self.session.vanished(name)? => Err(not_found()),
                described => described,
            },
            Lookup::Missing | Lookup::Foreign => Err(not_found()),
        }
    }

    fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        let mut instances = Vec::new();
        for Stamped { domain, name, stamp } in self.session.stamped()? {
            match self.describe(&domain, &name, stamp, false) {
                Ok(instance) => instances.push(instance),
                // Deleted while we listed.
                Err(_) if self.session.vanished(&name)? => {}
                Err(err) => return Err(err),
            }
        }
        Ok(instances)
    }

    fn describe(
        &self,
        domain: &S::Domain,
        name: &str,
        stamp: Result<Stamp, StampError>,
        discover: bool,
    ) -> Result<Instance, ProviderError> {
        let state = self.session.state(domain, name)?;
        let discovered = discovery_port(&stamp, &state, discover).and_then(|port| {
            self.session
                .discover_address(domain, name)
                .map(|host| Endpoint { host, port })
        });
        Ok(instance_from_stamp(self.id(name), stamp, state, discovered))
    }

    fn create(
        &self,
        request: &InstanceRequest,
        iso: &[u8],
        created_at: jiff::Timestamp,
    ) -> Result<Instance, ProviderError> {
        let name = &request.name;
        match self.session.lookup(name)? {
            Lookup::Ours(domain, stamp) => {
                if let Ok(stamp) = &*stamp {
                    self.context
                        .installation
                        .refuse_foreign(name, stamp.installation.as_ref())?;
                }
                // Made by an earlier attempt (perhaps one that crashed before starting it).
                if !self.session.is_active(&domain, name)? {
                    self.session.start(&domain, name)?;
                }
                return self.describe(&domain, name, *stamp, true);
            }
            Lookup::Foreign => return Err(foreign_domain(name, self.kind.namespace)),
            Lookup::Missing => {}
        }
        let pool = self.pool()?;
        let base = self.base_volume(&pool)?;
        self.check_network()?;
        let existing = if needs_existing_stamps(self.settings()) {
            Some(
                self.session
                    .stamped()?
                    .into_iter()
                    .map(|stamped| stamped.stamp)
                    .collect(),
            )
        } else {
            None
        };
        let NewDomain { stamp, volumes, xml } = new_domain(
            self.settings(),
            &self.context.installation,
            &self.context.instance,
            self.kind,
            request,
            created_at,
            existing,
        )?;
        // No domain of this name exists, so volumes of its names are left from an interrupted
        // attempt and unused: start afresh.
        self.delete_volumes(&pool, &volumes)?;
        let domain = self.make_domain(&pool, &base, &volumes, iso, &xml, name)?;
        self.describe(&domain, name, Ok(stamp), true)
    }

    /// Makes the volumes, defines and starts the domain. Whatever fails, what this call made
    /// is removed before the error returns, so nothing leaks.
    fn make_domain(
        &self,
        pool: &S::Pool,
        base: &BaseVolume,
        volumes: &VolumeNames,
        iso: &[u8],
        xml: &str,
        name: &str,
    ) -> Result<S::Domain, ProviderError> {
        let cleanup_volumes = |err: ProviderError| {
            if let Err(cleanup) = self.delete_volumes(pool, volumes) {
                tracing::warn!(instance = name, error = %cleanup, "deleting volumes after a failed create");
            }
            err
        };
        let disk = overlay_volume_xml(&volumes.disk, base);
        let seed = seed_volume_xml(&volumes.seed, iso.len() as u64);
        let disk = NewVolume {
            name: &volumes.disk,
            xml: &disk,
            content: None,
        };
        let seed = NewVolume {
            name: &volumes.seed,
            xml: &seed,
            content: Some(iso),
        };
        self.session
            .create_volume(pool, &disk)
            .and_then(|()| self.session.create_volume(pool, &seed))
            .map_err(cleanup_volumes)?;
        let domain = match self.session.define(name, xml) {
            Ok(domain) => domain,
            // Someone else defined this name meanwhile: everything of that name is theirs now.
            Err(err) if !matches!(self.session.vanished(name), Ok(true)) => {
                return Err(ProviderError::Backend(format!(
                    "{err}; a domain of that name appeared meanwhile"
                )));
            }
            Err(err) => return Err(cleanup_volumes(err)),
        };
        if let Err(err) = self.session.start(&domain, name) {
            // A failed start leaves a defined domain: undefine it and delete its volumes.
            if let Err(cleanup) = self.remove(name, Some(pool)) {
                tracing::warn!(instance = name, error = %cleanup, "cleaning up after a failed start");
            }
            return Err(err);
        }
        Ok(domain)
    }

    fn delete(&self, name: &str) -> Result<(), ProviderError> {
        let lookup = self.session.lookup(name)?;
        if delete_removes(&lookup, &self.context.installation, name, self.kind.provider_type) {
            self.remove(name, None)
        } else {
            Ok(())
        }
    }

    /// Destroys and undefines domain `name` (if it exists) and deletes its volumes. Callers
    /// have checked that the domain, if any, is ours.
    fn remove(&self, name: &str, pool: Option<&S::Pool>) -> Result<(), ProviderError> {
        self.session.remove_domain(name)?;
        let volumes = VolumeNames::new(name, self.kind.provider_type);
        match pool {
            Some(pool) => self.delete_volumes(pool, &volumes),
            None => match self.find_pool()? {
                Some(pool) => self.delete_volumes(&pool, &volumes),
                // A pool that does not exist holds no volumes.
                None => {
                    tracing::warn!(instance = name, pool = %self.settings().pool, "delete: no such pool, so no volumes");
                    Ok(())
                }
            },
        }
    }

    fn delete_volumes(&self, pool: &S::Pool, volumes: &VolumeNames) -> Result<(), ProviderError> {
        volumes
            .all()
            .into_iter()
            .try_for_each(|volume| self.session.delete_volume(pool, volume))
    }

    /// Restamps legacy domain `name` with this installation (live and persistent definition).
    fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        let (domain, stamp) = match self.session.lookup(name)? {
            Lookup::Ours(domain, stamp) => (domain, *stamp),
            Lookup::Missing | Lookup::Foreign => return Err(ProviderError::NotFound(name.to_owned())),
        };
        let (stamp, changed) = adoption_stamp(name, stamp, &self.context.installation)?;
        if changed {
            // The running definition too, or the restamp would show only after a restart.
            let live = self.session.is_active(&domain, name)?;
            self.session.set_stamp(&domain, name, &stamp.to_element(), live)?;
        }
        self.describe(&domain, name, Ok(stamp), false)
    }

    fn probe(&self) -> Result<ProbeReport, ProviderError> {
        let versions = self.session.versions()?;
        let count = self.session.stamped()?.len();
        let pool = self.pool()?;
        self.base_volume(&pool)?;
        let settings = self.settings();
        Ok(ProbeReport {
            instance_count: count,
            detail: format!(
                "{versions}; pool {} with base image {}",
                settings.pool, settings.base_image
            ),
        })
    }

    /// The configured pool, active; `None` if it does not exist.
    fn find_pool(&self) -> Result<Option<S::Pool>, ProviderError> {
        let settings = self.settings();
        let name = &settings.pool;
        match self.session.pool(name)? {
            None => Ok(None),
            Some((pool, true)) => Ok(Some(pool)),
            Some((_, false)) => Err(ProviderError::Misconfigured(format!(
                "storage pool {name} at {} is not active (virsh pool-start {name})",
                settings.uri
            ))),
        }
    }

    /// The configured pool, active.
    fn pool(&self) -> Result<S::Pool, ProviderError> {
        self.find_pool()?.ok_or_else(|| {
            ProviderError::Misconfigured(format!(
                "storage pool {} does not exist at {}",
                self.settings().pool,
                self.settings().uri
            ))
        })
    }

    fn base_volume(&self, pool: &S::Pool) -> Result<BaseVolume, ProviderError> {
        let settings = self.settings();
        let name = &settings.base_image;
        let xml = self.session.volume_xml(pool, name)?.ok_or_else(|| {
            ProviderError::Misconfigured(format!(
                "base image {name} is not a volume of storage pool {}",
                settings.pool
            ))
        })?;
        BaseVolume::parse(&xml)
            .map_err(|err| ProviderError::Backend(format!("base image {name}'s description: {err}")))
    }

    fn check_network(&self) -> Result<(), ProviderError> {
        let settings = self.settings();
        let NetworkSettings::Libvirt { name } = &settings.network else {
            return Ok(());
        };
        match self.session.network_active(name)? {
            Some(true) => Ok(()),
            Some(false) => Err(ProviderError::Misconfigured(format!(
                "libvirt network {name} is not active (virsh net-start {name})"
            ))),
            None => Err(ProviderError::Misconfigured(format!(
                "libvirt network {name} does not exist at {}",
                settings.uri
            ))),
        }
    }
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
