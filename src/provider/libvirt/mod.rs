//! The libvirt providers: `kvm` and `kvm2` are one provisioning algorithm ([`driver`]) over
//! two access paths, [`virsh`] (the `virsh` command line, type `kvm`) and [`native`]
//! (libvirt's API through the `virt` crate, type `kvm2`).
//!
//! This file owns what the domain looks like: its definition, the owner stamp in its
//! `<metadata>`, the names of its volumes, its host forward; [`seed`] owns the cloud-init seed
//! it boots with and `steps.rs` the small decisions the driver takes. Both types describe
//! a proxy's VM the same way, so a guest image built for one boots under the other. What keeps
//! them apart is the metadata namespace each stamps its domains with ([`KVM2_NAMESPACE`],
//! [`KVM_NAMESPACE`]) and the provider type in every volume name: neither sees, adopts or
//! deletes the other's domains or volumes.

pub mod driver;
pub mod native;
pub mod seed;
mod steps;
#[cfg(test)]
mod tests;
pub mod virsh;

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener},
};

use crate::{
    config::{BootSettings, KvmSettings, NetworkSettings, PortRange},
    markup::escape,
};

pub use self::steps::{
    Kind, Lookup, NewDomain, call_timeout, check_create_name, delete_removes, discovery_port, is_foreign,
    needs_existing_stamps, new_domain, seed_error,
};

use super::{
    Endpoint, Installation, Instance, InstanceRequest, InstanceState, Owner, ProviderError, ProviderId,
};

/// Metadata namespace of the `kvm2` provider's owner stamp.
pub const KVM2_NAMESPACE: &str = "https://crawl.example.com/kvm2/v1";

/// Metadata namespace of the `kvm` provider's owner stamp.
pub const KVM_NAMESPACE: &str = "https://crawl.example.com/kvm/v1";

/// Element name of the owner stamp inside `<metadata>`.
const STAMP_ELEMENT: &str = "owner";

/// Namespace prefix the stamp is written with (libvirt keys metadata by URI, not prefix).
pub const STAMP_PREFIX: &str = "epo";

/// libvirt's namespace for `<qemu:commandline>` passthrough.
const QEMU_NAMESPACE: &str = "http://libvirt.org/schemas/domain/qemu/1.0";

/// PCI slot of the user-mode NIC: passthrough devices are invisible to libvirt's address
/// assignment, so it takes a slot far from the ones libvirt hands to disks and controllers.
const USER_NIC_PCI_SLOT: &str = "0x10";

/// The volumes made for one instance, named after the instance and the provider type so the
/// `kvm` and `kvm2` providers never touch each other's volumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeNames {
    /// The qcow2 overlay the guest boots from.
    pub disk: String,
    /// The NoCloud seed ISO.
    pub seed: String,
}

impl VolumeNames {
    /// Volume names of instance `name` made by provider type `provider_type`.
    pub fn new(name: &str, provider_type: &str) -> Self {
        Self {
            disk: format!("{name}-{provider_type}-disk.qcow2"),
            seed: format!("{name}-{provider_type}-seed.iso"),
        }
    }

    /// Both names, disk first.
    pub fn all(&self) -> [&str; 2] {
        [&self.disk, &self.seed]
    }
}

/// The owner stamp persisted in a domain's `<metadata>`: what orphan GC and `list` read.
#[derive(Clone, Debug, PartialEq)]
pub struct Stamp {
    /// The provider instance (from the providers config) that made the domain; informational.
    pub provider_instance: String,
    /// The installation that made (or adopted) the domain; `None` in a legacy stamp.
    pub installation: Option<Installation>,
    /// The owning Proxy.
    pub owner: Owner,
    /// Spec hash of what the domain runs.
    pub spec_hash: String,
    /// When the provider made the domain.
    pub created_at: jiff::Timestamp,
    /// Port Squid listens on inside the guest.
    pub port: u16,
    /// `placement.address`, if the Proxy named one.
    pub address: Option<String>,
    /// The host forward of a user-mode NIC (`127.0.0.1:20001`).
    pub host_forward: Option<Endpoint>,
}

