//! An open `CONNECT` tunnel's bytes, moved between the client's socket and the upstream
//! proxy's.
//!
//! Both sides are plain TCP sockets (the gateway's listener and [`super::forward::dial`]), so
//! the bytes go socket → pipe → socket with `splice(2)` (the `tokio-splice2` crate) and never
//! through this process's memory: copying them through user space, as
//! `tokio::io::copy_bidirectional` does, cost the gateway +58 % CPU a MiB over the Squid alone
//! (docs/benchmarks.md). What hyper read past either side's head before the upgrade (a TLS
//! ClientHello sent right behind the `CONNECT`, say) is written first. Public so that the
//! benchmark's bare hop (`examples/discovery_bench_server forward`) relays with it too: the
//! floor under the gateway's tunnel figure is then this relay alone.

use std::io;

use hyper::upgrade::{Parts, Upgraded};
use hyper_util::rt::TokioIo;
use tokio::{io::AsyncWriteExt, net::TcpStream};

/// Moves bytes both ways until both sides are done; returns (client → upstream,
/// upstream → client) byte counts.
pub async fn relay(client: Upgraded, upstream: Upgraded) -> io::Result<(u64, u64)> {
    let (Ok(client), Ok(upstream)) = (socket(client), socket(upstream)) else {
        // Both sides are built as `TokioIo<TcpStream>` (the listener, `forward::dial`); a
        // change there shows here, in every CONNECT test, not as a silent slow path.
        return Err(io::Error::other("a tunnel side is not a TCP socket"));
    };
    let (mut client, client_early) = (client.io.into_inner(), client.read_buf);
    let (mut upstream, upstream_early) = (upstream.io.into_inner(), upstream.read_buf);
    upstream.write_all(&client_early).await?;
    client.write_all(&upstream_early).await?;
    let traffic = tokio_splice2::copy_bidirectional(&mut client, &mut upstream).await?;
    if let Some(error) = traffic.error {
        return Err(error);
    }
    Ok((
        (client_early.len() + traffic.tx) as u64,
        (upstream_early.len() + traffic.rx) as u64,
    ))
}

fn socket(side: Upgraded) -> Result<Parts<TokioIo<TcpStream>>, Upgraded> {
    side.downcast::<TokioIo<TcpStream>>()
}
