//! Ports for programs that must be told theirs (Squid, etcd, kube-apiserver, the operator).
//!
//! A port bound on 0 and released comes from the kernel's ephemeral range, which every outgoing
//! connection on the machine draws from too: under load one of them can take it before the
//! program binds it (seen in CI: a Squid that never started, its Proxy pending for 90 s). So
//! ports come from below that range, which only listeners use, and from one counter per test
//! process starting at a random point, so two tests of one binary never get the same port.
//! The range libvirt's user-mode guests forward from ([`GUEST_FORWARDS`]) is left out: qemu
//! binds a forward only when its guest starts, after the provider found the port free.

use std::{
    net::TcpListener,
    sync::{
        OnceLock,
        atomic::{AtomicU32, Ordering},
    },
};

/// The lowest port handed out: above the well-known and most registered service ports.
const LOWEST: u32 = 10_000;

/// The host ports libvirt's user-mode guests forward from in tests (`user_network` ranges, the
/// providers' default 20000-20999, vm_e2e's): never handed out by [`free_port`].
pub const GUEST_FORWARDS: std::ops::Range<u32> = 20_000..30_000;

/// A loopback port nobody listens on now and no outgoing connection will take.
pub fn free_port() -> u16 {
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let end = ephemeral_start();
    let forwards = GUEST_FORWARDS.start.max(LOWEST)..GUEST_FORWARDS.end.min(end).max(LOWEST);
    // Counted over the span without the forwards' range, then mapped past it.
    let span = end - LOWEST - forwards.len() as u32;
    let next = NEXT.get_or_init(|| AtomicU32::new(fastrand::u32(0..span)));
    for _ in 0..span {
        let mut port = LOWEST + next.fetch_add(1, Ordering::Relaxed) % span;
        if port >= forwards.start {
            port += forwards.len() as u32;
        }
        let port = u16::try_from(port).expect("ports below the ephemeral range fit in u16");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 between {LOWEST} and {end}");
}

/// Where the kernel's ephemeral range starts (Linux's default when it cannot be read).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .filter(|start| *start > LOWEST + 1_000)
        .unwrap_or(32_768)
}
