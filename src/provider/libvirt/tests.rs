use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, TcpListener},
    path::PathBuf,
};

use base64::Engine as _;

use super::{seed::*, *};
use crate::{
    api::Placement,
    config::{DomainType, KvmSettings},
    provider::{
        Credentials, UserData,
        squid::{SquidError, USER_NAME_RULE, debian},
    },
};

pub(super) fn settings(network: NetworkSettings, boot: BootSettings) -> KvmSettings {
    KvmSettings {
        uri: "test:///default".into(),
        pool: "pool & co".into(),
        base_image: "base.qcow2".into(),
        network,
        boot,
        memory_mib: 256,
        vcpus: 2,
        domain_type: DomainType::Qemu,
        timeout_seconds: 30,
        console_log_dir: None,
    }
}

fn request() -> InstanceRequest {
    InstanceRequest {
        name: "epo-crawl-web-1-0a1b2c3d".into(),
        owner: Owner {
            uid: "6f1c-uid".into(),
            namespace: "crawl".into(),
            name: "web-<1>&\"'".into(),
        },
        spec_hash: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".into(),
        placement: Placement::default(),
        port: 3128,
        user_data: None,
        credentials: None,
    }
}

fn created_at() -> jiff::Timestamp {
    "2025-03-01T12:00:00.5Z".parse().expect("timestamp")
}

fn installation() -> Installation {
    Installation::new("8d2c-uid", "prod/\"ops\"&<x>")
}

#[test]
fn stamp_carries_its_installation_and_a_legacy_stamp_has_none() {
    let stamp = Stamp::for_request(&installation(), "k", &request(), created_at(), None);
    let xml = stamp.to_xml(KVM2_NAMESPACE);
    assert!(xml.contains("cluster=\"8d2c-uid\""), "{xml}");
    let parsed = Stamp::parse(&xml).expect("parses");
    assert_eq!(parsed.installation, Some(installation()));
    let instance = instance_from_stamp(
        ProviderId::new("kvm2", "k", "epo-x"),
        Ok(parsed),
        InstanceState::Running,
        None,
    );
    assert_eq!(instance.installation, Some(installation()));

    // Today's format (before installations): readable, with no installation.
    let legacy =
        r#"<owner uid="u" namespace="n" name="x" specHash="h" createdAt="2025-01-01T00:00:00Z" port="1"/>"#;
    let legacy = Stamp::parse(legacy).expect("a legacy stamp is readable");
    assert_eq!(legacy.installation, None);
    // Adoption adds this installation's; another installation's is refused; ours is kept.
    let (adopted, changed) = adoption_stamp("epo-x", Ok(legacy.clone()), &installation()).expect("adoptable");
    assert!(changed);
    assert_eq!(adopted.installation, Some(installation()));
    assert_eq!(
        adoption_stamp("epo-x", Ok(adopted.clone()), &installation()).expect("ours"),
        (adopted.clone(), false)
    );
    let other = Installation::new("8d2c-uid", "staging");
    let refused = adoption_stamp("epo-x", Ok(adopted), &other).expect_err("foreign");
    assert!(
        matches!(&refused, ProviderError::Misconfigured(m) if m.contains("belongs to installation")),
        "{refused}"
    );

    // Half an identity is a damaged stamp, not a legacy one.
    for (xml, attribute) in [
        (
            r#"<owner uid="u" namespace="n" name="x" specHash="h" createdAt="2025-01-01T00:00:00Z" port="1" cluster="c"/>"#,
            "installation",
        ),
        (
            r#"<owner uid="u" namespace="n" name="x" specHash="h" createdAt="2025-01-01T00:00:00Z" port="1" installation="i"/>"#,
            "cluster",
        ),
    ] {
        match Stamp::parse(xml) {
            Err(StampError::Attribute(name)) => assert_eq!(name, attribute, "{xml}"),
            other => panic!("{xml}: {other:?}"),
        }
    }
}

