//! The provider contract: how the operator creates, finds, deletes and lists the instances
//! (VMs, pods, processes) that run its proxies, independent of the CRD types.
//!
//! What callers rely on (see `docs/provider-contract.md`):
//! - **Deterministic names.** An instance is named by [`instance_name`] from the owner's
//!   namespace, name and UID, so a create repeated after a crash finds the instance the first
//!   attempt made instead of making a second one.
//! - **Self-contained IDs.** A [`ProviderId`] (`type/instance/native-id`) names the provider type,
//!   the provider instance and the backend's own ID: enough to find the instance again.
//! - **Truthful NotFound.** [`ProviderError::NotFound`] means the instance does not exist; any
//!   doubt (connection lost, timeout) is another error, never NotFound.
//! - **Idempotence.** `create` of an existing instance returns it; `delete` of a missing one
//!   succeeds.
//! - **Ownership persisted with the instance.** Owner UID, namespace/name, spec hash and creation
//!   time are stored where the backend keeps them (domain metadata, labels, state files), since
//!   orphan GC decides from them alone.
//! - **Installation identity persisted with the instance.** Each provider is built for one
//!   [`Installation`] (cluster identity + installation name), stamps it on every instance it
//!   creates and reports the stamped one on `get` and `list`. An instance stamped by another
//!   installation is never returned by `get`, adopted by `create` or removed by `delete`;
//!   one stamped before installations existed (a *legacy* stamp) is treated as ours until
//!   orphan GC adopts it ([`Provider::adopt`]).

pub mod kubernetes;
pub mod libvirt;
pub mod local;
pub mod locks;
pub mod memory;
mod registry;
pub mod squid;

/// The `kvm` provider type: libvirt VMs through `virsh` ([`libvirt::virsh`]).
pub mod kvm {
    pub use super::libvirt::virsh::{KvmProvider, PROVIDER_TYPE, VirshError};
}

/// The `kvm2` provider type: libvirt VMs through libvirt's API ([`libvirt::native`]).
pub mod kvm2 {
    pub use super::libvirt::native::{Kvm2Provider, PROVIDER_TYPE};
}

use std::{fmt, str::FromStr, sync::Arc};

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use crate::api::Placement;

pub use registry::{ProviderRegistry, RegistryError, UnknownProvider};

/// Prefix of every instance name: marks what this operator made.
pub const INSTANCE_NAME_PREFIX: &str = "epo";

/// The longest instance name: a DNS label, which every backend accepts as a name.
pub const MAX_INSTANCE_NAME: usize = 63;

/// The deterministic name of the instance that runs the Proxy `namespace/name` with `uid`.
///
/// Readable where it fits (`epo-crawl-web-1-3f2a9c1b`), always unique: the suffix is a hash
/// of all three parts, so truncating a long namespace or name cannot make two names collide.
pub fn instance_name(namespace: &str, name: &str, uid: &str) -> String {
    let digest = Sha256::digest(format!("{namespace}/{name}/{uid}").as_bytes());
    let suffix: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    let readable: String = format!("{namespace}-{name}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    // prefix + '-' + readable + '-' + 8 hex digits
    let room = MAX_INSTANCE_NAME - INSTANCE_NAME_PREFIX.len() - 2 - suffix.len();
    let readable = readable[..readable.len().min(room)].trim_end_matches('-');
    format!("{INSTANCE_NAME_PREFIX}-{readable}-{suffix}")
}

/// A self-contained provider ID: `type/instance/native-id`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProviderId {
    /// Provider type (`kvm`, `kvm2`, `kubernetes`, `local`, `memory`).
    pub provider_type: String,
    /// Provider instance name from the providers config.
    pub instance: String,
    /// The backend's own ID (domain name, pod name, process folder), as returned by the backend.
    pub native_id: String,
}

impl ProviderId {
    /// An ID from its three parts.
    pub fn new(provider_type: &str, instance: &str, native_id: &str) -> Self {
        Self {
            provider_type: provider_type.to_owned(),
            instance: instance.to_owned(),
            native_id: native_id.to_owned(),
        }
    }
}

impl fmt::Display for ProviderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.provider_type, self.instance, self.native_id)
    }
}

/// A provider ID string that is not `type/instance/native-id`.
#[derive(Debug, thiserror::Error)]
#[error("malformed provider ID {0:?}: expected type/instance/native-id")]
pub struct MalformedProviderId(String);

