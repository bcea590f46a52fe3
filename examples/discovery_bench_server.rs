//! The server side of the wrk benchmark (`benches/wrk.sh`): `discovery` serves the real
//! discovery API over a store of 10k proxies, with the standalone mode's upkeep (reaper and a
//! file checkpoint every second) as with `--no-durable-leases`; `durable` the same with the lease
//! journal in a temporary folder (standalone's default: every acquire and release fsynced, with
//! group commit, before it is answered; `EPO_JOURNAL_WINDOW_US` sets the group-commit window,
//! default 1 ms);
//! `bare` serves the bare hyper baseline with canned answers; `bare-durable` the same, each
//! lease call first journalled (one record, awaited until synced, as a durable acquire or
//! release is): the floor of any server that makes each answer durable on this disk;
//! `forward UPSTREAM` is the cheapest
//! forward-proxy hop hyper makes, the floor under the gateway's figure (`benches/gateway.sh`):
//! each client connection gets one connection of its own to the HTTP proxy at `UPSTREAM`, and
//! each request goes out on it as it came in (absolute form, headers untouched), with no pool,
//! authentication, lease or outcome; a `CONNECT` is passed on and its tunnel relayed both ways
//! by the gateway's own relay (`splice(2)`).
//! Each prints `listening on ADDR` and runs until SIGTERM (then removes its temporary folder),
//! on a default multi-thread tokio runtime, like the operator (one worker per CPU it may run
//! on: `taskset` decides). `EPO_JOURNAL_STATS=1` prints records and time per journal sync.
//!
//! `cargo run --release --example discovery_bench_server -- discovery|durable|bare|bare-durable|forward ADDR`
//! (`EPO_BENCH_STATE_DIR` puts the journal's folder elsewhere than the system's temp folder)

#[path = "../benches/common/mod.rs"]
mod common;

use std::{io::Write, net::SocketAddr, sync::Arc};

use egress_proxies_operator::{
    discovery,
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{CheckpointReport, CheckpointStore, FileCheckpoint, MaintenanceConfig},
        journal::{self, Journal, JournalConfig, JournalMetrics},
        maintenance,
    },
};
use http_body_util::BodyExt;
use hyper::{
    Request, body::Incoming, client::conn::http1 as client_http1, server::conn::http1 as server_http1,
};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

/// The operator's allocator (src/main.rs), so the discovery API here costs what it costs there;
/// the bare baseline shares the process and so the allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let upstream: Option<SocketAddr> = std::env::args().nth(2).and_then(|a| a.parse().ok());
    if !["discovery", "durable", "bare", "bare-durable", "forward"].contains(&mode.as_str())
        || (mode == "forward") != upstream.is_some()
    {
        eprintln!("usage: discovery_bench_server discovery|durable|bare|bare-durable|forward UPSTREAM_ADDR");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("bound address");
        let state_dir = match std::env::var_os("EPO_BENCH_STATE_DIR") {
            Some(dir) => tempfile::tempdir_in(dir),
            None => tempfile::tempdir(),
        }
        .expect("temporary folder");
        let server = if mode == "bare" {
            tokio::spawn(common::serve_bare(listener, None))
        } else if mode == "bare-durable" {
            // Its journal compacted over an empty store.
            let journal = start_journal(state_dir.path(), LeaseStore::new(LeaseStoreConfig::default()));
            tokio::spawn(common::serve_bare(listener, Some(journal)))
        } else if let Some(upstream) = upstream {
            tokio::spawn(serve_forward(listener, upstream))
        } else {
            let store = common::filled_store(1);
            let state = common::discovery_state(store.clone());
            let sink = if mode == "durable" {
                state.set_journal(start_journal(state_dir.path(), store.clone()));
                None
            } else {
                let checkpoint = FileCheckpoint::new(state_dir.path().join("leases.json"));
                Some(Arc::new(checkpoint) as Arc<dyn CheckpointStore>)
            };
            tokio::spawn(maintenance(
                store.clone(),
                sink,
                MaintenanceConfig::default(),
                std::future::pending(),
            ));
            tokio::spawn(async move {
                let _ = discovery::serve(listener, state, std::future::pending()).await;
            })
        };
        println!("listening on {addr}");
        let _ = std::io::stdout().flush();
        // benches/wrk.sh stops it with SIGTERM: return, so the temporary folder is removed.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = server => {}
            _ = term.recv() => {}
        }
        drop(state_dir);
    });
}