/// A stamp that is present but unreadable.
#[derive(Debug, thiserror::Error)]
pub enum StampError {
    /// Not well-formed XML.
    #[error("owner stamp is not XML: {0}")]
    Xml(roxmltree::Error),
    /// An attribute is missing or malformed.
    #[error("owner stamp attribute {0:?} is missing or malformed")]
    Attribute(&'static str),
}

impl Stamp {
    /// The stamp for a new instance made for `request` by `provider_instance` of `installation`.
    pub fn for_request(
        installation: &Installation,
        provider_instance: &str,
        request: &InstanceRequest,
        created_at: jiff::Timestamp,
        host_forward: Option<Endpoint>,
    ) -> Self {
        Self {
            provider_instance: provider_instance.to_owned(),
            installation: Some(installation.clone()),
            owner: request.owner.clone(),
            spec_hash: request.spec_hash.clone(),
            created_at,
            port: request.port,
            address: request.placement.address.clone(),
            host_forward,
        }
    }

    /// The stamp as an element in `namespace`, for a domain's `<metadata>`.
    pub fn to_xml(&self, namespace: &str) -> String {
        format!(
            "<{STAMP_PREFIX}:{STAMP_ELEMENT} xmlns:{STAMP_PREFIX}=\"{}\"{}/>",
            escape(namespace),
            self.attributes()
        )
    }

    /// The stamp as a bare element, for `virDomainSetMetadata` (`virsh metadata --set`),
    /// which puts it into the namespace itself and refuses an element that declares one.
    pub fn to_element(&self) -> String {
        format!("<{STAMP_ELEMENT}{}/>", self.attributes())
    }

    fn attributes(&self) -> String {
        let mut xml = format!(
            " provider=\"{}\" uid=\"{}\" namespace=\"{}\" name=\"{}\" specHash=\"{}\" createdAt=\"{}\" \
             port=\"{}\"",
            escape(&self.provider_instance),
            escape(&self.owner.uid),
            escape(&self.owner.namespace),
            escape(&self.owner.name),
            escape(&self.spec_hash),
            self.created_at,
            self.port,
        );
        if let Some(installation) = &self.installation {
            let _ = write!(
                xml,
                " cluster=\"{}\" installation=\"{}\"",
                escape(&installation.cluster_id),
                escape(&installation.name)
            );
        }
        if let Some(address) = &self.address {
            let _ = write!(xml, " address=\"{}\"", escape(address));
        }
        if let Some(forward) = &self.host_forward {
            let _ = write!(xml, " hostForward=\"{}\"", escape(&forward.to_string()));
        }
        xml
    }

    /// Reads a stamp as libvirt returns it (the element, with or without its prefix).
    pub fn parse(xml: &str) -> Result<Self, StampError> {
        let document = roxmltree::Document::parse(xml).map_err(StampError::Xml)?;
        let element = document.root_element();
        let required = |name: &'static str| {
            element
                .attribute(name)
                .filter(|value| !value.is_empty())
                .ok_or(StampError::Attribute(name))
        };
        let host_forward = match element.attribute("hostForward") {
            None => None,
            Some(text) => {
                let address: SocketAddr = text.parse().map_err(|_| StampError::Attribute("hostForward"))?;
                Some(Endpoint {
                    host: address.ip().to_string(),
                    port: address.port(),
                })
            }
        };
        // Both or neither: neither is a legacy stamp, one alone a damaged one.
        let installation = match (element.attribute("cluster"), element.attribute("installation")) {
            (None, None) => None,
            (Some(cluster), Some(name)) if !cluster.is_empty() && !name.is_empty() => {
                Some(Installation::new(cluster, name))
            }
            (Some(_), _) => return Err(StampError::Attribute("installation")),
            (None, Some(_)) => return Err(StampError::Attribute("cluster")),
        };
        Ok(Self {
            provider_instance: element.attribute("provider").unwrap_or_default().to_owned(),
            installation,
            owner: Owner {
                uid: required("uid")?.to_owned(),
                namespace: required("namespace")?.to_owned(),
                name: required("name")?.to_owned(),
            },
            spec_hash: required("specHash")?.to_owned(),
            created_at: required("createdAt")?
                .parse()
                .map_err(|_| StampError::Attribute("createdAt"))?,
            port: required("port")?
                .parse()
                .map_err(|_| StampError::Attribute("port"))?,
            address: element.attribute("address").map(str::to_owned),
            host_forward,
        })
    }

    /// Where crawlers reach the proxy, if the stamp alone tells: the host forward (user mode),
    /// else `placement.address` with the proxy port.
    pub fn endpoint(&self) -> Option<Endpoint> {
        self.host_forward.clone().or_else(|| {
            self.address.as_ref().map(|host| Endpoint {
                host: host.clone(),
                port: self.port,
            })
        })
    }
}