impl FromStr for ProviderId {
    type Err = MalformedProviderId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // The native ID may itself contain '/', so split at most twice.
        let mut parts = s.splitn(3, '/');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(t), Some(i), Some(n)) if !t.is_empty() && !i.is_empty() && !n.is_empty() => {
                Ok(Self::new(t, i, n))
            }
            _ => Err(MalformedProviderId(s.to_owned())),
        }
    }
}

/// The Proxy an instance belongs to, persisted with the instance.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Owner {
    /// `metadata.uid` of the Proxy: what orphan GC matches against live Proxies.
    pub uid: String,
    /// The Proxy's namespace.
    pub namespace: String,
    /// The Proxy's name.
    pub name: String,
}

/// Which operator installation made an instance: the cluster it serves and its name there.
///
/// Two installations that share a backend (two clusters on one libvirt host, two operators in
/// one cluster) tell their instances apart by it, so neither collects nor adopts the other's.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Installation {
    /// The cluster's identity: the `kube-system` namespace UID in cluster mode, the ID
    /// generated once into the state folder in standalone mode.
    pub cluster_id: String,
    /// The installation's name in that cluster (`--installation-name`).
    pub name: String,
}

impl Installation {
    /// The installation `name` of cluster `cluster_id`.
    pub fn new(cluster_id: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            cluster_id: cluster_id.into(),
            name: name.into(),
        }
    }

    /// How an instance whose stamp carries `stamped` relates to this installation.
    pub fn claim(&self, stamped: Option<&Installation>) -> Claim {
        match stamped {
            None => Claim::Legacy,
            Some(stamped) if stamped == self => Claim::Ours,
            Some(_) => Claim::Foreign,
        }
    }

    /// Whether an instance stamped with `stamped` is another installation's.
    pub fn is_foreign(&self, stamped: Option<&Installation>) -> bool {
        self.claim(stamped) == Claim::Foreign
    }

    /// For `create` and `adopt` of instance `name` stamped with `stamped`: the error if
    /// another installation made it.
    pub fn refuse_foreign(&self, name: &str, stamped: Option<&Installation>) -> Result<(), ProviderError> {
        match stamped {
            Some(other) if other != self => Err(ProviderError::Misconfigured(format!(
                "instance {name} belongs to installation {other}, not to this one ({self}); it is \
                 neither adopted nor deleted"
            ))),
            _ => Ok(()),
        }
    }
}

impl Default for Installation {
    /// The identity of providers built without one (tests, tools): every such provider
    /// counts as the same installation, as before installations existed. Both modes build
    /// their providers with a real identity.
    fn default() -> Self {
        Self::new("unidentified", "egress-proxies-operator")
    }
}

impl fmt::Display for Installation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.cluster_id)
    }
}

/// How an instance relates to the installation that looks at it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Stamped with this installation.
    Ours,
    /// Stamped before installations were recorded: treated as ours by `get`, `create` and
    /// `delete`; adopted (restamped) by orphan GC once its owner is live here.
    Legacy,
    /// Stamped by another installation: never returned, adopted, collected or deleted.
    Foreign,
}

/// Proxy credentials (HTTP basic auth). `Debug` is redacted: they must never reach a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// User name crawlers send.
    pub username: String,
    /// Password crawlers send.
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Credentials(<redacted>)")
    }
}

/// Cloud-init user-data resolved from the Proxy's Secret. `Debug` is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct UserData(pub String);

impl fmt::Debug for UserData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UserData(<{} bytes redacted>)", self.0.len())
    }
}

/// Everything a provider needs to create the instance for one Proxy.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceRequest {
    /// Deterministic instance name ([`instance_name`]); the key of idempotent create.
    pub name: String,
    /// The owning Proxy.
    pub owner: Owner,
    /// Spec hash of what this instance runs, persisted with it.
    pub spec_hash: String,
    /// Placement hints.
    pub placement: Placement,
    /// Port the proxy listens on.
    pub port: u16,
    /// Cloud-init user-data, for VM providers.
    pub user_data: Option<UserData>,
    /// Credentials the proxy requires, if any.
    pub credentials: Option<Credentials>,
}

/// Where crawlers reach a proxy.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// An `Endpoint` as [`Display`](fmt::Display) writes it (`host:port`, `[v6]:port`), read back.
impl std::str::FromStr for Endpoint {
    type Err = EndpointParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || EndpointParseError(text.to_owned());
        let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
        let host = match host.strip_prefix('[') {
            Some(bracketed) => bracketed.strip_suffix(']').ok_or_else(bad)?,
            None => host,
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Endpoint {
            host: host.to_owned(),
            port: port.parse().map_err(|_| bad())?,
        })
    }
}