#[test]
fn stamp_round_trips_through_its_xml_with_awkward_characters() {
    let forward = Endpoint {
        host: "127.0.0.1".into(),
        port: 20001,
    };
    let mut req = request();
    req.placement.address = Some("192.0.2.7".into());
    let stamp = Stamp::for_request(
        &installation(),
        "kvm2-local",
        &req,
        created_at(),
        Some(forward.clone()),
    );
    let xml = stamp.to_xml(KVM2_NAMESPACE);
    assert!(
        xml.starts_with("<epo:owner xmlns:epo=\"https://crawl.example.com/kvm2/v1\""),
        "{xml}"
    );
    assert!(xml.contains("name=\"web-&lt;1&gt;&amp;&quot;&apos;\""), "{xml}");
    assert_eq!(Stamp::parse(&xml).expect("parses"), stamp);
    // libvirt hands the element back without its prefix.
    let unprefixed = xml.replacen("epo:owner xmlns:epo", "owner xmlns", 1);
    assert_eq!(Stamp::parse(&unprefixed).expect("parses"), stamp);
    assert_eq!(stamp.endpoint(), Some(forward));
}

#[test]
fn stamp_endpoint_is_placement_address_with_the_proxy_port_without_a_forward() {
    let mut req = request();
    assert_eq!(
        Stamp::for_request(&installation(), "k", &req, created_at(), None).endpoint(),
        None
    );
    req.placement.address = Some("2001:db8::7".into());
    let stamp = Stamp::for_request(&installation(), "k", &req, created_at(), None);
    assert_eq!(
        stamp.endpoint(),
        Some(Endpoint {
            host: "2001:db8::7".into(),
            port: 3128
        })
    );
}

#[test]
fn damaged_stamps_are_errors_that_leave_the_instance_ownerless() {
    for (xml, attribute) in [
        (
            r#"<owner uid="u" namespace="n" name="x" createdAt="2025-01-01T00:00:00Z" port="1"/>"#,
            "specHash",
        ),
        (
            r#"<owner uid="u" namespace="n" name="x" specHash="h" createdAt="yesterday" port="1"/>"#,
            "createdAt",
        ),
        (
            r#"<owner uid="" namespace="n" name="x" specHash="h" createdAt="2025-01-01T00:00:00Z" port="1"/>"#,
            "uid",
        ),
    ] {
        match Stamp::parse(xml) {
            Err(StampError::Attribute(name)) => assert_eq!(name, attribute, "{xml}"),
            other => panic!("{xml}: {other:?}"),
        }
    }
    assert!(matches!(Stamp::parse("<owner"), Err(StampError::Xml(_))));
    let id = ProviderId::new("kvm2", "k", "epo-x");
    let instance = instance_from_stamp(
        id.clone(),
        Stamp::parse("<owner/>"),
        InstanceState::Running,
        Some(Endpoint {
            host: "192.0.2.1".into(),
            port: 3128,
        }),
    );
    assert_eq!(instance.id, id);
    assert_eq!(instance.owner, None);
    assert_eq!(instance.created_at, jiff::Timestamp::UNIX_EPOCH);
    assert!(instance.endpoint.is_some());
}

#[test]
fn base_volume_xml_gives_path_format_and_capacity() {
    let xml = "<volume type='file'><name>base.qcow2</name><key>/p/base.qcow2</key>\
               <capacity unit='bytes'>16777216</capacity><allocation unit='bytes'>1</allocation>\
               <target><path>/p/base.qcow2</path><format type='qcow2'/></target></volume>";
    assert_eq!(
        BaseVolume::parse(xml).expect("parses"),
        BaseVolume {
            path: "/p/base.qcow2".into(),
            format: "qcow2".into(),
            capacity: 16 << 20
        }
    );
    let raw = "<volume><capacity unit='MiB'>2</capacity><target><path>/p/r.ext4</path></target></volume>";
    let parsed = BaseVolume::parse(raw).expect("parses");
    assert_eq!((parsed.format.as_str(), parsed.capacity), ("raw", 2 << 20));
    assert!(BaseVolume::parse("<volume><target/></volume>").is_err());
}