/// The instance a domain stamped by us describes. A damaged stamp yields an instance with no
/// owner (orphan GC never touches it) and the Unix epoch as creation time.
pub fn instance_from_stamp(
    id: ProviderId,
    stamp: Result<Stamp, StampError>,
    state: InstanceState,
    discovered: Option<Endpoint>,
) -> Instance {
    match stamp {
        Ok(stamp) => Instance {
            endpoint: stamp.endpoint().or(discovered),
            id,
            owner: Some(stamp.owner),
            installation: stamp.installation,
            spec_hash: Some(stamp.spec_hash),
            created_at: stamp.created_at,
            state,
        },
        Err(err) => {
            tracing::warn!(instance = %id, error = %err, "domain carries a damaged owner stamp");
            Instance {
                id,
                owner: None,
                installation: None,
                spec_hash: None,
                created_at: jiff::Timestamp::UNIX_EPOCH,
                state,
                endpoint: discovered,
            }
        }
    }
}

/// What a base image volume's XML says about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseVolume {
    /// Path on the libvirt host, the overlay's backing store.
    pub path: String,
    /// Disk format (`qcow2`, `raw`).
    pub format: String,
    /// Virtual size in bytes, the overlay's capacity.
    pub capacity: u64,
}

impl BaseVolume {
    /// Reads `<volume>` XML (`virStorageVolGetXMLDesc`, `virsh vol-dumpxml`).
    pub fn parse(xml: &str) -> Result<Self, String> {
        let document = roxmltree::Document::parse(xml).map_err(|err| err.to_string())?;
        let root = document.root_element();
        fn child<'a, 'input>(
            parent: roxmltree::Node<'a, 'input>,
            name: &str,
        ) -> Option<roxmltree::Node<'a, 'input>> {
            parent.children().find(|node| node.has_tag_name(name))
        }
        let target = child(root, "target").ok_or("volume XML has no <target>")?;
        let path = child(target, "path")
            .and_then(|node| node.text())
            .ok_or("volume XML has no <target><path>")?;
        let format = child(target, "format")
            .and_then(|node| node.attribute("type"))
            .unwrap_or("raw");
        let capacity = child(root, "capacity").ok_or("volume XML has no <capacity>")?;
        let unit = capacity.attribute("unit").unwrap_or("bytes");
        let amount: u64 = capacity
            .text()
            .and_then(|text| text.trim().parse().ok())
            .ok_or("volume XML has an unreadable <capacity>")?;
        let multiplier = match unit {
            "b" | "bytes" => 1,
            "KiB" | "k" | "K" => 1 << 10,
            "MiB" | "M" => 1 << 20,
            "GiB" | "G" => 1 << 30,
            other => return Err(format!("volume XML capacity unit {other:?} is not understood")),
        };
        Ok(Self {
            path: path.trim().to_owned(),
            format: format.to_owned(),
            capacity: amount * multiplier,
        })
    }
}

/// `<volume>` XML of an instance's disk: a qcow2 overlay on `base`.
pub fn overlay_volume_xml(name: &str, base: &BaseVolume) -> String {
    format!(
        "<volume><name>{}</name><capacity unit='bytes'>{}</capacity>\
         <target><format type='qcow2'/></target>\
         <backingStore><path>{}</path><format type='{}'/></backingStore></volume>",
        escape(name),
        base.capacity,
        escape(&base.path),
        escape(&base.format)
    )
}

/// `<volume>` XML of an instance's seed ISO of `size` bytes (content uploaded afterwards).
pub fn seed_volume_xml(name: &str, size: u64) -> String {
    format!(
        "<volume><name>{}</name><capacity unit='bytes'>{size}</capacity>\
         <target><format type='raw'/></target></volume>",
        escape(name)
    )
}

/// Everything that goes into one domain's XML.
pub struct DomainPlan<'a> {
    /// Domain name: the instance name.
    pub name: &'a str,
    /// The provider's settings.
    pub settings: &'a KvmSettings,
    /// The owner stamp in the provider's namespace.
    pub stamp: &'a Stamp,
    /// The provider's metadata namespace.
    pub namespace: &'a str,
    /// The instance's volumes.
    pub volumes: &'a VolumeNames,
}

