use super::*;

#[test]
fn instance_names_are_deterministic_dns_labels() {
    let a = instance_name("crawl", "web-1", "0d4c7a40-uid");
    assert_eq!(a, instance_name("crawl", "web-1", "0d4c7a40-uid"));
    assert!(a.starts_with("epo-crawl-web-1-"), "{a}");
    assert!(crate::config::is_dns_label(&a), "{a}");
    // A new object of the same name (new UID) gets a new instance.
    assert_ne!(a, instance_name("crawl", "web-1", "another-uid"));
    // Long names are truncated but stay unique and valid.
    let long = "x".repeat(200);
    let b = instance_name(&long, &long, "u1");
    let c = instance_name(&long, &long, "u2");
    assert_ne!(b, c);
    assert!(
        crate::config::is_dns_label(&b) && b.len() <= MAX_INSTANCE_NAME,
        "{b}"
    );
    // Upper case and dots never leak into the name.
    assert!(crate::config::is_dns_label(&instance_name(
        "ns",
        "Web.Proxy",
        "u"
    )));
}

#[test]
fn provider_ids_round_trip_and_keep_slashes_in_native_ids() {
    let id: ProviderId = "kubernetes/cluster/egress/pod-1".parse().expect("valid");
    assert_eq!(id.provider_type, "kubernetes");
    assert_eq!(id.instance, "cluster");
    assert_eq!(id.native_id, "egress/pod-1");
    assert_eq!(id.to_string(), "kubernetes/cluster/egress/pod-1");
    assert!("kvm2/only-two".parse::<ProviderId>().is_err());
    assert!("kvm2//x".parse::<ProviderId>().is_err());
}

#[test]
fn secrets_never_show_in_debug_output() {
    let credentials = Credentials {
        username: "crawler".into(),
        password: "hunter2-canary".into(),
    };
    let data = UserData("#cloud-config\npassword: hunter2-canary".into());
    let shown = format!("{credentials:?} {data:?}");
    assert!(!shown.contains("hunter2-canary"), "{shown}");
}