#[test]
fn overlay_volume_xml_backs_onto_the_base_in_its_format() {
    let base = BaseVolume {
        path: "/p/base.ext4".into(),
        format: "raw".into(),
        capacity: 1 << 30,
    };
    let xml = overlay_volume_xml("epo-a-kvm2-disk.qcow2", &base);
    let doc = roxmltree::Document::parse(&xml).expect("well-formed");
    let find = |tag: &str| doc.descendants().find(|n| n.has_tag_name(tag)).expect(tag);
    assert_eq!(find("name").text(), Some("epo-a-kvm2-disk.qcow2"));
    assert_eq!(find("capacity").text(), Some("1073741824"));
    let backing = find("backingStore");
    let path = backing.children().find(|n| n.has_tag_name("path")).expect("path");
    assert_eq!(path.text(), Some("/p/base.ext4"));
    let formats: Vec<_> = doc
        .descendants()
        .filter(|n| n.has_tag_name("format"))
        .map(|n| n.attribute("type").expect("type"))
        .collect();
    assert_eq!(formats, ["qcow2", "raw"]);
    let seed = seed_volume_xml("s.iso", 4096);
    assert!(seed.contains("<capacity unit='bytes'>4096</capacity>"), "{seed}");
}

fn domain(settings: &KvmSettings, host_forward: Option<Endpoint>) -> String {
    let stamp = Stamp::for_request(
        &installation(),
        "kvm2-local",
        &request(),
        created_at(),
        host_forward,
    );
    let volumes = VolumeNames::new(&request().name, "kvm2");
    domain_xml(&DomainPlan {
        name: &request().name,
        settings,
        stamp: &stamp,
        namespace: KVM2_NAMESPACE,
        volumes: &volumes,
    })
}

