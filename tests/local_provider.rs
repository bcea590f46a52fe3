//! The `local` provider against real Squid: traffic through the started proxy, credentials,
//! source addresses, bad input, supervision, delete and operator restarts.

#[allow(dead_code)]
mod support {
    pub mod contract;
    pub mod local;
    pub mod origin;
    pub mod ports;
    pub mod process;
    pub mod wait;
}

use std::{net::SocketAddr, time::Duration};

use egress_proxies_operator::{
    config::{LocalSettings, ProvidersConfig},
    provider::{
        Credentials, CredentialsCheck, Instance, InstanceRequest, InstanceState, Provider, ProviderError,
        ProviderRegistry, RegistryError, local::LocalProvider,
    },
};
use support::{
    contract::{new_owner, plain_request},
    local::{LocalBackend, StateDir, create_on_a_free_port, free_port},
    origin::{OriginServer, fetch_via_proxy},
    process::{kill, processes_mentioning, squid_segments, squid_service, squids},
    wait::holds_within,
};

const DEADLINE: Duration = Duration::from_secs(20);

fn request(check: &str) -> InstanceRequest {
    plain_request(new_owner(check), free_port())
}

fn proxy_addr(instance: &Instance) -> SocketAddr {
    let endpoint = instance.endpoint.as_ref().expect("an endpoint");
    format!("{}:{}", endpoint.host, endpoint.port)
        .parse()
        .expect("ip:port")
}

