//! Per-type provider settings. Each type's struct denies unknown fields so a typo is an error,
//! not a silently ignored setting.

use std::path::PathBuf;

use serde::Deserialize;

/// Settings of one instance; the variant is its provider type.
#[derive(Clone, Debug, PartialEq)]
pub enum ProviderSettings {
    /// libvirt through the `virsh` and `qemu-img` command line.
    Kvm(KvmSettings),
    /// libvirt through its API (the `virt` crate).
    Kvm2(KvmSettings),
    /// Squid pods in a Kubernetes namespace.
    Kubernetes(KubernetesSettings),
    /// Squid processes on this host.
    Local(LocalSettings),
    /// Benchmarks only (the `bench-provider` cargo feature, off in every shipped build): the
    /// in-memory provider, whose instances are map entries at `placement.address:port`, so a
    /// benchmark can run the real binary over 10k proxies without 10k processes.
    #[cfg(feature = "bench-provider")]
    BenchMemory,
}

impl ProviderSettings {
    /// Parses `settings` for the provider type `type_name`; the error names the field.
    pub(super) fn parse(type_name: &str, settings: Option<serde_norway::Value>) -> Result<Self, String> {
        let settings = settings.unwrap_or(serde_norway::Value::Mapping(Default::default()));
        match type_name {
            "kvm" => typed(settings).map(Self::Kvm),
            "kvm2" => typed(settings).map(Self::Kvm2),
            "kubernetes" => typed(settings).map(Self::Kubernetes),
            "local" => typed(settings).map(Self::Local),
            #[cfg(feature = "bench-provider")]
            "bench-memory" => Ok(Self::BenchMemory),
            other => Err(format!(
                "unknown type {other:?}; known types are {}",
                super::PROVIDER_TYPES.join(", ")
            )),
        }
    }

    /// The provider type's name.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::Kvm(_) => "kvm",
            Self::Kvm2(_) => "kvm2",
            Self::Kubernetes(_) => "kubernetes",
            Self::Local(_) => "local",
            #[cfg(feature = "bench-provider")]
            Self::BenchMemory => "bench-memory",
        }
    }
}

fn typed<T: for<'de> Deserialize<'de>>(settings: serde_norway::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(settings).map_err(|err| {
        let path = err.path().to_string();
        if path == "." {
            format!("settings: {}", err.inner())
        } else {
            format!("settings.{path}: {}", err.inner())
        }
    })
}

/// Settings shared by `kvm` and `kvm2`, the two libvirt providers.
///
/// Paths (`boot.kernel`, `boot.initrd`) are paths on the libvirt host, which is not this host
/// when `uri` is remote.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "`kvm`/`kvm2` settings: a map (see docs/providers-existing.md)"
)]
pub struct KvmSettings {
    /// libvirt connection URI, local (`qemu:///system`) or remote (`qemu+ssh://host/system`).
    pub uri: String,
    /// Storage pool holding the base image and the per-proxy volumes (disk overlay, seed).
    pub pool: String,
    /// Volume in `pool` each proxy's disk is a copy-on-write qcow2 overlay of. Its format (qcow2,
    /// raw) is read from the pool.
    pub base_image: String,
    /// How the proxy's NIC reaches the world and how the operator reaches the proxy.
    #[serde(default)]
    pub network: NetworkSettings,
    /// How the guest boots.
    #[serde(default)]
    pub boot: BootSettings,
    /// Guest memory in MiB.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Guest virtual CPUs.
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// libvirt domain type: `kvm`, or `qemu` (software emulation, TCG) where KVM is unavailable.
    #[serde(default)]
    pub domain_type: DomainType,
    /// Longest one libvirt operation (a `virsh` command, an API call) may take before the
    /// provider gives up with `Unavailable`.
    #[serde(default = "default_timeout_seconds")]
    pub timeout_seconds: u64,
    /// Folder on the libvirt host where each guest's serial console (kernel, init and
    /// cloud-init messages) is logged, as `<domain name>.console.log`: what tells why a guest
    /// never became healthy. The libvirt daemon's QEMU user must be able to write there. Each
    /// boot of a Proxy's instance (they share the name) appends, so a replacement after a
    /// failed boot keeps the failure's messages; deleting the instance leaves the file (a
    /// post-mortem aid: rotate or prune the folder on the host). Unset: the console is a pty
    /// only.
    #[serde(default)]
    pub console_log_dir: Option<PathBuf>,
}