#[test]
fn domain_xml_for_user_mode_and_kernel_boot_has_what_a_real_guest_needs() {
    let settings = settings(
        NetworkSettings::User {
            host_forward_address: Ipv4Addr::LOCALHOST,
            host_forward_ports: PortRange::default(),
        },
        BootSettings::Kernel {
            kernel: PathBuf::from("/images/vmlinuz"),
            initrd: Some(PathBuf::from("/images/initrd.img")),
            cmdline: "root=/dev/vda console=ttyS0".into(),
        },
    );
    let forward = Endpoint {
        host: "127.0.0.1".into(),
        port: 20005,
    };
    let xml = domain(&settings, Some(forward));
    let doc = roxmltree::Document::parse(&xml).expect("well-formed");
    let root = doc.root_element();
    assert_eq!(root.attribute("type"), Some("qemu"));
    let text = |tag: &str| {
        doc.descendants()
            .find(|n| n.has_tag_name(tag))
            .and_then(|n| n.text())
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(text("name"), "epo-crawl-web-1-0a1b2c3d");
    assert_eq!(text("memory"), "256");
    assert_eq!(text("vcpu"), "2");
    assert_eq!(text("kernel"), "/images/vmlinuz");
    assert_eq!(text("initrd"), "/images/initrd.img");
    assert_eq!(text("cmdline"), "root=/dev/vda console=ttyS0");
    let ty = doc
        .descendants()
        .find(|n| n.has_tag_name("type"))
        .expect("os type");
    assert_eq!(ty.attribute("machine"), Some("pc"));
    // The stamp, in kvm2's namespace.
    let owner = doc
        .descendants()
        .find(|n| n.has_tag_name((KVM2_NAMESPACE, "owner")))
        .expect("stamp");
    assert_eq!(owner.attribute("uid"), Some("6f1c-uid"));
    assert_eq!(owner.attribute("hostForward"), Some("127.0.0.1:20005"));
    // Root overlay then the read-only seed, both pool volumes on virtio.
    let disks: Vec<_> = doc.descendants().filter(|n| n.has_tag_name("disk")).collect();
    assert_eq!(disks.len(), 2);
    let source = |disk: &roxmltree::Node<'_, '_>| {
        let source = disk
            .children()
            .find(|n| n.has_tag_name("source"))
            .expect("source");
        (
            source.attribute("pool").expect("pool").to_owned(),
            source.attribute("volume").expect("volume").to_owned(),
        )
    };
    assert_eq!(
        source(&disks[0]),
        (
            "pool & co".to_owned(),
            "epo-crawl-web-1-0a1b2c3d-kvm2-disk.qcow2".to_owned()
        )
    );
    assert_eq!(source(&disks[1]).1, "epo-crawl-web-1-0a1b2c3d-kvm2-seed.iso");
    assert!(disks[1].children().any(|n| n.has_tag_name("readonly")));
    // No libvirt NIC: the user-mode one is passed through with its forward and PCI slot.
    assert!(!doc.descendants().any(|n| n.has_tag_name("interface")));
    let args: Vec<_> = doc
        .descendants()
        .filter(|n| n.has_tag_name((QEMU_NAMESPACE, "arg")))
        .map(|n| n.attribute("value").expect("value"))
        .collect();
    assert_eq!(
        args,
        [
            "-netdev",
            "user,id=n0,hostfwd=tcp:127.0.0.1:20005-:3128",
            "-device",
            "virtio-net-pci,netdev=n0,bus=pci.0,addr=0x10"
        ]
    );
    assert!(doc.descendants().any(|n| n.has_tag_name("serial")));
    assert!(doc.descendants().any(|n| n.has_tag_name("channel")));
}

#[test]
fn console_log_dir_logs_the_serial_console_to_a_file_per_domain() {
    let mut settings = settings(NetworkSettings::default(), BootSettings::default());
    let serial_log = |xml: &str| {
        let doc = roxmltree::Document::parse(xml).expect("well-formed");
        let serial = doc
            .descendants()
            .find(|n| n.has_tag_name("serial"))
            .expect("a serial port");
        assert_eq!(
            serial.attribute("type"),
            Some("pty"),
            "still reachable with virsh console"
        );
        serial.children().find(|n| n.has_tag_name("log")).map(|log| {
            (
                log.attribute("file").map(str::to_owned),
                log.attribute("append").map(str::to_owned),
            )
        })
    };
    assert_eq!(serial_log(&domain(&settings, None)), None, "unset: no log file");
    settings.console_log_dir = Some(PathBuf::from("/var/log/epo & co"));
    assert_eq!(
        serial_log(&domain(&settings, None)),
        Some((
            Some("/var/log/epo & co/epo-crawl-web-1-0a1b2c3d.console.log".to_owned()),
            Some("on".to_owned())
        ))
    );
}

#[test]
fn domain_xml_for_libvirt_and_bridge_networks_boots_from_disk() {
    for (network, kind, attribute, value) in [
        (NetworkSettings::default(), "network", "network", "default"),
        (
            NetworkSettings::Bridge { name: "br0".into() },
            "bridge",
            "bridge",
            "br0",
        ),
    ] {
        let xml = domain(&settings(network, BootSettings::default()), None);
        let doc = roxmltree::Document::parse(&xml).expect("well-formed");
        let interface = doc
            .descendants()
            .find(|n| n.has_tag_name("interface"))
            .expect("interface");
        assert_eq!(interface.attribute("type"), Some(kind));
        let source = interface
            .children()
            .find(|n| n.has_tag_name("source"))
            .expect("source");
        assert_eq!(source.attribute(attribute), Some(value));
        let boot = doc.descendants().find(|n| n.has_tag_name("boot")).expect("boot");
        assert_eq!(boot.attribute("dev"), Some("hd"));
        assert!(!doc.descendants().any(|n| n.has_tag_name("kernel")));
        assert!(
            !doc.descendants()
                .any(|n| n.has_tag_name((QEMU_NAMESPACE, "commandline")))
        );
    }
}

#[test]
fn volume_names_carry_the_provider_type() {
    let kvm = VolumeNames::new("epo-a-1", "kvm");
    let kvm2 = VolumeNames::new("epo-a-1", "kvm2");
    assert_eq!(kvm.all(), ["epo-a-1-kvm-disk.qcow2", "epo-a-1-kvm-seed.iso"]);
    assert!(kvm.all().iter().all(|name| !kvm2.all().contains(name)));
}

#[test]
fn host_ports_skip_taken_and_bound_ones() {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let bound = listener.local_addr().expect("addr").port();
    let range = PortRange {
        first: bound,
        last: bound,
    };
    assert!(choose_host_port(range, Ipv4Addr::LOCALHOST, &BTreeSet::new()).is_err());
    // A free port is found; one recorded by another instance is never chosen.
    let free = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let free_port = free.local_addr().expect("addr").port();
    drop(free);
    let range = PortRange {
        first: free_port,
        last: free_port,
    };
    assert_eq!(
        choose_host_port(range, Ipv4Addr::LOCALHOST, &BTreeSet::new()).expect("free"),
        free_port
    );
    assert!(choose_host_port(range, Ipv4Addr::LOCALHOST, &BTreeSet::from([free_port])).is_err());
}

#[test]
fn forward_address_prefers_placement_and_refuses_ipv6() {
    let mut req = request();
    assert_eq!(
        host_forward_address(&req, Ipv4Addr::LOCALHOST).expect("v4"),
        Ipv4Addr::LOCALHOST
    );
    req.placement.address = Some("127.0.0.2".into());
    assert_eq!(
        host_forward_address(&req, Ipv4Addr::LOCALHOST).expect("v4"),
        Ipv4Addr::new(127, 0, 0, 2)
    );
    req.placement.address = Some("::1".into());
    assert!(matches!(
        host_forward_address(&req, Ipv4Addr::LOCALHOST),
        Err(ProviderError::Misconfigured(_))
    ));
}

#[test]
fn picked_address_prefers_global_ipv4() {
    assert_eq!(
        pick_address([
            "fe80::1/64",
            "2001:db8::5/64",
            "127.0.0.1/8",
            "169.254.0.9/16",
            "10.1.2.3/24"
        ])
        .as_deref(),
        Some("10.1.2.3")
    );
    assert_eq!(
        pick_address(["fe80::1/64", "2001:db8::5/64"]).as_deref(),
        Some("2001:db8::5")
    );
    assert_eq!(pick_address(["::1/128", "garbage"]), None);
}

/// Splits a multi-part user-data into (headers, decoded body) per part.
fn mime_parts(message: &str) -> Vec<(String, String)> {
    let boundary = message
        .split("boundary=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("boundary");
    let delimiter = format!("--{boundary}");
    message
        .split(&delimiter)
        .skip(1)
        .take_while(|part| !part.starts_with("--"))
        .map(|part| {
            let (headers, body) = part.split_once("\r\n\r\n").expect("headers");
            let body = if headers.contains("Content-Transfer-Encoding: base64") {
                String::from_utf8(decode_base64(body)).expect("utf-8")
            } else {
                body.to_owned()
            };
            (headers.trim().to_owned(), body)
        })
        .collect()
}

fn decode_base64(text: &str) -> Vec<u8> {
    let joined: String = text.split_whitespace().collect();
    base64::engine::general_purpose::STANDARD
        .decode(joined)
        .expect("base64")
}

#[test]
fn mime_base64_pads_and_wraps_at_76_characters() {
    assert_eq!(base64_mime(b""), "");
    assert_eq!(base64_mime(b"f"), "Zg==");
    assert_eq!(base64_mime(b"fo"), "Zm8=");
    assert_eq!(base64_mime(b"foo"), "Zm9v");
    let long = base64_mime(&[0u8; 120]);
    let lines: Vec<&str> = long.split("\r\n").collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0].len(), 76);
    assert_eq!(lines[2], "AAAAAAAA");
    assert_eq!(decode_base64(&long), [0u8; 120]);
}

