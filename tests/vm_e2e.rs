//! Real VMs end to end, as a user runs them: the operator binary in standalone mode drives a
//! Proxy through a `kvm2` (libvirt API) or `kvm` (virsh) provider instance against a private
//! libvirt daemon (`support/libvirtd.rs`: unprivileged, its own socket, QEMU under TCG), which
//! boots the cached Debian guest image (`support/guest_image.rs`) with direct kernel boot,
//! QEMU user-mode networking and the proxy port forwarded from 127.0.0.1. Nothing is scripted:
//! the operator builds the NoCloud seed from the Proxy's cloud-init Secret plus the Squid
//! config it generates (port, `visible_hostname` = instance name, basic auth from the
//! credentials Secret), and the guest's Squid runs on exactly that.
//!
//! What each lifecycle test proves, in order:
//! 1. the operator defines and starts a domain; the guest boots (serial console, logged through
//!    the provider's `consoleLogDir` setting);
//! 2. the health engine's probe goes through the guest's Squid to a loopback server on the host
//!    (the guest sees the host as 10.0.2.2) and carries `Via: 1.1 <instance name>`, the
//!    `visible_hostname` of the generated config; the Proxy becomes Healthy (`status`);
//! 3. a crawler leases the proxy through the discovery API (bearer token) and fetches a page
//!    from the host through the leased proxy with the lease's credentials; without them the
//!    guest's Squid answers 407 (its auth config is the generated one);
//! 4. changing the cloud-init Secret's content replaces the VM: a new spec hash in the status, a
//!    new cloud-init `instance-id` in the new seed, a new domain UUID, the old domain gone;
//! 5. removing the Proxy manifest destroys and undefines the domain and deletes its volumes:
//!    no domain remains and the pool holds only the base image; the operator stops cleanly.
//!
//! `kvm` (virsh) runs the same flow: nothing in it needs the libvirt API.
//!
//! The third test boots a guest whose kernel command line cannot mount the root file system
//! (`rootfstype=xfs` on an ext4 disk, without an xfs driver): the console says why, and the
//! operator reports `ProvisioningTimedOut` with a message naming the timeout
//! (`--provisioning-timeout`), deletes the guest and starts over, until the manifest is removed
//! and everything is cleaned up.
//!
//! Every wait has a deadline; a miss fails with what did not happen and the tails of the
//! guest consoles, the operator log, the libvirtd log, the status table and the audit trail.
//! Guards clean up in every outcome (see `Rig`); full logs of the last run of each test are
//! copied to `target/tmp/vm-e2e/<test>/`. Timings (image build or cache hit, boot, first
//! healthy probe, replacement, deletion) go to stderr and `target/tmp/vm-e2e-timings.txt`.
//!
//! Knobs: `EPO_CACHE_DIR` (guest image cache), `EPO_VM_E2E_BOOT_TIMEOUT_SECS` (default 420:
//! domain start to Healthy, also for the replacement), `EPO_GUEST_ACCEL=kvm` (domain type
//! `kvm` instead of `qemu`). See docs/testing.md.

mod support {
    pub mod blocking_http;
    pub mod guest_image;
    pub mod libvirtd;
    pub mod process;
}

use std::{
    fs,
    io::Write as _,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use egress_proxies_operator::{
    api::ProxyKey,
    provider::libvirt::seed,
    standalone::store::{ProxyRecord, Store},
};
use support::{
    blocking_http::{Origin, get_through_proxy, percent_decode, request},
    guest_image::{default_cache_root, ensure_guest_image, tail_of},
    libvirtd::PrivateLibvirtd,
    process::GroupChild,
};

const BIN: &str = env!("CARGO_BIN_EXE_egress-proxies-operator");

/// The provider instance name in the providers config.
const PROVIDER: &str = "vm";
/// The storage pool and its base image volume (a copy of the guest's root file system).
const POOL: &str = "epo";
const BASE_VOLUME: &str = "rootfs.ext4";
/// The Proxy (namespace `default`).
const PROXY: &str = "vm-1";
/// The attribute crawlers select it by.
const POOL_ATTRIBUTE: &str = "vm-e2e";
/// Squid's port inside the guest.
const GUEST_PORT: u16 = 3128;
/// How the guest reaches the host's loopback in QEMU's user-mode network.
const HOST_FROM_GUEST: &str = "10.0.2.2";
/// The proxy user name in the credentials Secret.
const PROXY_USER: &str = "crawler";

/// The operator's `--provisioning-timeout` for guests that should come up: generous, so a slow
/// boot under load fails the test's own deadline (with diagnostics) rather than churn.
const PROVISIONING_TIMEOUT_SECS: u64 = 900;
/// The same for the guest that cannot boot: short, to see the operator give up.
const BROKEN_PROVISIONING_TIMEOUT_SECS: u64 = 30;

const POLL: Duration = Duration::from_millis(500);
const OPERATOR_START_DEADLINE: Duration = Duration::from_secs(30);
const CREATE_DEADLINE: Duration = Duration::from_secs(90);
const DELETE_DEADLINE: Duration = Duration::from_secs(120);
const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// `kvm` with `EPO_GUEST_ACCEL=kvm` (a host whose CPU virtualises and whose `/dev/kvm` the
/// daemon's user `nobody` may open), else `qemu` (TCG).
fn domain_type() -> &'static str {
    match std::env::var("EPO_GUEST_ACCEL").as_deref() {
        Ok("kvm") => "kvm",
        _ => "qemu",
    }
}