/// Polls `get` until the instance is in `state`.
async fn wait_for_state(provider: &LocalProvider, name: &str, state: InstanceState) -> Instance {
    let mut last = None;
    let reached = holds_within(DEADLINE, async || {
        last = provider.get(name).await.ok();
        last.as_ref().is_some_and(|i| i.state == state)
    })
    .await;
    assert!(reached, "{name} did not become {state:?}; last seen {last:?}");
    last.expect("seen")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetches_a_page_through_the_started_squid() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let origin = OriginServer::start().await;
    let instance = create_on_a_free_port(&provider, request("fetch")).await;
    assert_eq!(
        instance.state,
        InstanceState::Running,
        "create waits until Squid accepts"
    );
    if rustix::process::geteuid().is_root() {
        // Started as root, Squid runs as `proxy` (the default squidUser).
        let pid = squids(&provider.instance_dir(&instance.id.native_id))[0];
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let effective_uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            .expect("effective uid");
        let passwd = std::fs::read_to_string("/etc/passwd").expect("passwd");
        let proxy_uid = passwd
            .lines()
            .find_map(|l| l.strip_prefix("proxy:"))
            .and_then(|rest| rest.split(':').nth(1))
            .expect("proxy user");
        assert_eq!(effective_uid, proxy_uid, "Squid's effective uid");
    }

    let response = fetch_via_proxy(proxy_addr(&instance), &origin.url("/page"), None).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.body, "hello /page from 127.0.0.1");
    // The origin saw Squid's connection, not ours: it went through the proxy.
    assert_eq!(origin.peers().len(), 1);
    let access_log = std::fs::read_to_string(
        provider
            .instance_dir(&instance.id.native_id)
            .join("run/access.log"),
    )
    .expect("access log");
    assert!(access_log.contains(&origin.url("/page")), "{access_log}");
    provider.delete(&instance.id.native_id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_required_when_given() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let origin = OriginServer::start().await;
    let mut request = request("credentials");
    request.credentials = Some(Credentials {
        username: "crawler".into(),
        password: "correct horse: battery".into(),
    });
    let instance = create_on_a_free_port(&provider, request).await;
    let proxy = proxy_addr(&instance);
    let url = origin.url("/secret");

    let anonymous = fetch_via_proxy(proxy, &url, None).await;
    assert_eq!(anonymous.status, 407, "{anonymous:?}");
    assert!(
        anonymous.head.contains("Proxy-Authenticate: Basic"),
        "{}",
        anonymous.head
    );
    let wrong = fetch_via_proxy(proxy, &url, Some(("crawler", "wrong"))).await;
    assert_eq!(wrong.status, 407, "{wrong:?}");
    let right = fetch_via_proxy(proxy, &url, Some(("crawler", "correct horse: battery"))).await;
    assert_eq!(right.status, 200, "{right:?}");
    assert_eq!(right.body, "hello /secret from 127.0.0.1");
    assert_eq!(
        origin.peers().len(),
        1,
        "only the authenticated request reached the origin"
    );

    let dir = provider.instance_dir(&instance.id.native_id);
    let passwords = std::fs::read_to_string(dir.join("passwords")).expect("password file");
    assert!(
        passwords.starts_with("crawler:$6$") && !passwords.contains("battery"),
        "hashed"
    );
    let owner = std::fs::read_to_string(dir.join("owner.json")).expect("owner record");
    assert!(!owner.contains("battery"), "no secret in the owner record");

    // What a restarted operator asks before it gives credentials again.
    let name = &instance.id.native_id;
    let check = |username: &str, password: &str| Credentials {
        username: username.into(),
        password: password.into(),
    };
    for (credentials, expected) in [
        (
            Some(check("crawler", "correct horse: battery")),
            CredentialsCheck::Accepts,
        ),
        (Some(check("crawler", "wrong")), CredentialsCheck::Differs),
        (
            Some(check("other", "correct horse: battery")),
            CredentialsCheck::Differs,
        ),
        (None, CredentialsCheck::Differs),
    ] {
        assert_eq!(
            provider
                .check_credentials(name, credentials.as_ref())
                .await
                .expect("checked"),
            expected,
            "{credentials:?}"
        );
    }
    provider.delete(name).await.expect("delete");
    assert!(matches!(
        provider.check_credentials(name, None).await,
        Err(ProviderError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outgoing_connections_use_the_placement_outgoing_address() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let origin = OriginServer::start().await;
    let mut request = request("outgoing");
    // All of 127.0.0.0/8 is on loopback on Linux: 127.0.0.2 is an address of this host.
    request.placement.outgoing_address = Some("127.0.0.2".into());
    let instance = create_on_a_free_port(&provider, request).await;

    let response = fetch_via_proxy(proxy_addr(&instance), &origin.url("/from"), None).await;
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.body, "hello /from from 127.0.0.2");
    assert_eq!(
        origin.peers(),
        ["127.0.0.2".parse::<std::net::IpAddr>().expect("ip")]
    );
    provider.delete(&instance.id.native_id).await.expect("delete");
}

/// Nothing of the instance remains: no folder, no temporary folder, no process.
fn assert_nothing_left(backend: &LocalBackend) {
    let state = backend.state.path();
    let entries: Vec<String> = std::fs::read_dir(&state)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(entries.is_empty(), "left in the state folder: {entries:?}");
    assert_eq!(
        processes_mentioning(&state),
        Vec::<i32>::new(),
        "processes left running"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_squid_cannot_parse_is_misconfigured_and_leaves_nothing() {
    let backend = LocalBackend::with_settings(|settings| LocalSettings {
        extra_config: vec!["no_such_directive on".into()],
        ..settings
    });
    let provider = backend.provider();
    let request = request("bad-config");
    match provider.create(&request).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(
                message.contains("no_such_directive"),
                "names the problem: {message}"
            );
        }
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    assert!(matches!(
        provider.get(&request.name).await,
        Err(ProviderError::NotFound(_))
    ));
    assert_nothing_left(&backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_clear_errors_that_leave_nothing() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    type Adjust = fn(&mut InstanceRequest);
    let cases: [(&str, Adjust, &str); 5] = [
        (
            "address",
            |r| r.placement.address = Some("not-an-ip".into()),
            "placement.address",
        ),
        (
            "foreign-address",
            |r| r.placement.address = Some("192.0.2.1".into()),
            "not an address of this host",
        ),
        (
            "outgoing",
            |r| r.placement.outgoing_address = Some("192.0.2.1".into()),
            "outgoingAddress 192.0.2.1 is not an address of this host",
        ),
        ("port", |r| r.port = 0, "port 0"),
        (
            "user",
            |r| {
                r.credentials = Some(Credentials {
                    username: "a:b".into(),
                    password: "canary-secret".into(),
                })
            },
            "user name",
        ),
    ];
    for (check, adjust, expected) in cases {
        let mut request = request(check);
        adjust(&mut request);
        // The Proxy's own request is at fault, not the provider's configuration.
        match provider.create(&request).await {
            Err(ProviderError::Rejected(message)) => {
                assert!(message.contains(expected), "{check}: {message}");
                assert!(!message.contains("canary-secret"), "{check}: leaks the password");
            }
            other => panic!("{check}: expected Rejected, got {other:?}"),
        }
    }
    assert_nothing_left(&backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_in_use_is_a_clear_error_and_leaves_nothing() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut request = request("port-in-use");
    request.port = taken.local_addr().expect("addr").port();
    // This Proxy's port is taken: its problem (the engine's create_rejected), not the provider's.
    match provider.create(&request).await {
        Err(ProviderError::Rejected(message)) => {
            assert!(message.contains("already in use"), "{message}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_nothing_left(&backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_squid_binary_is_misconfigured_everywhere() {
    let backend = LocalBackend::with_settings(|settings| LocalSettings {
        squid_path: "/nonexistent/squid".into(),
        ..settings
    });
    let provider = backend.provider();
    match provider.create(&request("no-squid")).await {
        Err(ProviderError::Misconfigured(message)) => assert!(message.contains("squidPath"), "{message}"),
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    match provider.probe().await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(message.contains("/nonexistent/squid"), "{message}")
        }
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    assert_nothing_left(&backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_squid_is_restarted_by_supervision() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let origin = OriginServer::start().await;
    let instance = create_on_a_free_port(&provider, request("supervision")).await;
    let name = instance.id.native_id.clone();
    let dir = provider.instance_dir(&name);
    let before = squids(&dir);
    assert_eq!(before.len(), 1, "{before:?}");
    kill(before[0]);

    // Nobody calls create or get in between: the background supervisor notices.
    let restarted = holds_within(DEADLINE, async || {
        let now = squids(&dir);
        now.len() == 1 && now != before
    })
    .await;
    assert!(restarted, "no new Squid after the kill");
    wait_for_state(&provider, &name, InstanceState::Running).await;
    let status = provider.supervision(&name).expect("supervision status");
    assert_eq!(status.restarts, 1, "{status:?}");
    let response = fetch_via_proxy(proxy_addr(&instance), &origin.url("/again"), None).await;
    assert_eq!(response.status, 200, "the restarted Squid serves: {response:?}");
    provider.delete(&name).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_backs_off_and_recovers() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let instance = create_on_a_free_port(&provider, request("crash-loop")).await;
    let name = instance.id.native_id.clone();
    let dir = provider.instance_dir(&name);
    // Break the config behind the provider's back: every restarted Squid exits at once.
    let config = dir.join("squid.conf");
    let good = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, format!("{good}no_such_directive on\n")).expect("break config");
    kill(squids(&dir)[0]);

    let mut status = None;
    let looping = holds_within(DEADLINE, async || {
        status = provider.supervision(&name);
        status.as_ref().is_some_and(|s| s.consecutive_attempts >= 3)
    })
    .await;
    let status = status.expect("supervision status");
    assert!(looping, "three restart attempts expected: {status:?}");
    // Attempt n waits restart_backoff(n) after the one before: 0 s, 1 s, 2 s, then 4 s.
    assert!(
        status
            .next_attempt_in
            .is_some_and(|wait| wait > Duration::from_millis(1500)),
        "backs off: {status:?}"
    );
    assert!(status.consecutive_attempts <= 4, "does not spin: {status:?}");
    let stopped = holds_within(DEADLINE, async || {
        provider
            .get(&name)
            .await
            .is_ok_and(|i| i.state == InstanceState::Stopped)
    })
    .await;
    assert!(stopped, "a Squid that keeps dying is reported Stopped");

    std::fs::write(&config, good).expect("repair config");
    wait_for_state(&provider, &name, InstanceState::Running).await;
    assert_eq!(squids(&dir).len(), 1);
    provider.delete(&name).await.expect("delete");
}

/// Removes a file when dropped, whatever the test's outcome.
struct RemovedOnDrop(&'static str);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Squid names its shared-memory segments after its service name (`squid` unless `-n` says
/// otherwise) and creates them exclusively, so two Squids starting at once under one name
/// race, and the loser dies with `shm_open(/squid-cf__metadata.shm): (17) File exists` (a
/// parallel test run met it). A segment under the default name that Squid may not remove
/// stands for the other Squid: each instance's Squid has names of its own and starts anyway,
/// its segments are its own, and delete takes them with it even after a SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_squids_shared_memory_does_not_stop_ours() {
    const DEFAULT_SEGMENT: &str = "/dev/shm/squid-cf__metadata.shm";
    let _planted = rustix::process::geteuid().is_root().then(|| {
        // Root's file in the sticky /dev/shm: Squid, running as `proxy`, cannot unlink it.
        std::fs::write(DEFAULT_SEGMENT, b"").expect("plant a segment");
        std::fs::set_permissions(
            DEFAULT_SEGMENT,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .expect("chmod the segment");
        RemovedOnDrop(DEFAULT_SEGMENT)
    });
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let first = create_on_a_free_port(&provider, request("shm-a")).await;
    let second = create_on_a_free_port(&provider, request("shm-b")).await;

    let mut services = Vec::new();
    for instance in [&first, &second] {
        let dir = provider.instance_dir(&instance.id.native_id);
        let pids = squids(&dir);
        assert_eq!(pids.len(), 1, "one Squid for {}", instance.id.native_id);
        let service = squid_service(pids[0]).expect("the Squid is started with -n");
        assert_ne!(
            service, "squid",
            "the instance's Squid has a service name of its own"
        );
        assert!(
            !squid_segments(&service).is_empty(),
            "Squid keeps its segments under its own name {service}"
        );
        services.push((instance.id.native_id.clone(), pids[0], service));
    }
    assert_ne!(services[0].2, services[1].2, "two instances, two names");

    // Killed, Squid leaves its segments behind; delete removes them.
    let (name, pid, service) = &services[0];
    kill(*pid);
    provider.delete(name).await.expect("delete");
    assert_eq!(squid_segments(service), Vec::<std::path::PathBuf>::new());
    let (name, _, service) = &services[1];
    provider.delete(name).await.expect("delete");
    assert_eq!(squid_segments(service), Vec::<std::path::PathBuf>::new());
    assert_nothing_left(&backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_leaves_no_process_and_no_folder() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let origin = OriginServer::start().await;
    let mut request = request("delete");
    request.credentials = Some(Credentials {
        username: "crawler".into(),
        password: "pw".into(),
    });
    let instance = create_on_a_free_port(&provider, request).await;
    let name = instance.id.native_id.clone();
    // An authenticated request starts the auth helper: it must go too.
    let response = fetch_via_proxy(proxy_addr(&instance), &origin.url("/"), Some(("crawler", "pw"))).await;
    assert_eq!(response.status, 200, "{response:?}");
    let dir = provider.instance_dir(&name);
    let running = processes_mentioning(&dir);
    assert!(running.len() >= 2, "Squid and its auth helper run: {running:?}");

    provider.delete(&name).await.expect("delete");
    assert!(!dir.exists(), "the folder is gone");
    let gone = holds_within(DEADLINE, async || processes_mentioning(&dir).is_empty()).await;
    assert!(gone, "processes left: {:?}", processes_mentioning(&dir));
    assert!(matches!(
        provider.get(&name).await,
        Err(ProviderError::NotFound(_))
    ));
    assert_nothing_left(&backend);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_operator_adopts_the_running_squid() {
    let backend = LocalBackend::new();
    let request = request("restart");
    let name = request.name.clone();
    let (first, pid) = {
        let provider = backend.provider();
        let instance = create_on_a_free_port(&provider, request.clone()).await;
        let squids = squids(&provider.instance_dir(&name));
        assert_eq!(squids.len(), 1);
        (instance, squids[0])
        // The provider is dropped: its supervisor stops, Squid runs on in its own session.
    };
    // The new process may be configured differently: here it advertises another address.
    let provider = LocalProvider::new(
        "local",
        LocalSettings {
            advertise_address: Some("192.0.2.10".into()),
            ..backend.state.settings()
        },
    )
    .expect("valid settings");
    let found = provider.get(&name).await.expect("found after restart");
    assert_eq!(found.state, InstanceState::Running);
    let endpoint = found.endpoint.clone().expect("endpoint");
    assert_eq!(
        endpoint.host, "192.0.2.10",
        "advertiseAddress is what crawlers are told"
    );
    assert_eq!(
        (found.id.clone(), found.created_at),
        (first.id.clone(), first.created_at)
    );
    // A supervision pass and a repeated create neither start nor restart anything.
    provider.supervise_now().await;
    let again = provider
        .create(&InstanceRequest {
            port: first.endpoint.as_ref().expect("endpoint").port,
            ..request
        })
        .await
        .expect("create again");
    assert_eq!(again.id, first.id);
    assert_eq!(
        squids(&provider.instance_dir(&name)),
        [pid],
        "the same single Squid"
    );
    assert!(provider.supervision(&name).is_none(), "no restart was needed");
    provider.delete(&name).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_probe_report_instances_and_an_unreadable_owner_is_kept_from_gc() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let a = create_on_a_free_port(&provider, request("list-a")).await;
    let b = create_on_a_free_port(&provider, request("list-b")).await;
    let report = provider.probe().await.expect("probe");
    assert_eq!(report.instance_count, 2);
    assert!(
        report.detail.contains("Squid Cache: Version"),
        "{}",
        report.detail
    );
    assert!(report.detail.contains("2 running"), "{}", report.detail);

    // A damaged owner record: the instance is still listed (it exists), but without an
    // owner, so orphan GC never touches it.
    let owner_file = provider.instance_dir(&b.id.native_id).join("owner.json");
    std::fs::write(&owner_file, b"{ not json").expect("damage");
    let listed = provider.list().await.expect("list");
    let ids: Vec<_> = listed
        .iter()
        .map(|i| (i.id.native_id.as_str(), i.owner.is_some()))
        .collect();
    let mut expected = vec![(a.id.native_id.as_str(), true), (b.id.native_id.as_str(), false)];
    expected.sort();
    assert_eq!(ids, expected);
    // Foreign folders and files in the state folder are not instances.
    std::fs::create_dir(backend.state.path().join("not-ours")).expect("mkdir");
    std::fs::write(backend.state.path().join("stray.txt"), b"x").expect("write");
    assert_eq!(provider.list().await.expect("list").len(), 2);
    assert!(matches!(
        provider.get("not-ours").await,
        Err(ProviderError::NotFound(_))
    ));
    // Never deleted, never adopted.
    provider
        .delete("not-ours")
        .await
        .expect("nothing of ours to delete");
    assert!(
        backend.state.path().join("not-ours").exists(),
        "a foreign folder is left alone"
    );
    let mut in_the_way = plain_request(new_owner("in-the-way"), free_port());
    in_the_way.name = "not-ours".into();
    assert!(matches!(
        provider.create(&in_the_way).await,
        Err(ProviderError::Misconfigured(message)) if message.contains("in the way")
    ));
    provider.delete(&a.id.native_id).await.expect("delete a");
    provider.delete(&b.id.native_id).await.expect("delete b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_builds_local_instances_from_the_providers_config() {
    let state = StateDir::new();
    let text = format!(
        "providers:\n  - name: here\n    type: local\n    settings: {{stateDir: {}}}\n",
        state.path().display()
    );
    let config = ProvidersConfig::parse(&text).expect("valid config");
    let registry = ProviderRegistry::from_config(&config).expect("builds");
    let provider = registry.get("here").expect("configured");
    assert_eq!((provider.provider_type(), provider.instance()), ("local", "here"));
    let unknown = registry.get("elsewhere").err().expect("unknown name");
    assert!(unknown.to_string().contains("\"elsewhere\""), "{unknown}");

    // The standalone sample: a relative stateDir, resolved against the working directory.
    let sample =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/samples/standalone/providers.yaml");
    let standalone = ProvidersConfig::load(&sample).expect("the standalone sample is valid");
    let registry = ProviderRegistry::from_config(&standalone).expect("the standalone sample builds");
    assert_eq!(registry.get("local").expect("local").provider_type(), "local");

    let shared = format!(
        "{text}  - name: there\n    type: local\n    settings: {{stateDir: {}}}\n",
        state.path().display()
    );
    let config = ProvidersConfig::parse(&shared).expect("valid config");
    assert!(matches!(
        ProviderRegistry::from_config(&config),
        Err(RegistryError::SharedStateDir { .. })
    ));

    // Every type this build has is built, by instance name; kubernetes needs a client.
    let more = format!(
        "{text}  - name: rack\n    type: kvm2\n    settings: {{uri: 'qemu:///system', pool: p, baseImage: b}}\n  - name: rack-cli\n    type: kvm\n    settings: {{uri: 'qemu:///system', pool: p, baseImage: b}}\n"
    );
    let config = ProvidersConfig::parse(&more).expect("valid config");
    let registry = ProviderRegistry::from_config(&config).expect("builds");
    let types: Vec<_> = registry
        .iter()
        .map(|(name, p)| (name, p.provider_type()))
        .collect();
    assert_eq!(types, [("here", "local"), ("rack", "kvm2"), ("rack-cli", "kvm")]);
    let cluster =
        format!("{text}  - name: cluster\n    type: kubernetes\n    settings: {{namespace: n, image: i}}\n");
    let config = ProvidersConfig::parse(&cluster).expect("valid config");
    match ProviderRegistry::from_config(&config) {
        Err(err @ RegistryError::NoKubeClient { .. }) => {
            assert!(err.to_string().contains("kubernetes"), "{err}")
        }
        Err(other) => panic!("expected NoKubeClient, got {other}"),
        Ok(_) => panic!("expected NoKubeClient, got a registry"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_restarts_an_instance_that_died_while_the_operator_was_down() {
    let backend = LocalBackend::new();
    let request = request("died-while-down");
    let name = request.name.clone();
    let first = {
        let provider = backend.provider();
        create_on_a_free_port(&provider, request.clone()).await
    };
    let dir = backend.state.path().join(&name);
    let old = squids(&dir);
    assert_eq!(old.len(), 1);
    kill(old[0]);
    assert!(holds_within(DEADLINE, async || squids(&dir).is_empty()).await);

    // The repeated create (the engine's retry after a crash) finds the folder and starts its
    // Squid at once, before any supervision pass.
    let provider = backend.provider();
    let again = provider
        .create(&InstanceRequest {
            port: first.endpoint.as_ref().expect("endpoint").port,
            ..request
        })
        .await
        .expect("create again");
    assert_eq!(
        (again.id.clone(), again.created_at),
        (first.id.clone(), first.created_at)
    );
    let now = squids(&dir);
    assert!(
        now.len() == 1 && now != old,
        "one new Squid: {now:?} (was {old:?})"
    );
    wait_for_state(&provider, &name, InstanceState::Running).await;
    provider.delete(&name).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_delete_is_never_restarted_and_create_finishes_it() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let request = request("interrupted-delete");
    let name = request.name.clone();
    let first = create_on_a_free_port(&provider, request.clone()).await;
    let dir = provider.instance_dir(&name);
    // A delete that wrote its marker and stopped Squid, then the operator died.
    std::fs::write(dir.join("deleting"), b"").expect("marker");
    kill(squids(&dir)[0]);
    assert!(holds_within(DEADLINE, async || squids(&dir).is_empty()).await);
    provider.supervise_now().await;
    assert!(
        squids(&dir).is_empty(),
        "supervision does not restart a deleting instance"
    );
    let found = provider.get(&name).await.expect("still exists");
    assert_eq!(found.state, InstanceState::Stopped);

    let created = create_on_a_free_port(&provider, request).await;
    assert_eq!(created.id, first.id);
    assert!(
        created.created_at > first.created_at,
        "a fresh instance, not the half-deleted one"
    );
    assert_eq!(created.state, InstanceState::Running);
    assert!(!dir.join("deleting").exists());
    assert_eq!(squids(&dir).len(), 1);
    provider.delete(&name).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listens_on_ipv6_loopback() {
    let backend = LocalBackend::new();
    let provider = backend.provider();
    let origin = OriginServer::start().await;
    let port = std::net::TcpListener::bind("[::1]:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on ::1")
        .port();
    let mut request = request("ipv6");
    request.placement.address = Some("::1".into());
    request.port = port;
    let instance = create_on_a_free_port(&provider, request).await;
    let endpoint = instance.endpoint.clone().expect("endpoint");
    assert_eq!(endpoint.to_string(), format!("[::1]:{port}"));
    let response = fetch_via_proxy(
        SocketAddr::from(([0u16, 0, 0, 0, 0, 0, 0, 1], port)),
        &origin.url("/v6"),
        None,
    )
    .await;
    assert_eq!(response.status, 200, "{response:?}");
    provider.delete(&instance.id.native_id).await.expect("delete");
}