#[test]
fn user_data_keeps_the_users_part_and_adds_the_proxy_config() {
    let mut req = request();
    let users = "#cloud-config\nwrite_files:\n  - path: /etc/motd\n    content: héllo --boundary\nruncmd: [\"true\"]\n";
    req.user_data = Some(UserData(users.into()));
    req.credentials = Some(Credentials {
        username: "crawler".into(),
        password: "s3cret".into(),
    });
    req.placement.outgoing_address = Some("192.0.2.9".into());
    let seed = Seed::for_request(&req).expect("seed");
    assert!(
        seed.user_data
            .starts_with("Content-Type: multipart/mixed; boundary=")
    );
    assert!(
        !seed.user_data.contains("s3cret"),
        "the password is stored hashed only"
    );
    let parts = mime_parts(&seed.user_data);
    assert_eq!(parts.len(), 2, "{parts:?}");
    assert!(parts[0].0.contains("Content-Type: text/x-not-multipart"));
    assert_eq!(parts[0].1, users, "the user's part is kept byte for byte");
    assert!(parts[1].0.contains("Content-Type: text/cloud-config"));
    let ours = &parts[1].1;
    assert!(ours.starts_with("#cloud-config\n"), "{ours}");
    let config: serde_json::Value =
        serde_norway::from_str(ours.trim_start_matches("#cloud-config\n")).expect("YAML");
    assert_eq!(config["manage_etc_hosts"], true);
    assert_eq!(config["merge_how"][0]["settings"][0], "append");
    let files = config["write_files"].as_array().expect("files");
    assert_eq!(files[0]["path"], debian::CONF_PATH);
    let conf = files[0]["content"].as_str().expect("conf");
    assert!(conf.contains("http_port 3128\n"), "{conf}");
    assert!(
        conf.contains("visible_hostname epo-crawl-web-1-0a1b2c3d\n"),
        "{conf}"
    );
    assert!(conf.contains("tcp_outgoing_address 192.0.2.9\n"), "{conf}");
    assert!(conf.contains("acl authenticated proxy_auth REQUIRED\n"), "{conf}");
    assert_eq!(files[1]["path"], debian::PASSWD_PATH);
    assert_eq!(files[1]["owner"], "root:proxy");
    let passwd = files[1]["content"].as_str().expect("passwd");
    assert!(passwd.starts_with("crawler:$6$"), "{passwd}");
    assert!(
        seed.meta_data
            .contains("local-hostname: epo-crawl-web-1-0a1b2c3d\n")
    );
}