/// The lease journal in `dir`, as `durable` and `bare-durable` run it (`EPO_JOURNAL_WINDOW_US`,
/// `EPO_JOURNAL_STATS`), compacted into snapshots of `store` as the operator's is (so covered
/// segments are recycled, not new ones made).
fn start_journal(dir: &std::path::Path, store: LeaseStore) -> Journal {
    let mut config = JournalConfig::new(dir);
    if let Some(us) = std::env::var("EPO_JOURNAL_WINDOW_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.window = std::time::Duration::from_micros(us);
    }
    let metrics = JournalMetrics::default();
    let journal = Journal::start(config, 1, metrics.clone()).expect("journal");
    if std::env::var_os("EPO_JOURNAL_STATS").is_some() {
        // Records per sync and sync time, every 5 s on stderr.
        tokio::spawn(async move {
            let mut last = metrics.totals();
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                let now = metrics.totals();
                let (records, syncs, secs) = (now.0 - last.0, now.1 - last.1, now.2 - last.2);
                if syncs > 0 {
                    eprintln!(
                        "journal: {records} records in {syncs} syncs ({:.1} per sync), {:.0} µs per sync",
                        records as f64 / syncs as f64,
                        1e6 * secs / syncs as f64
                    );
                }
                last = now;
            }
        });
    }
    tokio::spawn(journal::compaction(
        store,
        journal.clone(),
        FileCheckpoint::new(dir.join("leases.json")),
        dir.to_owned(),
        MaintenanceConfig::default().checkpoint_interval,
        CheckpointReport::default(),
        std::future::pending(),
    ));
    journal
}

/// The cheapest forward-proxy hop: one upstream connection per client connection, each request
/// sent on it unchanged and its answer streamed back (HTTP/1 answers a connection's requests in
/// order, so the connection needs no pool and its lock is never contended). A `CONNECT` gets an
/// upstream connection of its own and, once the upstream's tunnel is open, the two sides are
/// relayed both ways by the gateway's relay (`gateway::tunnel::relay`, `splice(2)`).
async fn serve_forward(listener: TcpListener, upstream: SocketAddr) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let _ = client.set_nodelay(true);
        tokio::spawn(async move {
            let Ok(stream) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            let Ok((sender, connection)) = client_http1::handshake(TokioIo::new(stream)).await else {
                return;
            };
            tokio::spawn(connection);
            let sender = Arc::new(tokio::sync::Mutex::new(sender));
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let sender = sender.clone();
                async move {
                    if request.method() == hyper::Method::CONNECT {
                        return tunnel(upstream, request).await;
                    }
                    let mut sender = sender.lock().await;
                    sender.ready().await?;
                    let response = sender.send_request(request).await?;
                    Ok(response.map(|body| body.boxed_unsync()))
                }
            });
            let _ = server_http1::Builder::new()
                .serve_connection(TokioIo::new(client), service)
                .with_upgrades()
                .await;
        });
    }
}

type ForwardBody = http_body_util::combinators::UnsyncBoxBody<bytes::Bytes, hyper::Error>;

/// A `CONNECT` through the upstream on a connection of its own, then both sides relayed.
async fn tunnel(
    upstream: SocketAddr,
    mut request: Request<Incoming>,
) -> Result<hyper::Response<ForwardBody>, hyper::Error> {
    let empty = || {
        http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync()
    };
    let mut answer = hyper::Response::new(empty());
    *answer.status_mut() = hyper::StatusCode::BAD_GATEWAY;
    let Ok(stream) = TcpStream::connect(upstream).await else {
        return Ok(answer);
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = client_http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection.with_upgrades());
    let mut connect = Request::new(http_body_util::Empty::<bytes::Bytes>::new());
    *connect.method_mut() = hyper::Method::CONNECT;
    *connect.uri_mut() = request.uri().clone();
    if let Some(host) = request.headers().get(hyper::header::HOST) {
        connect.headers_mut().insert(hyper::header::HOST, host.clone());
    }
    let response = sender.send_request(connect).await?;
    if !response.status().is_success() {
        return Ok(response.map(|body| body.boxed_unsync()));
    }
    let client_side = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        if let (Ok(upstream_side), Ok(client_side)) = (hyper::upgrade::on(response).await, client_side.await)
        {
            let _ = egress_proxies_operator::gateway::tunnel::relay(client_side, upstream_side).await;
        }
    });
    *answer.status_mut() = hyper::StatusCode::OK;
    Ok(answer)
}