/// Text that is not `host:port` or `[v6]:port` with a port in 0..=65535.
#[derive(Debug, thiserror::Error)]
#[error("endpoint {0:?} is not host:port or [v6]:port")]
pub struct EndpointParseError(String);

/// What the backend says the instance is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceState {
    /// Created but not yet running (booting, pulling, starting).
    Starting,
    /// Running; whether it serves traffic is for the health check to tell.
    Running,
    /// Exists but is not running (shut off, crashed, exited).
    Stopped,
}

/// One instance as the backend reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Instance {
    /// Self-contained ID.
    pub id: ProviderId,
    /// Owner persisted with the instance; `None` if the backend copy is missing or unreadable
    /// (GC never touches such an instance).
    pub owner: Option<Owner>,
    /// Installation persisted with the instance; `None` for a legacy stamp (made before
    /// installations were recorded) or an unreadable one.
    pub installation: Option<Installation>,
    /// Spec hash persisted with the instance.
    pub spec_hash: Option<String>,
    /// When the instance was created, as persisted with it.
    pub created_at: jiff::Timestamp,
    /// Backend state.
    pub state: InstanceState,
    /// Where to reach it, once known.
    pub endpoint: Option<Endpoint>,
}

/// The result of a provider's own health probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    /// Instances this provider owns, as listed during the probe.
    pub instance_count: usize,
    /// Human-readable detail (backend version, host).
    pub detail: String,
}

/// Why a provider call failed. The variant is the category used in metrics and conditions.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The instance does not exist (and certainly so).
    #[error("instance {0} not found")]
    NotFound(String),
    /// The backend cannot be reached or is not answering; retry later.
    #[error("provider unavailable: {0}")]
    Unavailable(String),
    /// The request cannot succeed until someone changes configuration or the Proxy (a missing
    /// base image or pool, a Squid config that does not parse); retrying won't help.
    #[error("provider misconfigured: {0}")]
    Misconfigured(String),
    /// This Proxy's request cannot be met as it stands (its port is taken, its placement names
    /// an address the host does not have): the Proxy's problem, not the provider's.
    #[error("request rejected: {0}")]
    Rejected(String),
    /// Any other backend failure; retry with backoff.
    #[error("provider error: {0}")]
    Backend(String),
}

impl ProviderError {
    /// A bounded label for metrics and condition reasons.
    pub fn category(&self) -> &'static str {
        match self {
            Self::NotFound(_) => "NotFound",
            Self::Unavailable(_) => "ProviderUnavailable",
            Self::Misconfigured(_) => "ProviderMisconfigured",
            Self::Rejected(_) => "RequestRejected",
            Self::Backend(_) => "ProviderError",
        }
    }

    /// Whether waiting and retrying can help.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Backend(_))
    }
}