impl KvmSettings {
    /// Where the serial console of domain `name` is logged, if `console_log_dir` is set.
    pub fn console_log_path(&self, name: &str) -> Option<PathBuf> {
        self.console_log_dir
            .as_ref()
            .map(|dir| dir.join(format!("{name}.console.log")))
    }
}

/// The NIC of a libvirt provider's guests.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(
    tag = "mode",
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    deny_unknown_fields,
    expecting = "a network such as {mode: libvirt, name: default}, {mode: bridge, name: br0} or {mode: user}"
)]
pub enum NetworkSettings {
    /// Join a libvirt network; the address comes from its DHCP leases or the guest agent.
    Libvirt {
        /// The libvirt network's name.
        #[serde(default = "default_network_name")]
        name: String,
    },
    /// Join a host bridge; the address comes from the guest agent (or `placement.address`).
    Bridge {
        /// The host bridge's name (`br0`).
        name: String,
    },
    /// QEMU user-mode networking (no bridge, no root), with the proxy port forwarded from
    /// `hostForwardAddress:<port from hostForwardPorts>` on the libvirt host. For single-host
    /// setups and tests; the endpoint is the forward.
    User {
        /// Host address the forward listens on (`placement.address` overrides it). IPv4:
        /// QEMU's user-mode forwards are IPv4 only.
        #[serde(default = "default_host_forward_address")]
        host_forward_address: std::net::Ipv4Addr,
        /// Host ports to choose forwards from (each proxy takes one that is free).
        #[serde(default)]
        host_forward_ports: PortRange,
    },
}

impl Default for NetworkSettings {
    fn default() -> Self {
        Self::Libvirt {
            name: default_network_name(),
        }
    }
}

/// An inclusive range of TCP ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawPortRange")]
pub struct PortRange {
    /// First port of the range.
    pub first: u16,
    /// Last port of the range (inclusive).
    pub last: u16,
}

impl Default for PortRange {
    /// Below Linux's usual ephemeral range (32768-60999), so a forward never collides with an
    /// outgoing connection's port.
    fn default() -> Self {
        Self {
            first: 20000,
            last: 20999,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPortRange {
    first: u16,
    last: u16,
}

impl TryFrom<RawPortRange> for PortRange {
    type Error = String;

    fn try_from(raw: RawPortRange) -> Result<Self, Self::Error> {
        if raw.first == 0 || raw.first > raw.last {
            Err(format!(
                "port range {}-{} is empty or starts at 0; expected 1 <= first <= last",
                raw.first, raw.last
            ))
        } else {
            Ok(Self {
                first: raw.first,
                last: raw.last,
            })
        }
    }
}

/// How a libvirt provider's guests boot.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(
    tag = "mode",
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    deny_unknown_fields,
    expecting = "a boot mode such as {mode: disk} or {mode: kernel, kernel: PATH, initrd: PATH}"
)]
pub enum BootSettings {
    /// The base image is bootable (it has a boot loader). A struct variant, so a stray field
    /// next to `mode: disk` is an error rather than ignored.
    Disk {},
    /// Direct kernel boot: QEMU loads the kernel (and initrd) from the libvirt host, and the
    /// base image holds only the root file system.
    Kernel {
        /// Kernel image path on the libvirt host.
        kernel: PathBuf,
        /// Initial ramdisk path on the libvirt host, if the kernel needs one.
        #[serde(default)]
        initrd: Option<PathBuf>,
        /// Kernel command line.
        #[serde(default = "default_kernel_cmdline")]
        cmdline: String,
    },
}

impl Default for BootSettings {
    fn default() -> Self {
        Self::Disk {}
    }
}

/// libvirt domain type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DomainType {
    /// Hardware virtualisation through `/dev/kvm`.
    #[default]
    Kvm,
    /// Software emulation (QEMU TCG): slow, but works where KVM does not.
    Qemu,
}

impl DomainType {
    /// The value of `<domain type=...>`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Qemu => "qemu",
        }
    }
}

