//! An open `CONNECT` tunnel's bytes, moved between the client's socket and the upstream
//! proxy's.
//!
//! Both sides are plain TCP sockets (the gateway's listener and [`super::forward::dial`]), so
//! the bytes go socket → pipe → socket with `splice(2)` (the `tokio-splice2` crate) and never
//! through this process's memory: copying them through user space, as
//! `tokio::io::copy_bidirectional` does, cost 25–35 points more CPU a MiB, over the Squid alone,
//! than splicing (docs/benchmarks.md, 2026-12-05). What hyper read past either side's head before the upgrade (a TLS
//! ClientHello sent right behind the `CONNECT`, say) is written first. Public so that the
//! benchmark's bare hop (`examples/discovery_bench_server forward`) relays with it too: the
//! floor under the gateway's tunnel figure is then this relay alone.

use std::{
    future::poll_fn,
    io,
    pin::{Pin, pin},
    task::{Context, Poll},
};

use bytes::Bytes;
use hyper::upgrade::{Parts, Upgraded};
use hyper_util::rt::TokioIo;
use tokio::{io::AsyncWriteExt, net::TcpStream};
use tokio_splice2::{SpliceIo, SpliceIoCtx};
use tracing::debug;

/// The most one direction's pipe holds: the kernel's default pipe size. A side that stops
/// reading pins at most this much in the kernel (tokio-splice2 asks for 1 MiB pipes: 10,000
/// stalled tunnels could pin 20 GB). Tunnels of 1 MiB cost the same CPU with either, within the
/// runs' spread (docs/benchmarks.md, 2026-12-05).
const PIPE_BYTES: usize = 64 * 1024;

/// Moves bytes both ways until both sides are done; returns (client → upstream,
/// upstream → client) byte counts.
pub async fn relay(client: Upgraded, upstream: Upgraded) -> io::Result<(u64, u64)> {
    let (Ok(client), Ok(upstream)) = (socket(client), socket(upstream)) else {
        // Both sides are built as `TokioIo<TcpStream>` (the listener, `forward::dial`); a
        // change there shows here, in every CONNECT test, not as a silent slow path.
        return Err(io::Error::other("a tunnel side is not a TCP socket"));
    };
    relay_sockets(
        (client.io.into_inner(), client.read_buf),
        (upstream.io.into_inner(), upstream.read_buf),
        pipes,
    )
    .await
}

/// [`relay`] over the two sockets and what was read past their heads, with the pipes `pipes`
/// makes (or, when it cannot, copied).
async fn relay_sockets(
    (mut client, client_early): (TcpStream, Bytes),
    (mut upstream, upstream_early): (TcpStream, Bytes),
    pipes: fn() -> io::Result<(Splice, Splice)>,
) -> io::Result<(u64, u64)> {
    upstream.write_all(&client_early).await?;
    client.write_all(&upstream_early).await?;
    let (sent, received) = match pipes() {
        Ok((forth, back)) => spliced(&mut client, &mut upstream, forth, back).await?,
        // Out of file descriptors (a spliced tunnel holds four more) or of pipe pages: the
        // tunnel still works, its bytes copied through user space.
        Err(error) => {
            debug!(%error, "no pipes for a tunnel: copied instead");
            tokio::io::copy_bidirectional(&mut client, &mut upstream).await?
        }
    };
    Ok((
        client_early.len() as u64 + sent,
        upstream_early.len() as u64 + received,
    ))
}

/// Splices client → upstream (`forth`) and upstream → client (`back`) until both are done (each
/// ends by shutting its writer once its reader is at its end), or until either fails: then at
/// once, as `copy_bidirectional` does, the sockets closing as they drop. (tokio-splice2's own
/// bidirectional splice waits for the other direction after a failure, which holds a tunnel,
/// and its lease, for as long as a client that ignores the end keeps its side open.) Returns
/// the bytes each direction wrote.
async fn spliced(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    forth: Splice,
    back: Splice,
) -> io::Result<(u64, u64)> {
    let (mut forth, mut back) = (pin!(forth), pin!(back));
    let (mut forth_done, mut back_done) = (false, false);
    poll_fn(|cx| {
        advance(&mut forth_done, forth.as_mut(), cx, &mut *client, &mut *upstream)?;
        advance(&mut back_done, back.as_mut(), cx, &mut *upstream, &mut *client)?;
        if forth_done && back_done {
            Poll::Ready(Ok::<(), io::Error>(()))
        } else {
            Poll::Pending
        }
    })
    .await?;
    Ok((forth.has_written() as u64, back.has_written() as u64))
}

