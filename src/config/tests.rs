use super::*;

fn problems(text: &str) -> Vec<String> {
    match ProvidersConfig::parse(text) {
        Err(ConfigError::Invalid(Problems(problems))) => problems,
        other => panic!("expected invalid config, got {other:?}"),
    }
}

#[test]
fn parses_every_type_with_defaults() {
    let config = ProvidersConfig::parse(
        r#"
providers:
  - name: local
    type: local
    settings: {stateDir: /tmp/x}
  - name: rack1
    type: kvm
    settings: {uri: "qemu:///system", pool: default, baseImage: base.qcow2}
  - name: rack2
    type: kvm2
    settings: {uri: "qemu+ssh://h/system", pool: p, baseImage: b, domainType: qemu}
  - name: cluster
    type: kubernetes
    settings: {namespace: egress, image: "ubuntu/squid:6.6", serviceType: NodePort}
"#,
    )
    .expect("valid config");
    assert_eq!(config.names(), ["local", "rack1", "rack2", "cluster"]);
    let types: Vec<_> = config.instances.iter().map(ProviderInstance::type_name).collect();
    assert_eq!(types, ["local", "kvm", "kvm2", "kubernetes"]);
    match &config.instance("local").expect("configured").settings {
        ProviderSettings::Local(local) => {
            assert_eq!(local.squid_path, PathBuf::from("/usr/sbin/squid"));
            assert_eq!(local.bind_address, "127.0.0.1");
            assert_eq!(local, &LocalSettings::new("/tmp/x"), "every default");
        }
        other => panic!("wrong settings {other:?}"),
    }
    match &config.instance("rack2").expect("configured").settings {
        ProviderSettings::Kvm2(kvm) => {
            assert_eq!(kvm.domain_type, DomainType::Qemu);
            assert_eq!(
                kvm.network,
                NetworkSettings::Libvirt {
                    name: "default".into()
                }
            );
            assert_eq!(kvm.boot, BootSettings::Disk {});
            assert_eq!((kvm.memory_mib, kvm.vcpus, kvm.timeout_seconds), (512, 1, 60));
        }
        other => panic!("wrong settings {other:?}"),
    }
}

use std::path::PathBuf;

#[test]
fn reports_every_problem_naming_instance_and_field() {
    let problems = problems(
        r#"
providers:
  - name: a
    type: kvm2
    settings: {pool: p, baseImage: b}
  - name: a
    type: local
    settings: {stateDir: /x}
  - name: b
    type: openstack
  - name: c
    type: local
    settings: {stateDir: /x, squidPth: /usr/sbin/squid}
  - name: Bad_Name
    type: local
    settings: {stateDir: /x}
"#,
    );
    assert_eq!(
        problems,
        [
            r#"providers[0] ("a"): settings: missing field `uri`"#,
            r#"providers[1] ("a"): duplicate name; every provider instance needs its own name"#,
            r#"providers[2] ("b"): unknown type "openstack"; known types are kvm, kvm2, kubernetes, local"#,
            r#"providers[3] ("c"): settings.squidPth: unknown field `squidPth`, expected one of `stateDir`, `squidPath`, `bindAddress`, `advertiseAddress`, `authHelperPath`, `squidUser`, `accessLog`, `extraConfig`, `startTimeoutSeconds`, `stopTimeoutSeconds`"#,
            r#"providers[4] ("Bad_Name"): name must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"#,
        ]
    );
}

#[test]
fn missing_settings_name_the_required_field() {
    let problems = problems("providers:\n  - name: k\n    type: kubernetes\n");
    assert_eq!(
        problems,
        [r#"providers[0] ("k"): settings: missing field `namespace`"#]
    );
}

#[test]
fn shape_errors_name_the_location() {
    let err = ProvidersConfig::parse("providers:\n  - name: x\n    typo: local\n").expect_err("invalid");
    let message = err.to_string();
    assert!(message.contains("providers[0]"), "{message}");
    assert!(message.contains("unknown field `typo`"), "{message}");
    let err = ProvidersConfig::parse("providers: []\n").expect_err("empty");
    assert_eq!(
        err.to_string(),
        "providers: the list is empty; configure at least one provider instance"
    );
}

#[test]
fn local_settings_take_every_field_and_reject_typos() {
    let config = ProvidersConfig::parse(
        r#"
providers:
  - name: local
    type: local
    settings:
      stateDir: /srv/proxies
      squidPath: /opt/squid/sbin/squid
      bindAddress: 0.0.0.0
      advertiseAddress: 192.0.2.10
      authHelperPath: /opt/squid/libexec/basic_ncsa_auth
      squidUser: squid
      accessLog: false
      extraConfig: ["dns_nameservers 192.0.2.53"]
      startTimeoutSeconds: 3
      stopTimeoutSeconds: 2
"#,
    )
    .expect("valid config");
    let ProviderSettings::Local(local) = &config.instances[0].settings else {
        panic!("wrong type");
    };
    assert_eq!(
        local,
        &LocalSettings {
            state_dir: PathBuf::from("/srv/proxies"),
            squid_path: PathBuf::from("/opt/squid/sbin/squid"),
            bind_address: "0.0.0.0".into(),
            advertise_address: Some("192.0.2.10".into()),
            auth_helper_path: PathBuf::from("/opt/squid/libexec/basic_ncsa_auth"),
            squid_user: "squid".into(),
            access_log: false,
            extra_config: vec!["dns_nameservers 192.0.2.53".into()],
            start_timeout_seconds: 3,
            stop_timeout_seconds: 2,
        }
    );
    let problems =
        problems("providers:\n  - name: l\n    type: local\n    settings: {stateDir: /x, acessLog: true}\n");
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("acessLog"), "{problems:?}");
}