/// The domain XML for `plan`: what a real guest needs to boot from its overlay (or a kernel),
/// read its NoCloud seed, and be reached on its proxy port.
pub fn domain_xml(plan: &DomainPlan<'_>) -> String {
    let settings = plan.settings;
    let pool = escape(&settings.pool);
    let mut xml = String::new();
    let _ = writeln!(
        xml,
        "<domain type='{}' xmlns:qemu='{QEMU_NAMESPACE}'>",
        settings.domain_type.as_str()
    );
    let _ = writeln!(xml, "  <name>{}</name>", escape(plan.name));
    let _ = writeln!(
        xml,
        "  <metadata>\n    {}\n  </metadata>",
        plan.stamp.to_xml(plan.namespace)
    );
    let _ = writeln!(xml, "  <memory unit='MiB'>{}</memory>", settings.memory_mib);
    let _ = writeln!(xml, "  <vcpu>{}</vcpu>", settings.vcpus);
    // i440fx ('pc'), not q35: the user-mode NIC is placed on its `pci.0` bus.
    xml.push_str("  <os>\n    <type arch='x86_64' machine='pc'>hvm</type>\n");
    match &settings.boot {
        BootSettings::Disk {} => xml.push_str("    <boot dev='hd'/>\n"),
        BootSettings::Kernel {
            kernel,
            initrd,
            cmdline,
        } => {
            let _ = writeln!(xml, "    <kernel>{}</kernel>", escape(&kernel.to_string_lossy()));
            if let Some(initrd) = initrd {
                let _ = writeln!(xml, "    <initrd>{}</initrd>", escape(&initrd.to_string_lossy()));
            }
            let _ = writeln!(xml, "    <cmdline>{}</cmdline>", escape(cmdline));
        }
    }
    xml.push_str("  </os>\n  <features><acpi/></features>\n  <clock offset='utc'/>\n");
    xml.push_str("  <on_poweroff>destroy</on_poweroff>\n  <on_reboot>restart</on_reboot>\n");
    xml.push_str("  <on_crash>destroy</on_crash>\n  <devices>\n");
    let _ = writeln!(
        xml,
        "    <disk type='volume' device='disk'>\n      <driver name='qemu' type='qcow2'/>\n      \
         <source pool='{pool}' volume='{}'/>\n      <target dev='vda' bus='virtio'/>\n    </disk>",
        escape(&plan.volumes.disk)
    );
    // The seed as a read-only virtio disk: NoCloud finds it by its `cidata` label, and the
    // guest needs no CD-ROM driver.
    let _ = writeln!(
        xml,
        "    <disk type='volume' device='disk'>\n      <driver name='qemu' type='raw'/>\n      \
         <source pool='{pool}' volume='{}'/>\n      <target dev='vdb' bus='virtio'/>\n      \
         <readonly/>\n    </disk>",
        escape(&plan.volumes.seed)
    );
    // libvirt names an interface's type and its source attribute alike: `network`, `bridge`.
    let interface = match &settings.network {
        NetworkSettings::Libvirt { name } => Some(("network", name)),
        NetworkSettings::Bridge { name } => Some(("bridge", name)),
        NetworkSettings::User { .. } => None,
    };
    if let Some((kind, name)) = interface {
        let _ = writeln!(
            xml,
            "    <interface type='{kind}'>\n      <source {kind}='{}'/>\n      \
             <model type='virtio'/>\n    </interface>",
            escape(name)
        );
    }
    match settings.console_log_path(plan.name) {
        Some(log) => {
            // Appended to: a domain recreated after a failed boot (same name) must not wipe
            // the evidence of why the last one failed.
            let _ = writeln!(
                xml,
                "    <serial type='pty'><log file='{}' append='on'/><target port='0'/></serial>",
                escape(&log.to_string_lossy())
            );
        }
        None => xml.push_str("    <serial type='pty'><target port='0'/></serial>\n"),
    }
    xml.push_str(
        "    <console type='pty'><target type='serial' port='0'/></console>\n    \
         <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>\n  \
         </devices>\n",
    );
    if let Some(forward) = &plan.stamp.host_forward {
        // libvirt 9.0 has no passt backend for <portForward>, so the user-mode NIC and its
        // forward are passed to QEMU directly.
        let _ = writeln!(
            xml,
            "  <qemu:commandline>\n    <qemu:arg value='-netdev'/>\n    \
             <qemu:arg value='user,id=n0,hostfwd=tcp:{}:{}-:{}'/>\n    \
             <qemu:arg value='-device'/>\n    \
             <qemu:arg value='virtio-net-pci,netdev=n0,bus=pci.0,addr={USER_NIC_PCI_SLOT}'/>\n  \
             </qemu:commandline>",
            escape(&forward.host),
            forward.port,
            plan.stamp.port
        );
    }
    xml.push_str("</domain>\n");
    xml
}