fn default_network_name() -> String {
    "default".to_owned()
}
fn default_host_forward_address() -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::LOCALHOST
}
fn default_kernel_cmdline() -> String {
    "root=/dev/vda console=ttyS0".to_owned()
}
fn default_memory_mib() -> u32 {
    512
}
fn default_vcpus() -> u32 {
    1
}
fn default_timeout_seconds() -> u64 {
    60
}

/// Settings of the `kubernetes` provider.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "`kubernetes` settings: a map (see docs/providers-existing.md)"
)]
pub struct KubernetesSettings {
    /// Namespace the Squid pods, ConfigMaps and Services are created in.
    pub namespace: String,
    /// Squid container image.
    pub image: String,
    /// How the Service exposes each proxy.
    #[serde(default)]
    pub service_type: ServiceType,
    /// Host crawlers reach NodePort Services on (a node's address, or a name that resolves to
    /// the nodes); required with `serviceType: NodePort`, unused otherwise.
    #[serde(default)]
    pub node_address: Option<String>,
    /// Longest one API request may take before the provider gives up with `Unavailable`.
    #[serde(default = "default_kubernetes_timeout_seconds")]
    pub timeout_seconds: u64,
}

fn default_kubernetes_timeout_seconds() -> u64 {
    10
}

/// Kubernetes Service type for the `kubernetes` provider's proxies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum ServiceType {
    /// Reachable inside the cluster only.
    #[default]
    ClusterIP,
    /// Reachable on every node's address.
    NodePort,
    /// Reachable through a cloud load balancer.
    LoadBalancer,
}

/// Settings of the `local` provider.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "`local` settings: a map (see docs/providers-existing.md)"
)]
pub struct LocalSettings {
    /// Folder holding each proxy's Squid config, logs, pid file and owner record; a relative
    /// path is resolved against the working directory. One operator process and one provider
    /// instance own it.
    pub state_dir: PathBuf,
    /// The Squid binary.
    #[serde(default = "default_squid_path")]
    pub squid_path: PathBuf,
    /// Address proxies listen on when their placement names none.
    #[serde(default = "default_bind_address")]
    pub bind_address: String,
    /// Address reported to crawlers instead of the listen address (for example the host's
    /// routable address when proxies listen on `0.0.0.0`).
    #[serde(default)]
    pub advertise_address: Option<String>,
    /// Squid's basic-auth helper, used for Proxies with credentials; it must read an
    /// htpasswd-style file with SHA-512-crypt hashes.
    #[serde(default = "default_auth_helper_path")]
    pub auth_helper_path: PathBuf,
    /// User Squid drops to when the operator runs as root; it owns each proxy's log folder.
    #[serde(default = "default_squid_user")]
    pub squid_user: String,
    /// Whether Squid writes an access log per proxy (rotation is left to the host).
    #[serde(default = "default_access_log")]
    pub access_log: bool,
    /// Squid directives appended to every generated config (one directive per entry).
    #[serde(default)]
    pub extra_config: Vec<String>,
    /// How long `create` waits for a new Squid to accept connections before it returns the
    /// instance as starting.
    #[serde(default = "default_start_timeout_seconds")]
    pub start_timeout_seconds: u32,
    /// How long `delete` waits after SIGTERM before it sends SIGKILL.
    #[serde(default = "default_stop_timeout_seconds")]
    pub stop_timeout_seconds: u32,
}

fn default_squid_path() -> PathBuf {
    PathBuf::from("/usr/sbin/squid")
}
fn default_bind_address() -> String {
    "127.0.0.1".to_owned()
}
fn default_auth_helper_path() -> PathBuf {
    PathBuf::from("/usr/lib/squid/basic_ncsa_auth")
}
fn default_squid_user() -> String {
    "proxy".to_owned()
}
fn default_access_log() -> bool {
    true
}
fn default_start_timeout_seconds() -> u32 {
    10
}
fn default_stop_timeout_seconds() -> u32 {
    5
}

impl LocalSettings {
    /// Settings with every default, for the state folder `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            squid_path: default_squid_path(),
            bind_address: default_bind_address(),
            advertise_address: None,
            auth_helper_path: default_auth_helper_path(),
            squid_user: default_squid_user(),
            access_log: default_access_log(),
            extra_config: Vec::new(),
            start_timeout_seconds: default_start_timeout_seconds(),
            stop_timeout_seconds: default_stop_timeout_seconds(),
        }
    }
}