fn kvm_settings(settings: &str) -> Result<KvmSettings, Vec<String>> {
    let text = format!("providers:\n  - name: k\n    type: kvm2\n    settings: {settings}\n");
    match ProvidersConfig::parse(&text) {
        Ok(config) => match config.instances.into_iter().next().map(|i| i.settings) {
            Some(ProviderSettings::Kvm2(kvm)) => Ok(kvm),
            other => panic!("wrong settings {other:?}"),
        },
        Err(ConfigError::Invalid(Problems(problems))) => Err(problems),
        Err(other) => Err(vec![other.to_string()]),
    }
}

#[test]
fn kvm_network_modes_and_boot_modes_parse_with_defaults() {
    let base = "uri: 'qemu:///session', pool: p, baseImage: b";
    let user = kvm_settings(&format!("{{{base}, network: {{mode: user}}}}")).expect("valid");
    assert_eq!(
        user.network,
        NetworkSettings::User {
            host_forward_address: std::net::Ipv4Addr::LOCALHOST,
            host_forward_ports: PortRange {
                first: 20000,
                last: 20999
            },
        }
    );
    let user = kvm_settings(&format!(
        "{{{base}, network: {{mode: user, hostForwardAddress: 127.0.0.2, hostForwardPorts: {{first: 2000, last: 2010}}}}}}"
    ))
    .expect("valid");
    assert_eq!(
        user.network,
        NetworkSettings::User {
            host_forward_address: std::net::Ipv4Addr::new(127, 0, 0, 2),
            host_forward_ports: PortRange {
                first: 2000,
                last: 2010
            },
        }
    );
    let bridge = kvm_settings(&format!("{{{base}, network: {{mode: bridge, name: br0}}}}")).expect("valid");
    assert_eq!(bridge.network, NetworkSettings::Bridge { name: "br0".into() });
    let libvirt = kvm_settings(&format!("{{{base}, network: {{mode: libvirt}}}}")).expect("valid");
    assert_eq!(libvirt.network, NetworkSettings::default());
    let kernel = kvm_settings(&format!(
        "{{{base}, boot: {{mode: kernel, kernel: /k/vmlinuz, initrd: /k/initrd}}, domainType: qemu}}"
    ))
    .expect("valid");
    assert_eq!(
        kernel.boot,
        BootSettings::Kernel {
            kernel: PathBuf::from("/k/vmlinuz"),
            initrd: Some(PathBuf::from("/k/initrd")),
            cmdline: "root=/dev/vda console=ttyS0".into(),
        }
    );
    assert_eq!(kernel.domain_type, DomainType::Qemu);
    let disk = kvm_settings(&format!("{{{base}, boot: {{mode: disk}}, timeoutSeconds: 5}}")).expect("valid");
    assert_eq!((disk.boot, disk.timeout_seconds), (BootSettings::Disk {}, 5));
    assert_eq!(disk.console_log_dir, None);
    let logged = kvm_settings(&format!("{{{base}, consoleLogDir: /var/log/epo}}")).expect("valid");
    assert_eq!(
        logged.console_log_path("epo-a-1"),
        Some(PathBuf::from("/var/log/epo/epo-a-1.console.log"))
    );
}

#[test]
fn kvm_settings_mistakes_name_the_field() {
    let base = "uri: 'qemu:///session', pool: p, baseImage: b";
    let cases = [
        (
            "network: {mode: slirp}",
            "settings.network.mode: unknown variant `slirp`, expected one of `libvirt`, `bridge`, `user`",
        ),
        (
            "network: {mode: bridge}",
            "settings.network: missing field `name`",
        ),
        (
            "network: {mode: user, hostForwardAddress: '::1'}",
            "settings.network",
        ),
        ("network: {mode: user, port: 1}", "unknown field `port`"),
        (
            "network: {mode: user, hostForwardPorts: {first: 30, last: 20}}",
            "port range 30-20 is empty",
        ),
        (
            "network: default",
            "settings.network: invalid type: string \"default\", expected a network such as {mode: libvirt, name: default}",
        ),
        ("boot: {mode: disk, kernel: /k}", "unknown field `kernel`"),
        ("boot: {mode: kernel}", "settings.boot: missing field `kernel`"),
        (
            "domainType: xen",
            "settings.domainType: unknown variant `xen`, expected `kvm` or `qemu`",
        ),
    ];
    let mut mismatches = Vec::new();
    for (extra, expected) in cases {
        let problems = kvm_settings(&format!("{{{base}, {extra}}}")).expect_err(extra);
        if problems.len() != 1 || !problems[0].contains(expected) {
            mismatches.push(format!("{extra}: expected {expected:?} in {problems:?}"));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

/// The benchmarks' in-memory provider exists only in builds with the `bench-provider` feature:
/// a shipped build refuses a config that names it, so no production config selects it.
#[cfg(not(feature = "bench-provider"))]
#[test]
fn the_benchmark_provider_is_unknown_to_a_shipped_build() {
    let problems = problems("providers:\n  - name: bench\n    type: bench-memory\n");
    assert_eq!(
        problems,
        [
            r#"providers[0] ("bench"): unknown type "bench-memory"; known types are kvm, kvm2, kubernetes, local"#
        ]
    );
}