/// Domain start to Healthy (a first boot or a replacement), `EPO_VM_E2E_BOOT_TIMEOUT_SECS`.
fn boot_deadline() -> Duration {
    let secs = match std::env::var("EPO_VM_E2E_BOOT_TIMEOUT_SECS") {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("EPO_VM_E2E_BOOT_TIMEOUT_SECS={value:?} is not a number")),
        Err(_) => 420,
    };
    Duration::from_secs(secs)
}

#[test]
fn kvm2_proxy_vm_lives_through_create_lease_replace_and_delete() {
    lifecycle("kvm2_lifecycle", "kvm2");
}

#[test]
fn kvm_proxy_vm_lives_through_create_lease_replace_and_delete() {
    lifecycle("kvm_lifecycle", "kvm");
}

#[test]
fn kvm2_guest_that_cannot_boot_is_reported_and_cleaned_up() {
    let mut rig = Rig::new(
        "kvm2_cannot_boot",
        "kvm2",
        // The disk is ext4 and the initramfs has no xfs driver: mounting the root fails.
        Some("root=/dev/vda rootfstype=xfs rw console=ttyS0"),
    );
    rig.write_secrets(1);
    rig.write_proxy();
    rig.start_operator(BROKEN_PROVISIONING_TIMEOUT_SECS);
    let started = Instant::now();
    let domain = rig.wait_for(
        "the operator to start the proxy's domain",
        CREATE_DEADLINE,
        |rig| rig.running_domain(),
    );
    rig.timings
        .record("domain running (operator start)", started.elapsed(), "");

    // The console (the provider's consoleLogDir) tells why the guest never serves.
    let console = rig.wait_for(
        "the guest's console to report the failed root mount",
        boot_deadline(),
        |rig| {
            let log = rig.console_log(&domain);
            log.contains("Failed to mount /dev/vda as root file system")
                .then_some(log)
        },
    );
    rig.timings
        .record("console shows the failed mount", started.elapsed(), "");
    assert!(
        !console.contains("login:"),
        "the guest must not have booted:\n{}",
        tail(&console, 30)
    );

    // The operator gives up on the instance at its provisioning timeout and says so.
    let timed_out = rig.wait_for(
        "the operator to report ProvisioningTimedOut",
        Duration::from_secs(BROKEN_PROVISIONING_TIMEOUT_SECS) + CREATE_DEADLINE,
        |rig| {
            rig.audit()
                .lines()
                .find(|line| line.contains("provisioning --timer_expired--> replacing"))
                .map(str::to_owned)
        },
    );
    rig.timings.record(
        "ProvisioningTimedOut reported (operator start)",
        started.elapsed(),
        &format!(" (--provisioning-timeout {BROKEN_PROVISIONING_TIMEOUT_SECS})"),
    );
    assert!(
        timed_out.contains("(ProvisioningTimedOut)")
            && timed_out.contains(&format!(
                "provisioning_timeout ({BROKEN_PROVISIONING_TIMEOUT_SECS} s) ran out in provisioning"
            )),
        "the audit names the reason and the timeout: {timed_out}"
    );
    let audit = rig.audit();
    assert!(!audit.contains("--> healthy"), "never healthy:\n{audit}");
    assert!(
        !rig.origin.seen().iter().any(|seen| seen.path == "/health"),
        "no probe got through a guest that never booted"
    );
    // It starts over with a fresh instance (the timeout repeats until the user acts); the
    // console log keeps the failed boot's messages for the user to read.
    rig.wait_for(
        "the operator to create a fresh instance",
        CREATE_DEADLINE,
        |rig| {
            let recreated = rig
                .audit()
                .contains("replacing --instance_missing [spec_valid]--> provisioning");
            (recreated && rig.running_domain().is_some()).then_some(())
        },
    );
    assert!(
        rig.console_log(&domain)
            .contains("Failed to mount /dev/vda as root file system"),
        "the recreated domain's console log keeps the failed boot"
    );

    // The user gives up: removing the manifest removes everything.
    rig.delete_proxy_and_check_cleanup(&domain);
    rig.stop_operator();
}

