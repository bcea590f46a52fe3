//! The `kvm2` (libvirt API) and `kvm` (virsh) providers against a real libvirt QEMU driver: a
//! private, unprivileged `libvirtd` each test starts (see `support/libvirtd.rs`), with a dir
//! storage pool in its folder, a 16 MiB qcow2 base image without an OS, domains of type `qemu`
//! (TCG) on user-mode networking with a host forward. Guests start and run firmware but boot
//! nothing: the contract is about domains, volumes and stamps, not about Squid (that is the
//! real-VM suite's job).

#[path = "support/libvirt_requests.rs"]
mod libvirt_requests;
#[path = "support/libvirtd.rs"]
mod libvirtd;

#[allow(dead_code)]
#[macro_use]
mod support {
    #[macro_use]
    pub mod contract;
    pub mod libvirt_contract;
}

use std::{
    net::TcpStream,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use egress_proxies_operator::{
    config::{BootSettings, KvmSettings, NetworkSettings},
    provider::{
        InstanceRequest, InstanceState, Provider, ProviderError, kvm::KvmProvider, kvm2::Kvm2Provider,
    },
};
use libvirt_requests::{request, request_for, settings, user_network};
use libvirtd::PrivateLibvirtd;

const POOL: &str = "epo";

/// A daemon with pool `epo` holding `base.qcow2`.
fn daemon() -> (PrivateLibvirtd, PathBuf) {
    let daemon = PrivateLibvirtd::start();
    let pool = daemon.dir_pool_with_base(POOL, "base.qcow2");
    (daemon, pool)
}

fn kvm2(daemon: &PrivateLibvirtd, settings: KvmSettings) -> Box<dyn Provider> {
    let _ = daemon;
    Box::new(Kvm2Provider::new("kvm2-real", settings))
}

fn kvm(daemon: &PrivateLibvirtd, settings: KvmSettings) -> Box<dyn Provider> {
    let _ = daemon;
    Box::new(KvmProvider::new("kvm-real", settings))
}

type Make = fn(&PrivateLibvirtd, KvmSettings) -> Box<dyn Provider>;

/// `isoinfo` extraction of `file` (Rock Ridge name) from an ISO.
fn iso_file(iso: &Path, file: &str) -> String {
    let output = Command::new("isoinfo")
        .args(["-R", "-i"])
        .arg(iso)
        .args(["-x", file])
        .output()
        .expect("run isoinfo");
    assert!(
        output.status.success(),
        "isoinfo: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn iso_label(iso: &Path) -> String {
    let output = Command::new("isoinfo")
        .arg("-d")
        .arg("-i")
        .arg(iso)
        .output()
        .expect("isoinfo");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("Volume id: ").map(str::to_owned))
        .unwrap_or_default()
}

fn qemu_img_info(image: &Path) -> serde_json::Value {
    // -U: the running guest holds the image's write lock.
    let output = Command::new("qemu-img")
        .args(["info", "-U", "--output=json"])
        .arg(image)
        .output()
        .expect("qemu-img info");
    assert!(
        output.status.success(),
        "qemu-img: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON")
}

/// Polls `condition` until it holds or `deadline` passes.
fn eventually(deadline: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    condition()
}

fn our_volumes(daemon: &PrivateLibvirtd, req: &InstanceRequest) -> Vec<String> {
    daemon
        .volumes(POOL)
        .into_iter()
        .filter(|volume| volume.starts_with(&req.name))
        .collect()
}

/// The shared contract suite on a private daemon, one test (and daemon) per property. Each
/// property's guests forward their own block of host ports, so the tests (separate processes
/// under nextest) never race for a port.
fn contract_backend(
    open: fn(KvmSettings) -> Arc<dyn Provider>,
    first_port: u16,
) -> support::libvirt_contract::LibvirtBackend {
    const PROPERTIES: [&str; 6] = [
        "idempotent_create",
        "concurrent_create",
        "truthful_not_found",
        "idempotent_delete",
        "list_reports_ownership",
        "create_after_crash",
    ];
    let test = std::thread::current().name().unwrap_or_default().to_owned();
    let index = PROPERTIES
        .iter()
        .position(|p| test.ends_with(p))
        .unwrap_or_else(|| panic!("test {test:?} is not a contract property"));
    let (daemon, _pool) = daemon();
    let settings = settings(daemon.uri(), POOL, user_network(first_port + 100 * index as u16));
    let uri = daemon.uri().to_owned();
    support::libvirt_contract::LibvirtBackend::new(&uri, move || open(settings.clone()), request_for, daemon)
}

mod kvm2_contract {
    use super::*;

    contract_tests!(contract_backend(
        |s| Arc::new(Kvm2Provider::new("kvm2-real", s)),
        30000
    ));
}

mod kvm_contract {
    use super::*;

    contract_tests!(contract_backend(
        |s| Arc::new(KvmProvider::new("kvm-real", s)),
        30600
    ));
}

/// A close look at what a create made: a running QEMU, a qcow2 overlay on the base image, a
/// `cidata` seed with the merged user-data, a live host forward; and what a delete took away.
async fn artefacts(make: Make, provider_type: &str, ports: u16) {
    let (daemon, pool) = daemon();
    let settings = settings(daemon.uri(), POOL, user_network(ports));
    let provider = make(&daemon, settings.clone());
    let req = request("artefacts");
    let instance = provider.create(&req).await.expect("create");
    assert_eq!(instance.state, InstanceState::Running);
    assert_eq!(
        daemon.virsh_ok(&["domstate", "--domain", &req.name]).trim(),
        "running"
    );
    let disk = pool.join(format!("{}-{provider_type}-disk.qcow2", req.name));
    let seed = pool.join(format!("{}-{provider_type}-seed.iso", req.name));
    let info = qemu_img_info(&disk);
    assert_eq!(info["format"], "qcow2");
    assert_eq!(
        info["backing-filename"]
            .as_str()
            .map(|path| path.ends_with("/epo/base.qcow2")),
        Some(true),
        "{info}"
    );
    assert_eq!(info["virtual-size"], 16 << 20);
    assert_eq!(iso_label(&seed), "cidata");
    let user_data = iso_file(&seed, "/user-data");
    assert!(
        user_data.starts_with("Content-Type: multipart/mixed"),
        "{user_data}"
    );
    assert!(user_data.contains("text/x-not-multipart") && user_data.contains("text/cloud-config"));
    assert!(
        !user_data.contains("not-in-logs"),
        "the proxy password is stored hashed"
    );
    let meta_data = iso_file(&seed, "/meta-data");
    assert!(
        meta_data.contains(&format!("local-hostname: {}", req.name)),
        "{meta_data}"
    );
    // QEMU listens on the forward: the endpoint is reachable from this host.
    let endpoint = instance.endpoint.clone().expect("endpoint");
    assert_eq!(endpoint.host, "127.0.0.1");
    assert!((ports..ports + 100).contains(&endpoint.port));
    TcpStream::connect((endpoint.host.as_str(), endpoint.port)).expect("forward accepts connections");
    let got = provider.get(&req.name).await.expect("get");
    assert_eq!(got.endpoint, Some(endpoint.clone()));

    provider.delete(&req.name).await.expect("delete");
    assert!(!disk.exists() && !seed.exists(), "volume files removed");
    assert!(
        our_volumes(&daemon, &req).is_empty(),
        "delete removed the volumes"
    );
    assert!(!daemon.domains().contains(&req.name), "delete removed the domain");
    assert!(
        eventually(Duration::from_secs(10), || TcpStream::connect((
            endpoint.host.as_str(),
            endpoint.port
        ))
        .is_err()),
        "QEMU stopped: nobody listens on the forward"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm2_makes_a_running_domain_with_overlay_seed_and_forward() {
    artefacts(kvm2, "kvm2", 23000).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm_makes_a_running_domain_with_overlay_seed_and_forward() {
    artefacts(kvm, "kvm", 23100).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm_and_kvm2_on_one_daemon_never_adopt_each_others_domains() {
    let (daemon, _pool) = daemon();
    let kvm2 = kvm2(&daemon, settings(daemon.uri(), POOL, user_network(23200)));
    let kvm = kvm(&daemon, settings(daemon.uri(), POOL, user_network(23300)));
    let for_kvm2 = request("made-by-kvm2");
    let for_kvm = request("made-by-kvm");
    kvm2.create(&for_kvm2).await.expect("kvm2 create");
    kvm.create(&for_kvm).await.expect("kvm create");

    // Each lists only its own.
    let names = |instances: Vec<egress_proxies_operator::provider::Instance>| -> Vec<String> {
        instances.into_iter().map(|i| i.id.native_id).collect()
    };
    assert_eq!(
        names(kvm2.list().await.expect("kvm2 list")),
        vec![for_kvm2.name.clone()]
    );
    assert_eq!(
        names(kvm.list().await.expect("kvm list")),
        vec![for_kvm.name.clone()]
    );
    // Each gets only its own: the other's domain is NotFound to it.
    assert!(matches!(
        kvm2.get(&for_kvm.name).await,
        Err(ProviderError::NotFound(_))
    ));
    assert!(matches!(
        kvm.get(&for_kvm2.name).await,
        Err(ProviderError::NotFound(_))
    ));
    kvm2.get(&for_kvm2.name).await.expect("kvm2 gets its own");
    kvm.get(&for_kvm.name).await.expect("kvm gets its own");
    // Each deletes only its own: deleting the other's name succeeds and changes nothing.
    kvm2.delete(&for_kvm.name)
        .await
        .expect("kvm2 delete of kvm's domain");
    kvm.delete(&for_kvm2.name)
        .await
        .expect("kvm delete of kvm2's domain");
    let domains = daemon.domains();
    assert!(
        domains.contains(&for_kvm.name) && domains.contains(&for_kvm2.name),
        "{domains:?}"
    );
    assert_eq!(our_volumes(&daemon, &for_kvm).len(), 2);
    assert_eq!(our_volumes(&daemon, &for_kvm2).len(), 2);
    // Neither creates over the other's domain of the same name.
    match kvm.create(&for_kvm2).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(message.contains("will not adopt"), "{message}")
        }
        other => panic!("kvm create over kvm2's domain: {other:?}"),
    }
    match kvm2.create(&for_kvm).await {
        Err(ProviderError::Misconfigured(message)) => {
            assert!(message.contains("will not adopt"), "{message}")
        }
        other => panic!("kvm2 create over kvm's domain: {other:?}"),
    }
    assert_eq!(
        daemon.virsh_ok(&["domstate", "--domain", &for_kvm.name]).trim(),
        "running"
    );
    assert_eq!(
        daemon.virsh_ok(&["domstate", "--domain", &for_kvm2.name]).trim(),
        "running"
    );

    kvm2.delete(&for_kvm2.name).await.expect("kvm2 delete");
    kvm.delete(&for_kvm.name).await.expect("kvm delete");
    assert!(daemon.domains().is_empty(), "{:?}", daemon.domains());
    assert_eq!(daemon.volumes(POOL), ["base.qcow2"]);
}

/// A crash after the domain was defined (or after volumes were made): the next create finds
/// and finishes what the first began.
async fn create_finishes_an_interrupted_create(make: Make, provider_type: &str, ports: u16) {
    let (daemon, _pool) = daemon();
    let settings = settings(daemon.uri(), POOL, user_network(ports));
    let req = request("interrupted");
    let first = make(&daemon, settings.clone())
        .create(&req)
        .await
        .expect("create");
    // As if the operator died between define and start.
    daemon.virsh_ok(&["destroy", "--domain", &req.name]);
    let restarted = make(&daemon, settings.clone());
    assert_eq!(
        restarted.get(&req.name).await.expect("get").state,
        InstanceState::Stopped
    );
    let again = restarted.create(&req).await.expect("create after crash");
    assert_eq!(
        again.created_at, first.created_at,
        "the same domain, not a new one"
    );
    assert_eq!(again.state, InstanceState::Running);
    restarted.delete(&req.name).await.expect("delete");

    // Volumes left by an attempt that died before defining the domain are replaced.
    let leftover = request("leftover");
    let disk = format!("{}-{provider_type}-disk.qcow2", leftover.name);
    daemon.virsh_ok(&[
        "vol-create-as",
        "--pool",
        POOL,
        "--name",
        &disk,
        "--capacity",
        "1M",
    ]);
    let made = restarted.create(&leftover).await.expect("create over leftovers");
    assert_eq!(made.state, InstanceState::Running);
    restarted.delete(&leftover.name).await.expect("delete");
    assert_eq!(daemon.volumes(POOL), ["base.qcow2"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm2_create_finishes_an_interrupted_create() {
    create_finishes_an_interrupted_create(kvm2, "kvm2", 23400).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm_create_finishes_an_interrupted_create() {
    create_finishes_an_interrupted_create(kvm, "kvm", 23500).await;
}

/// Bad settings surface as provider errors and leave no domain or volume behind.
async fn bad_input_leaves_nothing(make: Make, ports: u16) {
    let (daemon, _pool) = daemon();
    let good = settings(daemon.uri(), POOL, user_network(ports));
    let mut no_pool = good.clone();
    no_pool.pool = "missing-pool".into();
    let mut no_base = good.clone();
    no_base.base_image = "missing.qcow2".into();
    let mut no_kernel = good.clone();
    no_kernel.boot = BootSettings::Kernel {
        kernel: PathBuf::from("/nonexistent/vmlinuz"),
        initrd: None,
        cmdline: "console=ttyS0".into(),
    };
    let no_network = settings(
        daemon.uri(),
        POOL,
        NetworkSettings::Libvirt {
            name: "nowhere".into(),
        },
    );
    for (settings, misconfigured, expected) in [
        (no_pool, true, "storage pool missing-pool does not exist"),
        (
            no_base,
            true,
            "base image missing.qcow2 is not a volume of storage pool epo",
        ),
        (no_network, true, "libvirt network nowhere does not exist"),
        // The domain is defined but QEMU cannot start it: the failed start is undone.
        (no_kernel, false, "starting domain"),
    ] {
        let provider = make(&daemon, settings);
        let req = request("bad-input");
        let outcome = provider.create(&req).await;
        match (&outcome, misconfigured) {
            (Err(ProviderError::Misconfigured(message)), true)
            | (Err(ProviderError::Backend(message)), false) => {
                assert!(message.contains(expected), "{message}");
                assert!(!message.contains("not-in-logs"), "{message}");
            }
            _ => panic!("expected {expected:?}, got {outcome:?}"),
        }
        assert!(
            daemon.domains().is_empty(),
            "domains left: {:?}",
            daemon.domains()
        );
        assert_eq!(daemon.volumes(POOL), ["base.qcow2"], "volumes left");
    }
    let probe = make(&daemon, {
        let mut settings = good.clone();
        settings.base_image = "missing.qcow2".into();
        settings
    })
    .probe()
    .await;
    assert!(matches!(probe, Err(ProviderError::Misconfigured(_))), "{probe:?}");
    let report = make(&daemon, good).probe().await.expect("probe");
    assert_eq!(report.instance_count, 0);
    assert!(
        report.detail.contains("9.0.0") || report.detail.contains("libvirt"),
        "{}",
        report.detail
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm2_bad_input_is_a_clear_error_and_leaves_nothing() {
    bad_input_leaves_nothing(kvm2, 23600).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kvm_bad_input_is_a_clear_error_and_leaves_nothing() {
    bad_input_leaves_nothing(kvm, 23700).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_libvirt_is_unavailable_quickly() {
    let uri = "qemu+unix:///session?socket=/nonexistent/libvirt-sock";
    let providers: [Box<dyn Provider>; 2] = [
        Box::new(Kvm2Provider::new(
            "kvm2-gone",
            settings(uri, POOL, user_network(23800)),
        )),
        Box::new(KvmProvider::new(
            "kvm-gone",
            settings(uri, POOL, user_network(23900)),
        )),
    ];
    for provider in providers {
        let req = request("unreachable");
        let started = Instant::now();
        let outcomes = [
            provider.create(&req).await.map(|_| ()),
            provider.get(&req.name).await.map(|_| ()),
            provider.delete(&req.name).await,
            provider.list().await.map(|_| ()),
            provider.probe().await.map(|_| ()),
        ];
        for outcome in outcomes {
            match outcome {
                Err(ProviderError::Unavailable(message)) => {
                    assert!(message.contains("/nonexistent/libvirt-sock"), "{message}");
                }
                other => panic!(
                    "{}: expected Unavailable, got {other:?}",
                    provider.provider_type()
                ),
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} took {:?} to give up",
            provider.provider_type(),
            started.elapsed()
        );
    }
}

/// A socket that accepts connections and never answers, as a hung libvirt would.
struct SilentSocket {
    path: PathBuf,
    _folder: tempfile::TempDir,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentSocket {
    fn start() -> Self {
        use std::sync::atomic::Ordering;
        let folder = tempfile::tempdir().expect("temp");
        let path = folder.path().join("silent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stopping.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => held.push(stream),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            // Dropping the connections releases whoever still waits on them.
        });
        Self {
            path,
            _folder: folder,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SilentSocket {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn hung_libvirt_is_unavailable_after_the_timeout() {
    let socket = SilentSocket::start();
    let uri = format!("qemu+unix:///session?socket={}", socket.path.display());
    let mut settings = settings(&uri, POOL, user_network(24200));
    settings.timeout_seconds = 1;
    let providers: [Box<dyn Provider>; 2] = [
        Box::new(Kvm2Provider::new("kvm2-hung", settings.clone())),
        Box::new(KvmProvider::new("kvm-hung", settings)),
    ];
    for provider in &providers {
        let started = Instant::now();
        match provider.list().await {
            Err(ProviderError::Unavailable(message)) => {
                assert!(message.contains("within 1s"), "{message}")
            }
            other => panic!(
                "{}: expected Unavailable, got {other:?}",
                provider.provider_type()
            ),
        }
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(5),
            "{}: gave up after {elapsed:?}",
            provider.provider_type()
        );
    }
    // Closing the socket releases kvm2's blocked thread before the runtime shuts down.
    drop(socket);
}