#[test]
fn user_data_nests_a_users_mime_message_and_works_without_one() {
    let mut req = request();
    let users = "Content-Type: multipart/mixed; boundary=\"XYZ\"\nMIME-Version: 1.0\n\n--XYZ\n\
                 Content-Type: text/x-shellscript\n\n#!/bin/sh\necho hi\n--XYZ--\n";
    req.user_data = Some(UserData(users.into()));
    let with = Seed::for_request(&req).expect("seed").user_data;
    assert!(with.contains(users), "nested verbatim");
    req.user_data = None;
    let without = Seed::for_request(&req).expect("seed").user_data;
    let parts = mime_parts(&without);
    assert_eq!(parts.len(), 1);
    assert!(
        parts[0].1.contains("http_access allow all"),
        "open proxy without credentials"
    );
}

#[test]
fn meta_data_instance_id_changes_with_the_spec_hash() {
    let first = meta_data("epo-a", "aaaa1111");
    let second = meta_data("epo-a", "bbbb2222");
    assert_ne!(first, second);
    assert!(first.starts_with("instance-id: epo-a-aaaa1111\n"), "{first}");
}

#[test]
fn credentials_squid_cannot_carry_are_refused_before_a_seed_exists() {
    let mut req = request();
    req.credentials = Some(Credentials {
        username: "a:b".into(),
        password: "x".into(),
    });
    let err = Seed::for_request(&req).expect_err("refused");
    assert!(
        matches!(
            err,
            SeedError::Squid(SquidError::UserNameCharacter {
                position: 2,
                character: ':'
            })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains(USER_NAME_RULE), "{err}");
    // The Proxy's problem, not the provider's: no retry until the Proxy changes.
    let provider_error = steps::seed_error(err);
    assert!(
        matches!(provider_error, ProviderError::Rejected(_)),
        "{provider_error:?}"
    );
}

#[test]
fn seed_debug_output_is_redacted() {
    let mut req = request();
    req.user_data = Some(UserData("#cloud-config\npassword: hunter2\n".into()));
    let seed = Seed::for_request(&req).expect("seed");
    let shown = format!("{seed:?}");
    assert!(
        !shown.contains("hunter2") && shown.contains("redacted"),
        "{shown}"
    );
}
