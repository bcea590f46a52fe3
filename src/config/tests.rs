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
            assert_eq!(kvm.domain_type, "qemu");
            assert_eq!(kvm.network, "default");
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