/// The whole lifecycle of one proxy VM through provider type `provider_type`.
fn lifecycle(test: &'static str, provider_type: &'static str) {
    let mut rig = Rig::new(test, provider_type, None);
    rig.write_secrets(1);
    rig.write_proxy();
    rig.start_operator(PROVISIONING_TIMEOUT_SECS);

    // 1. Create and boot.
    let started = Instant::now();
    let domain = rig.wait_for(
        "the operator to start the proxy's domain",
        CREATE_DEADLINE,
        |rig| rig.running_domain(),
    );
    let running = Instant::now();
    rig.timings
        .record("domain running (operator start)", started.elapsed(), "");
    // The status is written when the create call returns, a moment after the domain runs.
    let provider_id = rig.wait_for("the status to record the provider ID", CREATE_DEADLINE, |rig| {
        rig.record()?.status?.provider_id
    });
    assert_eq!(
        provider_id,
        format!("{provider_type}/{PROVIDER}/{domain}"),
        "the status's provider ID names the provider instance and the domain"
    );

    // 2. The guest boots and the health engine's probe reaches the host through its Squid.
    let probe = rig.wait_for_boot_and_probe(&domain, running, "first boot");
    let via = probe.header("via").unwrap_or_default().to_owned();
    assert!(
        via.starts_with(&format!("1.1 {domain}")),
        "the probe went through the guest's Squid, which runs the generated config \
         (visible_hostname {domain}): Via {via:?}"
    );
    assert!(
        probe.header("proxy-authorization").is_none(),
        "Squid consumed the probe's credentials"
    );
    rig.wait_for("the Proxy to become Healthy", boot_deadline(), |rig| {
        (rig.phase().as_deref() == Some("healthy")).then_some(())
    });
    rig.timings
        .record("Healthy in status (domain running)", running.elapsed(), "");
    let endpoint = rig
        .endpoint()
        .unwrap_or_else(|| rig.fail("a Healthy proxy has an endpoint"));
    assert!(
        endpoint.starts_with("127.0.0.1:"),
        "the endpoint is the loopback host forward: {endpoint}"
    );
    let first = rig.record().and_then(|r| r.status).unwrap_or_default();
    let first_hash = first.spec_hash.clone().unwrap_or_default();

    // 3. A crawler leases it and fetches through it.
    let (code, lease) = rig.api(
        "POST",
        "/v1/leases",
        &format!(r#"{{"selector":{{"pool":"{POOL_ATTRIBUTE}"}},"holder":"crawler-1","ttlSeconds":120}}"#),
    );
    assert_eq!(code, 201, "lease acquired: {lease}");
    let proxy_url = lease["proxyUrl"].as_str().unwrap_or_default();
    let (user, password, address) = split_proxy_url(proxy_url);
    assert_eq!(address, endpoint, "the lease hands out the proxy's endpoint");
    assert_eq!(
        (user.as_str(), password.as_str()),
        (PROXY_USER, rig.password.as_str()),
        "the lease carries the proxy's credentials"
    );
    let proxy: SocketAddr = address.parse().expect("an IP endpoint");
    let url = format!(
        "http://{HOST_FROM_GUEST}:{}/fetched-by-crawler-1",
        rig.origin.port
    );
    let fetched = get_through_proxy(proxy, &url, Some((&user, &password)))
        .unwrap_or_else(|err| rig.fail(&format!("fetch through the leased proxy: {err}")));
    assert_eq!(fetched.status, 200, "{fetched:?}");
    assert_eq!(fetched.body, rig.origin.body_for("/fetched-by-crawler-1"));
    let forwarded = rig
        .origin
        .seen()
        .into_iter()
        .rfind(|seen| seen.path == "/fetched-by-crawler-1")
        .unwrap_or_else(|| rig.fail("the host server did not see the crawler's request"));
    assert!(
        forwarded
            .header("via")
            .is_some_and(|via| via.starts_with(&format!("1.1 {domain}"))),
        "the crawler's request went through the guest: {forwarded:?}"
    );
    let refused = get_through_proxy(proxy, &url, None)
        .unwrap_or_else(|err| rig.fail(&format!("fetch without credentials: {err}")));
    assert_eq!(
        refused.status, 407,
        "the guest's Squid requires the Proxy's credentials"
    );
    let lease_id = lease["leaseId"].as_str().unwrap_or_default();
    let (code, released) = rig.api(
        "POST",
        &format!("/v1/leases/{lease_id}/release"),
        &format!(r#"{{"fencingToken":{},"outcome":"ok"}}"#, lease["fencingToken"]),
    );
    assert_eq!(code, 200, "lease released: {released}");

    // 4. New cloud-init content replaces the VM.
    let old_uuid = rig
        .libvirtd
        .domain_uuid(&domain)
        .unwrap_or_else(|| rig.fail("the running domain has a UUID"));
    let rotated = Instant::now();
    rig.write_secrets(2);
    let (new_uuid, new_hash) = rig.wait_for(
        "the old domain to be replaced by a new one",
        CREATE_DEADLINE + DELETE_DEADLINE,
        |rig| {
            let uuid = rig.libvirtd.domain_uuid(&domain)?;
            let hash = rig.record()?.status?.spec_hash?;
            (uuid != old_uuid && hash != first_hash && rig.running_domain().is_some()).then_some((uuid, hash))
        },
    );
    let replaced_running = Instant::now();
    rig.timings.record(
        "old domain replaced, new running (Secret changed)",
        rotated.elapsed(),
        "",
    );
    assert!(
        !rig.libvirtd.has_domain_uuid(&old_uuid),
        "the old domain ({old_uuid}) is gone from libvirt"
    );
    assert_ne!(new_uuid, old_uuid);
    // The new seed gives cloud-init a new instance-id, so it configures the new guest afresh.
    let meta_data = rig.seed_file(&domain, "/meta-data");
    assert_eq!(meta_data, seed::meta_data(&domain, &new_hash), "the new seed");
    assert_ne!(
        meta_data,
        seed::meta_data(&domain, &first_hash),
        "a new instance-id"
    );
    let probes_before = rig.origin.seen().len();
    rig.wait_for_probe_after(&domain, probes_before, replaced_running, "replacement");
    rig.wait_for("the replaced Proxy to become Healthy", boot_deadline(), |rig| {
        let healthy = rig.phase().as_deref() == Some("healthy");
        let current = rig.record()?.status?.spec_hash? == new_hash;
        (healthy && current).then_some(())
    });
    rig.timings
        .record("replacement Healthy (Secret changed)", rotated.elapsed(), "");
    let audit = rig.audit();
    for step in [
        "healthy --spec_hash_changed--> replacing",
        "replacing --instance_missing [spec_valid]--> provisioning",
    ] {
        assert!(audit.contains(step), "audit shows {step:?}:\n{audit}");
    }
    // Passed, or recovered when probes failed while the guest booted: either way, once per
    // instance.
    let became_healthy = audit
        .lines()
        .filter(|line| line.contains("provisioning --health_passed--> healthy"))
        .count();
    assert_eq!(became_healthy, 2, "healthy twice, once per instance:\n{audit}");

    // 5. Removing the manifest removes the VM and its volumes.
    rig.delete_proxy_and_check_cleanup(&domain);
    rig.stop_operator();
    rig.assert_no_qemu_left();
}

/// `http://user:password@host:port` → (user, password, host:port), percent-decoded.
fn split_proxy_url(url: &str) -> (String, String, String) {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let (userinfo, address) = rest
        .rsplit_once('@')
        .unwrap_or_else(|| panic!("proxy URL {url:?} carries no credentials"));
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    (
        percent_decode(user),
        percent_decode(password),
        address.trim_end_matches('/').to_owned(),
    )
}

/// Everything one test runs: the private daemon with its pool, the operator's folder, the
/// loopback origin and the operator. Dropping it (in every outcome) kills the operator, saves
/// the logs to `target/tmp/vm-e2e/<test>/`, then stops the daemon, which kills the QEMU
/// processes it started and removes its folder (pool, volumes and the operator's folder with it).
struct Rig {
    test: &'static str,
    provider_type: &'static str,
    /// First field: dropped (killed) first, so nothing acts on libvirt while it goes.
    operator: Option<GroupChild>,
    origin: Origin,
    /// The operator's folder (manifests, providers config, state, log), inside the daemon's
    /// folder so that it goes with it, also when a killed test's folder is reaped.
    work: PathBuf,
    console_dir: PathBuf,
    pool_dir: PathBuf,
    api_port: u16,
    password: String,
    timings: Timings,
    /// Last field: dropped last.
    libvirtd: PrivateLibvirtd,
}

impl Rig {
    /// The daemon, a pool with the guest image, and the operator's folder with a providers
    /// config for a `provider_type` instance booting with `cmdline` (the image's by default).
    fn new(test: &'static str, provider_type: &'static str, cmdline: Option<&str>) -> Self {
        let mut timings = Timings::new(test);
        let image =
            ensure_guest_image(&default_cache_root()).unwrap_or_else(|err| panic!("guest image: {err}"));
        timings.record(
            if image.built {
                "guest image built"
            } else {
                "guest image from cache"
            },
            image.build_time,
            &format!(" ({})", image.rootfs.display()),
        );

        let prepared = Instant::now();
        let libvirtd = PrivateLibvirtd::start();
        // QEMU runs as the daemon's user: the kernel and the image must be where it reads.
        let images = libvirtd.nobody_folder("images");
        for file in [&image.kernel, &image.initrd] {
            let name = file.file_name().expect("a file name");
            fs::copy(file, images.join(name)).expect("copy the kernel and initrd");
        }
        let console_dir = libvirtd.nobody_folder("console");
        let pool_dir = libvirtd.dir_pool_with_copy(POOL, BASE_VOLUME, &image.rootfs);
        timings.record("libvirtd started, pool with the image", prepared.elapsed(), "");

        let origin = Origin::start("vm-e2e-origin");
        let work = libvirtd.root().join("operator");
        fs::create_dir_all(work.join("manifests")).expect("the operator's folder");
        // A block of 200 ports below the ephemeral range (which cannot be bound here), picked
        // at random so parallel runs rarely meet; the provider takes one that is free.
        let first_port = 20_000 + 200 * fastrand::u16(0..50);
        let cmdline = cmdline.map_or_else(|| image.cmdline.clone(), str::to_owned);
        let providers = format!(
            "providers:\n\
             \x20 - name: {PROVIDER}\n\
             \x20   type: {provider_type}\n\
             \x20   settings:\n\
             \x20     uri: \"{uri}\"\n\
             \x20     pool: {POOL}\n\
             \x20     baseImage: {BASE_VOLUME}\n\
             \x20     boot:\n\
             \x20       mode: kernel\n\
             \x20       kernel: {kernel}\n\
             \x20       initrd: {initrd}\n\
             \x20       cmdline: \"{cmdline}\"\n\
             \x20     network:\n\
             \x20       mode: user\n\
             \x20       hostForwardAddress: 127.0.0.1\n\
             \x20       hostForwardPorts: {{first: {first_port}, last: {last_port}}}\n\
             \x20     domainType: {domain_type}\n\
             \x20     memoryMib: 512\n\
             \x20     vcpus: 1\n\
             \x20     consoleLogDir: {console}\n\
             \x20     timeoutSeconds: 60\n",
            uri = libvirtd.uri(),
            domain_type = domain_type(),
            kernel = images.join("vmlinuz").display(),
            initrd = images.join("initrd.img").display(),
            last_port = first_port + 199,
            console = console_dir.display(),
        );
        fs::write(work.join("providers.yaml"), providers).expect("providers config");
        Self {
            test,
            provider_type,
            operator: None,
            origin,
            work,
            console_dir,
            pool_dir,
            api_port: free_port(),
            password: format!("pw-{:016x}", fastrand::u64(..)),
            timings,
            libvirtd,
        }
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.work.join(relative)
    }

    /// The cloud-init Secret (content revision `revision`) and the credentials Secret.
    fn write_secrets(&self, revision: u32) {
        let secrets = format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: guest-cloud-init\n  labels:\n    \
             crawl.example.com/cloud-init: \"true\"\nstringData:\n  user-data: |\n    \
             #cloud-config\n    bootcmd:\n      - echo 'vm-e2e revision {revision}' > /run/vm-e2e-revision\n\
             ---\n\
             apiVersion: v1\nkind: Secret\nmetadata:\n  name: proxy-credentials\nstringData:\n  \
             username: {PROXY_USER}\n  password: {}\n",
            self.password
        );
        // Written aside and renamed: the operator never reads half a file.
        let staging = self.path("secrets.yaml.new");
        fs::write(&staging, secrets).expect("write secrets");
        fs::rename(&staging, self.path("manifests/secrets.yaml")).expect("rename secrets");
    }

    fn write_proxy(&self) {
        let proxy = format!(
            "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata:\n  name: {PROXY}\nspec:\n  \
             provider: {PROVIDER}\n  port: {GUEST_PORT}\n  cloudInit:\n    secretRef:\n      \
             name: guest-cloud-init\n  auth:\n    secretRef:\n      name: proxy-credentials\n  \
             attributes:\n    pool: {POOL_ATTRIBUTE}\n  lease:\n    maxConcurrent: 1\n  health:\n    \
             url: http://{HOST_FROM_GUEST}:{}/health\n    intervalSeconds: 3\n    timeoutSeconds: 2\n    \
             failureThreshold: 3\n",
            self.origin.port
        );
        fs::write(self.path("manifests/proxy.yaml"), proxy).expect("write the Proxy");
    }

    fn start_operator(&mut self, provisioning_timeout_secs: u64) {
        let operator = start_operator(&self.work, self.api_port, provisioning_timeout_secs);
        self.operator = Some(operator);
        self.wait_for("the operator to start", OPERATOR_START_DEADLINE, |rig| {
            rig.operator_log()
                .contains("standalone mode running")
                .then_some(())
        });
    }

    /// SIGTERM, then a clean exit within the deadline.
    fn stop_operator(&mut self) {
        let Some(mut operator) = self.operator.take() else {
            return;
        };
        let status = operator.terminate(STOP_DEADLINE);
        match status {
            Some(status) if status.success() => {}
            Some(status) => self.fail(&format!("the operator exited with {status} on SIGTERM")),
            None => self.fail(&format!(
                "the operator did not stop within {STOP_DEADLINE:?} of SIGTERM"
            )),
        }
    }

    fn operator_log(&self) -> String {
        fs::read_to_string(self.path("operator.log")).unwrap_or_default()
    }

    /// Polls `probe` until it yields, the operator exits, or `within` passes; the last two
    /// fail the test with diagnostics.
    fn wait_for<T>(&mut self, what: &str, within: Duration, mut probe: impl FnMut(&Self) -> Option<T>) -> T {
        let deadline = Instant::now() + within;
        loop {
            if let Some(found) = probe(self) {
                return found;
            }
            if let Some(status) = self.operator.as_mut().and_then(GroupChild::exited) {
                self.fail(&format!(
                    "the operator exited ({status}) while waiting for {what}"
                ));
            }
            if Instant::now() >= deadline {
                self.fail(&format!("timed out after {within:?} waiting for {what}"));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits for the first health probe through the guest's Squid on domain `domain` (running
    /// since `running`), noting when its console first showed a login prompt; returns the
    /// probe as the origin saw it.
    fn wait_for_boot_and_probe(
        &mut self,
        domain: &str,
        running: Instant,
        label: &str,
    ) -> support::blocking_http::Seen {
        let mut booted: Option<Duration> = None;
        let probe = self.wait_for(
            &format!("a health probe through the guest's Squid ({label})"),
            boot_deadline(),
            |rig| {
                if booted.is_none() && rig.console_log(domain).contains("login:") {
                    booted = Some(running.elapsed());
                }
                rig.origin.seen().into_iter().find(|seen| seen.path == "/health")
            },
        );
        let probed = running.elapsed();
        match booted {
            Some(boot) => self
                .timings
                .record(&format!("guest boot to login prompt ({label})"), boot, ""),
            None => self.timings.record(
                &format!("guest boot ({label})"),
                probed,
                " (no login prompt seen before the probe)",
            ),
        }
        self.timings
            .record(&format!("first healthy probe ({label})"), probed, "");
        probe
    }

    /// Waits for a health probe newer than the first `seen` requests, through domain
    /// `domain`'s Squid.
    fn wait_for_probe_after(&mut self, domain: &str, seen: usize, running: Instant, label: &str) {
        let via = format!("1.1 {domain}");
        self.wait_for(
            &format!("a health probe through the new guest ({label})"),
            boot_deadline(),
            |rig| {
                rig.origin
                    .seen()
                    .into_iter()
                    .skip(seen)
                    .find(|s| s.path == "/health" && s.header("via").is_some_and(|v| v.starts_with(&via)))
            },
        );
        self.timings
            .record(&format!("first healthy probe ({label})"), running.elapsed(), "");
    }

    /// Removes the Proxy manifest and waits until the operator removed its record, the domain
    /// and its volumes; the pool then holds only the base image.
    fn delete_proxy_and_check_cleanup(&mut self, domain: &str) {
        let removed = Instant::now();
        fs::remove_file(self.path("manifests/proxy.yaml")).expect("remove the Proxy manifest");
        self.wait_for("the operator to delete the Proxy", DELETE_DEADLINE, |rig| {
            let table = rig.status_table()?;
            (!table
                .lines()
                .any(|line| line.split_whitespace().nth(1) == Some(PROXY)))
            .then_some(())
        });
        let domains = self.libvirtd.domains();
        assert!(domains.is_empty(), "no domain remains: {domains:?}");
        assert!(self.libvirtd.domain_uuid(domain).is_none());
        let volumes = self.libvirtd.volumes(POOL);
        assert_eq!(volumes, [BASE_VOLUME], "the pool holds only the base image");
        let files: Vec<String> = fs::read_dir(&self.pool_dir)
            .expect("pool folder")
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            files,
            [BASE_VOLUME],
            "no file besides the base image in the pool folder"
        );
        let audit = self.audit();
        assert!(
            audit.contains("--deletion_requested--> deleting") && audit.contains("--> deleted"),
            "{audit}"
        );
        self.timings.record(
            "deletion: domain and volumes gone (manifest removed)",
            removed.elapsed(),
            "",
        );
    }

    fn assert_no_qemu_left(&self) {
        let root = self.libvirtd.root().to_string_lossy().into_owned();
        let left: Vec<String> = fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let cmdline = fs::read(entry.path().join("cmdline")).ok()?;
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                (cmdline.contains("qemu-system") && cmdline.contains(&root)).then_some(cmdline)
            })
            .collect();
        assert!(left.is_empty(), "QEMU processes left: {left:?}");
    }

    /// The single running domain, if there is exactly one and it runs.
    fn running_domain(&self) -> Option<String> {
        let domains = self.libvirtd.domains();
        let [domain] = domains.as_slice() else {
            return None;
        };
        let state = self.libvirtd.virsh(&["domstate", "--domain", domain]);
        (String::from_utf8_lossy(&state.stdout).trim() == "running").then(|| domain.clone())
    }

    fn console_log(&self, domain: &str) -> String {
        fs::read_to_string(self.console_dir.join(format!("{domain}.console.log"))).unwrap_or_default()
    }

    /// `file` of the seed volume of `domain` (made by this test's provider type).
    fn seed_file(&self, domain: &str, file: &str) -> String {
        let volume = format!("{domain}-{}-seed.iso", self.provider_type);
        let copy = self.path("seed-copy.iso");
        let _ = fs::remove_file(&copy);
        self.libvirtd.virsh_ok(&[
            "vol-download",
            "--pool",
            POOL,
            "--vol",
            &volume,
            "--file",
            copy.to_str().expect("UTF-8 path"),
        ]);
        let output = Command::new("isoinfo")
            .args(["-R", "-i"])
            .arg(&copy)
            .args(["-x", file])
            .output()
            .expect("run isoinfo");
        assert!(
            output.status.success(),
            "isoinfo: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        // The seed holds the proxy credentials' hash: no copy stays behind.
        let _ = fs::remove_file(&copy);
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// `status --state state`, or `None` before the operator made its state folder.
    fn status_table(&self) -> Option<String> {
        let output = Command::new(BIN)
            .current_dir(&self.work)
            .args(["status", "--state", "state"])
            .stdin(Stdio::null())
            .output()
            .expect("run status");
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn row(&self) -> Option<Vec<String>> {
        let table = self.status_table()?;
        table
            .lines()
            .map(|line| line.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .find(|cells| cells.get(1).map(String::as_str) == Some(PROXY))
    }

    /// The Proxy's phase in the `status` table.
    fn phase(&self) -> Option<String> {
        self.row()?.get(2).cloned()
    }

    /// The Proxy's endpoint in the `status` table.
    fn endpoint(&self) -> Option<String> {
        self.row()?.get(4).cloned().filter(|endpoint| endpoint != "-")
    }

    /// The Proxy's record (status included) as `status` reads it.
    fn record(&self) -> Option<ProxyRecord> {
        let store = Store::read_only(&self.path("state")).ok()?;
        store.get(&ProxyKey::new("default", PROXY)).ok()?
    }

    /// `status --audit`: the Proxy's audit trail.
    fn audit(&self) -> String {
        let output = Command::new(BIN)
            .current_dir(&self.work)
            .args(["status", "--state", "state", "--audit", PROXY])
            .stdin(Stdio::null())
            .output()
            .expect("run status --audit");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// One discovery API call with the operator's bearer token.
    fn api(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let token = fs::read_to_string(self.path("state/discovery-tokens")).expect("the operator's token");
        let address: SocketAddr = ([127, 0, 0, 1], self.api_port).into();
        let response = request(
            address,
            method,
            path,
            &[
                ("Authorization", format!("Bearer {}", token.trim())),
                ("Content-Type", "application/json".to_owned()),
            ],
            body,
        )
        .unwrap_or_else(|err| self.fail(&format!("discovery API {method} {path}: {err}")));
        (
            response.status,
            serde_json::from_str(&response.body).unwrap_or(serde_json::Value::Null),
        )
    }

    /// Fails the test with `what` and what there is to see.
    fn fail(&self, what: &str) -> ! {
        panic!("{what}\n{}", self.diagnostics());
    }

    fn diagnostics(&self) -> String {
        let mut out = String::new();
        let section = |out: &mut String, title: &str, body: &str| {
            out.push_str(&format!("--- {title} ---\n{}\n", body.trim_end()));
        };
        section(
            &mut out,
            "status",
            &self.status_table().unwrap_or_else(|| "(no state yet)".into()),
        );
        section(&mut out, "audit", &self.audit());
        section(
            &mut out,
            "libvirt domains",
            &format!("{:?}", self.libvirtd.domains()),
        );
        if let Ok(entries) = fs::read_dir(&self.console_dir) {
            for entry in entries.flatten() {
                section(
                    &mut out,
                    &format!("console {} (last 40 lines)", entry.file_name().to_string_lossy()),
                    &tail_of(&entry.path(), 40),
                );
            }
        }
        section(
            &mut out,
            "operator log (last 60 lines)",
            &tail_of(&self.path("operator.log"), 60),
        );
        section(
            &mut out,
            "libvirtd log (last 20 lines)",
            &tail(&self.libvirtd.log(), 20),
        );
        out.push_str(&format!("(full logs: {})\n", saved_logs_dir(self.test).display()));
        out
    }

    /// Copies the logs of this run to `target/tmp/vm-e2e/<test>/`.
    fn save_logs(&self) {
        let dir = saved_logs_dir(self.test);
        let _ = fs::remove_dir_all(&dir);
        if fs::create_dir_all(&dir).is_err() {
            return;
        }
        let _ = fs::copy(self.path("operator.log"), dir.join("operator.log"));
        let _ = fs::write(dir.join("libvirtd.log"), self.libvirtd.log());
        let _ = fs::write(dir.join("audit.txt"), self.audit());
        if let Ok(entries) = fs::read_dir(&self.console_dir) {
            for entry in entries.flatten() {
                let _ = fs::copy(entry.path(), dir.join(entry.file_name()));
            }
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // Stop acting on libvirt before anything is removed.
        self.operator.take();
        self.save_logs();
        // Then the remaining fields drop in order; the daemon last.
    }
}

fn saved_logs_dir(test: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("vm-e2e").join(test)
}

/// The operator process (`standalone`), logging to `operator.log` in its folder: a
/// [`GroupChild`], so it dies with the test's thread even when no Drop runs.
fn start_operator(work: &Path, api_port: u16, provisioning_timeout_secs: u64) -> GroupChild {
    GroupChild::spawn(
        Command::new(BIN)
            .current_dir(work)
            .args(["standalone", "--manifests", "manifests", "--providers-config"])
            .args(["providers.yaml", "--state", "state", "--listen"])
            .arg(format!("127.0.0.1:{api_port}"))
            .arg("--provisioning-timeout")
            .arg(provisioning_timeout_secs.to_string())
            .env("RUST_LOG", "info")
            // Plain text in the log file the diagnostics quote.
            .env("NO_COLOR", "1"),
        &work.join("operator.log"),
    )
}

/// Timings of one test: printed to stderr as they are taken and kept in
/// `target/tmp/vm-e2e-timings.txt`, where each test's lines replace that test's earlier ones.
struct Timings {
    test: &'static str,
    lines: Vec<String>,
}

impl Timings {
    fn new(test: &'static str) -> Self {
        Self {
            test,
            lines: Vec::new(),
        }
    }

    fn record(&mut self, step: &str, took: Duration, note: &str) {
        let line = format!("[{}] {step:<52} {:>7.1} s{note}", self.test, took.as_secs_f64());
        eprintln!("vm-e2e timing: {line}");
        self.lines.push(line);
        self.flush();
    }

    fn flush(&self) {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vm-e2e-timings.txt");
        let Ok(lock) = fs::File::create(path.with_extension("lock")) else {
            return;
        };
        // Tests of one binary may run in parallel threads (`cargo test`).
        if lock.lock().is_err() {
            return;
        }
        let prefix = format!("[{}] ", self.test);
        let mut kept: Vec<String> = fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter(|line| !line.starts_with(&prefix))
            .map(str::to_owned)
            .collect();
        kept.extend(self.lines.iter().cloned());
        kept.sort_by(|a, b| a.split(']').next().cmp(&b.split(']').next()));
        if let Ok(mut file) = fs::File::create(&path) {
            let _ = writeln!(file, "{}", kept.join("\n"));
        }
    }
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A loopback port that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}