/// A provider instance: one configured backend the operator provisions proxies through.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Provider type (`kvm2`, ...).
    fn provider_type(&self) -> &'static str;

    /// Instance name from the providers config.
    fn instance(&self) -> &str;

    /// The installation this provider stamps on what it creates.
    fn installation(&self) -> &Installation;

    /// Creates the instance for `request`, or returns the existing one of that name
    /// (idempotent). Returning does not mean running: poll [`Provider::get`]. An existing
    /// instance of that name stamped by another installation is an error
    /// ([`Installation::refuse_foreign`]), never returned.
    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError>;

    /// The instance named `name` ([`instance_name`]); `NotFound` only if it truly is gone or
    /// belongs to another installation (for this one it does not exist).
    async fn get(&self, name: &str) -> Result<Instance, ProviderError>;

    /// Deletes the instance named `name` and everything made for it (volumes, seeds, configs).
    /// Deleting a missing instance succeeds; one of another installation is left alone (and
    /// the call succeeds: for this installation there is nothing to delete).
    async fn delete(&self, name: &str) -> Result<(), ProviderError>;

    /// Every instance of this provider type and instance's marks, with their owners and
    /// stamped installations, another installation's included (GC counts those and leaves
    /// them alone).
    async fn list(&self) -> Result<Vec<Instance>, ProviderError>;

    /// Adopts the legacy-stamped instance `name`: restamps it with this installation, once.
    /// An instance already ours is returned unchanged; one of another installation is an
    /// error ([`Installation::refuse_foreign`]).
    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError>;

    /// Checks that the backend answers (connect and list), for `ProviderHealth`.
    async fn probe(&self) -> Result<ProbeReport, ProviderError>;

    /// Whether [`Provider::update_credentials`] can change a running instance's credentials
    /// (the engine asks before it plans: if not, a credentials change replaces the instance).
    fn updates_credentials_in_place(&self) -> bool {
        false
    }

    /// Gives the running instance `name` new proxy credentials in place, if the backend can:
    /// afterwards the instance accepts `credentials` and no longer the old ones; open connections
    /// and leases are untouched. [`CredentialsUpdate::Unsupported`] (the default) means only a
    /// new instance can carry them: the engine replaces it within the pool's budget.
    async fn update_credentials(
        &self,
        _name: &str,
        _credentials: Option<&Credentials>,
    ) -> Result<CredentialsUpdate, ProviderError> {
        Ok(CredentialsUpdate::Unsupported)
    }

    /// Whether the running instance `name` accepts exactly `credentials` (`None`: it asks for
    /// none). Asked when this process does not know what the instance was given (after a
    /// restart), so that only credentials changed meanwhile are given in place (or, where
    /// [`Provider::update_credentials`] cannot, make a new instance), and said only then.
    /// [`CredentialsCheck::CannotTell`] (the default): a provider that updates in place gives
    /// them again, once; for one that cannot the instance is assumed to run them.
    async fn check_credentials(
        &self,
        _name: &str,
        _credentials: Option<&Credentials>,
    ) -> Result<CredentialsCheck, ProviderError> {
        Ok(CredentialsCheck::CannotTell)
    }

    /// What this provider's own process supervision has done for the instance named `name`
    /// (restarts of a dead process); `None` for backends without one (the default).
    fn supervision_of(&self, _name: &str) -> Option<local::SupervisionStatus> {
        None
    }

    /// The ID the instance named `name` has (or would have) on this provider.
    fn id_for(&self, name: &str) -> ProviderId {
        ProviderId::new(self.provider_type(), self.instance(), name)
    }
}

/// What [`Provider::update_credentials`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CredentialsUpdate {
    /// The running instance accepts the new credentials now.
    Applied,
    /// The backend cannot change a running instance's credentials (or whether it requires any):
    /// only a new instance can carry them.
    Unsupported,
}

/// What [`Provider::check_credentials`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CredentialsCheck {
    /// The running instance accepts exactly these credentials (or none, and asks for none).
    Accepts,
    /// It runs other credentials, or requires some where none are wanted (or the reverse).
    Differs,
    /// The backend cannot tell.
    CannotTell,
}

/// A shared provider handle.
pub type SharedProvider = Arc<dyn Provider>;

#[cfg(test)]
mod tests;

/// What the providers' unit tests share: the request of one Proxy, and the check that a user
/// name Squid cannot carry is refused for good, by the rule, and without the password.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::{Credentials, Instance, InstanceRequest, Owner, ProviderError};
    use crate::{api::Placement, provider::squid::USER_NAME_RULE};

    /// The request for `crawl/web-1`'s instance, with these credentials.
    pub(crate) fn request(credentials: Option<Credentials>) -> InstanceRequest {
        InstanceRequest {
            name: "epo-crawl-web-1-0a1b2c3d".into(),
            owner: Owner {
                uid: "uid".into(),
                namespace: "crawl".into(),
                name: "web-1".into(),
            },
            spec_hash: "hash".into(),
            placement: Placement::default(),
            port: 3128,
            user_data: None,
            credentials,
        }
    }

    /// A request with the user name `username` and a password no message may contain.
    pub(crate) fn request_with_user(username: &str) -> InstanceRequest {
        request(Some(Credentials {
            username: username.into(),
            password: "canary-secret".into(),
        }))
    }

    /// `outcome` of a create for [`request_with_user`] refuses the user name: `Rejected` (the
    /// Proxy's credentials are at fault: not retried until they change), stating the rule, and
    /// naming no part of the password. `what` says which case failed.
    pub(crate) fn assert_user_name_refused(outcome: Result<Instance, ProviderError>, what: &str) {
        match outcome {
            Err(err @ ProviderError::Rejected(_)) => {
                let message = err.to_string();
                assert!(message.contains(USER_NAME_RULE), "{what}: {message}");
                assert!(!message.contains("canary"), "{what}: {message}");
                assert!(!err.is_transient());
            }
            other => panic!("{what}: expected Rejected, got {other:?}"),
        }
    }
}
