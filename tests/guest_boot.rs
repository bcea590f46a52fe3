//! A real guest, without libvirt: the cached guest image boots under QEMU (TCG) from a qcow2
//! overlay with a NoCloud seed, cloud-init writes Squid's config, and a request through the
//! host-forwarded proxy port reaches an HTTP server on the host's loopback (which the guest sees
//! as 10.0.2.2). The response must carry the `visible_hostname` the seed set, so it proves the
//! cloud-init config is the one Squid runs with.
//!
//! Timings (image build or cache hit, boot to the first proxied fetch) go to stderr and to
//! `target/tmp/guest-boot-timings.txt`; the guest's serial console to
//! `target/tmp/guest-boot-serial.log`. Knobs: `EPO_CACHE_DIR` (image cache),
//! `EPO_GUEST_BOOT_TIMEOUT_SECS` (default 180), `EPO_GUEST_ACCEL` (default `tcg`; `kvm` where
//! /dev/kvm works).

mod support {
    pub mod blocking_http;
    pub mod guest_image;
}

use std::{
    fs::File,
    net::{SocketAddr, TcpListener, TcpStream},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use support::{
    blocking_http::{Origin, Response, get_through_proxy},
    guest_image::{
        GuestImage, build_seed_iso, create_overlay, default_cache_root, ensure_guest_image, tail_of,
    },
};

/// The guest port Squid listens on, forwarded from the host's loopback.
const SQUID_PORT: u16 = 3128;

/// How the guest reaches the host's loopback in QEMU's user-mode network.
const HOST_FROM_GUEST: &str = "10.0.2.2";

#[test]
fn guest_boots_to_a_squid_configured_by_cloud_init() {
    let cache_root = default_cache_root();
    let image = ensure_guest_image(&cache_root).unwrap_or_else(|err| panic!("guest image: {err}"));
    let image_line = format!(
        "guest image: {} in {:.1} s ({})",
        if image.built { "built" } else { "cache hit" },
        image.build_time.as_secs_f64(),
        image.rootfs.display()
    );
    eprintln!("{image_line}");

    let work = tempfile::Builder::new()
        .prefix("epo-guest-boot-")
        .tempdir()
        .expect("temp dir");
    let token = format!("epo-guest-boot-{:016x}", fastrand::u64(..));
    let hostname = format!("epo-squid-{:08x}", fastrand::u32(..));
    let server = Origin::start(&token);

    let overlay = work.path().join("overlay.qcow2");
    create_overlay(&image, &overlay).unwrap_or_else(|err| panic!("overlay: {err}"));
    let seed = build_seed_iso(work.path(), &user_data(&hostname), &meta_data(&hostname))
        .unwrap_or_else(|err| panic!("seed: {err}"));

    let timeout = Duration::from_secs(env_number("EPO_GUEST_BOOT_TIMEOUT_SECS", 180));
    let mut vm = Vm::start(&image, &overlay, &seed, work.path());
    let url = format!("http://{HOST_FROM_GUEST}:{}/probe", server.port);
    let expected_body = server.body_for("/probe");
    let response = vm.poll_until_proxied(&url, timeout);
    let boot = vm.started.elapsed();
    let boot_line = format!(
        "guest boot: first proxied fetch {:.1} s after QEMU started ({} accel)",
        boot.as_secs_f64(),
        accel()
    );
    eprintln!("{boot_line}");
    write_timings(&[&image_line, &boot_line]);

    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.body, expected_body, "the body the host server sent");
    // Squid names itself with the cloud-init-written visible_hostname in Via and X-Cache.
    let via = response.header("via").unwrap_or_default();
    assert!(
        via.contains(&hostname),
        "Via {via:?} names {hostname}: {response:?}"
    );
    let requests = server.seen();
    let forwarded = requests.last().expect("the host server saw the proxied request");
    assert!(
        forwarded
            .header("via")
            .is_some_and(|via| via.starts_with(&format!("1.1 {hostname}"))),
        "the request reached the host through the guest's Squid: {forwarded:?}"
    );
}

fn user_data(hostname: &str) -> String {
    // The NATed client: QEMU's user-mode network makes forwarded connections come from the
    // host's address in the guest network.
    format!(
        "#cloud-config\n\
         manage_etc_hosts: true\n\
         write_files:\n\
         \x20 - path: /etc/squid/squid.conf\n\
         \x20   permissions: '0644'\n\
         \x20   content: |\n\
         \x20     http_port {SQUID_PORT}\n\
         \x20     visible_hostname {hostname}\n\
         \x20     acl nat_client src {HOST_FROM_GUEST}/32\n\
         \x20     http_access allow nat_client\n\
         \x20     http_access deny all\n\
         \x20     cache deny all\n\
         \x20     shutdown_lifetime 1 seconds\n"
    )
}

fn meta_data(hostname: &str) -> String {
    format!("instance-id: iid-{hostname}\nlocal-hostname: {hostname}\n")
}

fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
        Err(_) => default,
    }
}

fn accel() -> String {
    std::env::var("EPO_GUEST_ACCEL").unwrap_or_else(|_| "tcg".to_owned())
}

fn write_timings(lines: &[&str]) {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("guest-boot-timings.txt");
    let _ = std::fs::write(&path, lines.join("\n") + "\n");
}

/// A free loopback port: bind port 0, read it, release it (QEMU binds it next; a lost race
/// shows as QEMU failing to set up the forward, and is retried).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A QEMU guest, killed (and reaped) on drop.
struct Vm {
    child: Child,
    forward: SocketAddr,
    serial_log: PathBuf,
    qemu_log: PathBuf,
    started: Instant,
}

impl Vm {
    fn start(image: &GuestImage, overlay: &Path, seed: &Path, dir: &Path) -> Self {
        let serial_log = dir.join("serial.log");
        let qemu_log = dir.join("qemu.log");
        for _attempt in 0..3 {
            let port = free_port();
            let log = File::create(&qemu_log).expect("qemu log");
            let started = Instant::now();
            let child = Command::new("qemu-system-x86_64")
                .args(["-nodefaults", "-no-user-config", "-no-reboot"])
                .args(["-machine", &format!("pc,accel={}", accel())])
                .args(["-m", "512", "-smp", "1"])
                .arg("-kernel")
                .arg(&image.kernel)
                .arg("-initrd")
                .arg(&image.initrd)
                .args(["-append", &image.cmdline])
                // vda: the VM's own overlay of the image; vdb: the seed, read-only.
                .arg("-drive")
                .arg(format!("file={},if=virtio,format=qcow2", overlay.display()))
                .arg("-drive")
                .arg(format!(
                    "file={},if=virtio,format=raw,readonly=on",
                    seed.display()
                ))
                // The NIC as the kvm2 provider passes it to QEMU.
                .args([
                    "-netdev",
                    &format!("user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:{SQUID_PORT}"),
                ])
                .args(["-device", "virtio-net-pci,netdev=n0,bus=pci.0,addr=0x10"])
                .args(["-display", "none", "-monitor", "none"])
                .arg("-serial")
                .arg(format!("file:{}", serial_log.display()))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("qemu log"))
                .stderr(log)
                .process_group(0)
                .spawn()
                .expect("qemu-system-x86_64 (is qemu-system-x86 installed?)");
            let mut vm = Vm {
                child,
                forward: SocketAddr::from(([127, 0, 0, 1], port)),
                serial_log: serial_log.clone(),
                qemu_log: qemu_log.clone(),
                started,
            };
            // QEMU binds the forward before the guest runs, or exits.
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Some(status) = vm.child.try_wait().expect("qemu status") {
                    let log = tail_of(&qemu_log, 20);
                    if log.contains("hostfwd") || log.contains("host forwarding") {
                        eprintln!("port {port} was taken before QEMU bound it; retrying");
                        break;
                    }
                    panic!("QEMU exited at start ({status}):\n{log}");
                }
                if TcpStream::connect_timeout(&vm.forward, Duration::from_millis(200)).is_ok() {
                    return vm;
                }
                thread::sleep(Duration::from_millis(50));
            }
            if vm.child.try_wait().expect("qemu status").is_none() {
                vm.fail("QEMU did not open the forwarded port within 10 s");
            }
        }
        panic!("no free port for QEMU's host forward after 3 attempts");
    }

    /// Fetches `url` through the guest's Squid until a response comes back with status 200,
    /// QEMU exits, or `timeout` (from QEMU's start) passes.
    fn poll_until_proxied(&mut self, url: &str, timeout: Duration) -> Response {
        let deadline = self.started + timeout;
        loop {
            let last = match get_through_proxy(self.forward, url, None) {
                Ok(response) if response.status == 200 => return response,
                Ok(response) => format!("Squid answered {response:?}"),
                Err(err) => err.to_string(),
            };
            if let Ok(Some(status)) = self.child.try_wait() {
                self.fail(&format!(
                    "QEMU exited ({status}) before the proxy worked; last attempt: {last}"
                ));
            }
            if Instant::now() >= deadline {
                self.fail(&format!(
                    "no proxied fetch within {} s of QEMU's start; last attempt: {last}",
                    timeout.as_secs()
                ));
            }
            thread::sleep(Duration::from_millis(500));
        }
    }

    fn fail(&self, what: &str) -> ! {
        panic!(
            "{what}\n--- QEMU output ---\n{}\n--- serial console (last 60 lines) ---\n{}",
            tail_of(&self.qemu_log, 20),
            tail_of(&self.serial_log, 60)
        );
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The whole console of the last run, for a look after the temp dir is gone.
        let _ = std::fs::copy(
            &self.serial_log,
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("guest-boot-serial.log"),
        );
    }
}