/// Polls one direction's splice from `from` to `to` unless it is `done` (a finished splice must
/// not be polled again), marking it done when it ends; its failure is the tunnel's.
fn advance(
    done: &mut bool,
    splice: Pin<&mut Splice>,
    cx: &mut Context<'_>,
    from: &mut TcpStream,
    to: &mut TcpStream,
) -> io::Result<()> {
    if !*done && let Poll::Ready(result) = splice.poll_execute(cx, Pin::new(from), Pin::new(to)) {
        result?;
        *done = true;
    }
    Ok(())
}

fn socket(side: Upgraded) -> Result<Parts<TokioIo<TcpStream>>, Upgraded> {
    side.downcast::<TokioIo<TcpStream>>()
}

/// One direction's splice, from one socket to the other through a pipe of its own.
type Splice = SpliceIo<TcpStream, TcpStream>;

/// A splice for each direction (client → upstream, upstream → client), each pipe of at most
/// [`PIPE_BYTES`].
fn pipes() -> io::Result<(Splice, Splice)> {
    Ok((pipe()?.into_io(), pipe()?.into_io()))
}

fn pipe() -> io::Result<SpliceIoCtx<TcpStream, TcpStream>> {
    let pipe = SpliceIoCtx::prepare()?;
    if pipe.pipe_size().get() > PIPE_BYTES {
        pipe.set_pipe_size(PIPE_BYTES)
    } else {
        Ok(pipe)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::{
        io::AsyncReadExt,
        net::{TcpListener, TcpStream},
    };

    use super::*;

    /// A connected pair of loopback sockets: (the end a peer holds, the end the relay holds).
    async fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (peer, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
        (peer.expect("connect"), accepted.expect("accept").0)
    }

    /// Bytes both ways, what was read past the heads first, 1 MiB (many pipefuls) one way, each
    /// side's end passed on as the other's end, and the counts.
    async fn relays_both_ways_with(pipes: fn() -> io::Result<(Splice, Splice)>) {
        let (mut client, client_side) = socket_pair().await;
        let (mut upstream, upstream_side) = socket_pair().await;
        let relayed = tokio::spawn(relay_sockets(
            (client_side, Bytes::from_static(b"client-early ")),
            (upstream_side, Bytes::from_static(b"upstream-early ")),
            pipes,
        ));
        let page: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let upstream_end = async {
            let mut got = Vec::new();
            upstream
                .read_to_end(&mut got)
                .await
                .expect("read to the client's end");
            upstream.write_all(&page).await.expect("write the page");
            upstream.shutdown().await.expect("end");
            got
        };
        let client_end = async {
            client.write_all(b"GET /").await.expect("write");
            client.shutdown().await.expect("end");
            let mut got = Vec::new();
            client
                .read_to_end(&mut got)
                .await
                .expect("read to the upstream's end");
            got
        };
        let (at_upstream, at_client) = tokio::join!(upstream_end, client_end);
        assert_eq!(at_upstream, b"client-early GET /");
        assert_eq!(&at_client[..15], b"upstream-early ");
        assert!(at_client[15..] == page[..], "the page arrives whole and in order");
        let counts = relayed.await.expect("the relay ends").expect("cleanly");
        assert_eq!(counts, (18, 15 + (1 << 20)));
    }

    /// The upstream resets its connection while the client, idle, keeps its side open: the
    /// relay ends at once with the error, not when the client closes.
    async fn ends_on_a_reset_with(pipes: fn() -> io::Result<(Splice, Splice)>) {
        let (client, client_side) = socket_pair().await;
        let (upstream, upstream_side) = socket_pair().await;
        let relayed = tokio::spawn(relay_sockets(
            (client_side, Bytes::new()),
            (upstream_side, Bytes::new()),
            pipes,
        ));
        // A linger of zero: the close sends a reset, not an end.
        #[allow(deprecated)]
        upstream.set_linger(Some(Duration::ZERO)).expect("linger");
        drop(upstream);
        let ended = tokio::time::timeout(Duration::from_secs(10), relayed)
            .await
            .expect("the relay ends within 10 s of the reset, the client still connected")
            .expect("the relay's task");
        assert!(ended.is_err(), "a reset is an error: {ended:?}");
        drop(client);
    }

    /// A pipe maker out of file descriptors.
    fn no_pipes() -> io::Result<(Splice, Splice)> {
        Err(io::Error::from_raw_os_error(libc::EMFILE))
    }

    #[tokio::test]
    async fn a_spliced_tunnel_ends_on_a_reset_while_the_client_idles() {
        ends_on_a_reset_with(pipes).await;
    }

    #[tokio::test]
    async fn a_copied_tunnel_ends_on_a_reset_while_the_client_idles() {
        ends_on_a_reset_with(no_pipes).await;
    }

    #[tokio::test]
    async fn a_tunnel_is_spliced_both_ways() {
        relays_both_ways_with(pipes).await;
    }

    #[tokio::test]
    async fn a_tunnel_without_pipes_is_copied() {
        relays_both_ways_with(no_pipes).await;
    }
}