/// The host address a user-mode forward listens on: `placement.address` if given (it must be
/// IPv4: QEMU's user-mode forwards are IPv4), else the configured one.
pub fn host_forward_address(
    request: &InstanceRequest,
    configured: Ipv4Addr,
) -> Result<Ipv4Addr, ProviderError> {
    let address = match &request.placement.address {
        Some(text) => text.parse::<IpAddr>().map_err(|_| {
            ProviderError::Misconfigured(format!("placement.address {text:?} is not an IP address"))
        })?,
        None => IpAddr::V4(configured),
    };
    match address {
        IpAddr::V4(v4) => Ok(v4),
        IpAddr::V6(_) => Err(ProviderError::Misconfigured(format!(
            "user-mode networking forwards IPv4 only; {address} is IPv6"
        ))),
    }
}

/// Picks a host port from `range` for a user-mode forward: not `taken` by another instance's
/// stamp, and bindable on `address` right now. The scan starts at a random port so concurrent
/// creates rarely pick the same one. The check binds on this host, which is the libvirt host
/// whenever user mode makes sense (a forward on a remote host's loopback reaches nobody).
pub fn choose_host_port(
    range: PortRange,
    address: Ipv4Addr,
    taken: &BTreeSet<u16>,
) -> Result<u16, ProviderError> {
    let span = u32::from(range.last - range.first) + 1;
    let start = fastrand::u32(0..span);
    for offset in 0..span {
        let candidate = range.first as u32 + (start + offset) % span;
        let port = u16::try_from(candidate).map_err(|_| {
            ProviderError::Backend(format!("port {candidate} out of range (invariant: range is u16)"))
        })?;
        if taken.contains(&port) {
            continue;
        }
        if TcpListener::bind((address, port)).is_ok() {
            return Ok(port);
        }
    }
    Err(ProviderError::Backend(format!(
        "no free port in {}-{} on {address} for a user-mode forward",
        range.first, range.last
    )))
}

/// The forward of a new domain on user-mode networking: on the request's (or the configured)
/// `address`, on a port of `ports` that no existing domain's stamp (`stamps`) holds and that is
/// free right now.
pub fn plan_host_forward(
    request: &InstanceRequest,
    address: Ipv4Addr,
    ports: PortRange,
    stamps: impl IntoIterator<Item = Result<Stamp, StampError>>,
) -> Result<Endpoint, ProviderError> {
    let address = host_forward_address(request, address)?;
    let taken: BTreeSet<u16> = stamps
        .into_iter()
        .filter_map(|stamp| stamp.ok()?.host_forward.map(|forward| forward.port))
        .collect();
    let port = choose_host_port(ports, address, &taken)?;
    Ok(Endpoint {
        host: address.to_string(),
        port,
    })
}

/// The best address among a guest's interfaces (from DHCP leases or the guest agent): the
/// first global IPv4 address, else the first global IPv6 address.
pub fn pick_address<'a>(addresses: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let mut ipv6 = None;
    for text in addresses {
        let bare = text.split('/').next().unwrap_or(text);
        match bare.parse::<IpAddr>() {
            Ok(IpAddr::V4(v4)) if !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified() => {
                return Some(v4.to_string());
            }
            Ok(IpAddr::V6(v6))
                if ipv6.is_none()
                    && !v6.is_loopback()
                    && !v6.is_unspecified()
                    && !v6.is_unicast_link_local() =>
            {
                ipv6 = Some(v6.to_string());
            }
            _ => {}
        }
    }
    ipv6
}

/// The stamp domain `name` has after `adopt`: `stamp` with `installation` in place of none,
/// and whether that differs from `stamp` (needs writing). An error if the stamp is damaged or
/// carries another installation.
pub fn adoption_stamp(
    name: &str,
    stamp: Result<Stamp, StampError>,
    installation: &Installation,
) -> Result<(Stamp, bool), ProviderError> {
    let mut stamp = stamp
        .map_err(|err| ProviderError::Misconfigured(format!("domain {name} cannot be adopted: {err}")))?;
    installation.refuse_foreign(name, stamp.installation.as_ref())?;
    let changed = stamp.installation.is_none();
    stamp.installation = Some(installation.clone());
    Ok((stamp, changed))
}

/// The error for a domain of our name that another provider (or a person) made.
pub fn foreign_domain(name: &str, namespace: &str) -> ProviderError {
    ProviderError::Misconfigured(format!(
        "a domain named {name} exists but carries no owner stamp in {namespace}: it was not \
         made by this provider type, which will not adopt it"
    ))
}
