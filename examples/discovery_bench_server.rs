//! The server side of the wrk benchmark (`benches/wrk.sh`): `discovery` serves the real
//! discovery API over a store of 10k proxies, with the standalone mode's upkeep (reaper and a
//! file checkpoint every second); `bare` serves the bare hyper baseline with canned answers.
//! Both print `listening on ADDR` and run until killed, on a default multi-thread tokio
//! runtime, like the operator (one worker per CPU it may run on: `taskset` decides).
//!
//! `cargo run --release --example discovery_bench_server -- discovery|bare`

#[path = "../benches/common/mod.rs"]
mod common;

use std::{io::Write, sync::Arc};

use egress_proxies_operator::{
    discovery,
    lease::{
        checkpoint::{CheckpointStore, FileCheckpoint, MaintenanceConfig},
        maintenance,
    },
};
use tokio::net::TcpListener;

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    if mode != "discovery" && mode != "bare" {
        eprintln!("usage: discovery_bench_server discovery|bare");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("bound address");
        let state_dir = tempfile::tempdir().expect("temporary folder");
        let server = if mode == "bare" {
            tokio::spawn(common::serve_bare(listener))
        } else {
            let store = common::filled_store(1);
            let checkpoint = Arc::new(FileCheckpoint::new(state_dir.path().join("leases.json")));
            tokio::spawn(maintenance(
                store.clone(),
                Some(checkpoint as Arc<dyn CheckpointStore>),
                MaintenanceConfig::default(),
                std::future::pending(),
            ));
            let state = common::discovery_state(store);
            tokio::spawn(async move {
                let _ = discovery::serve(listener, state, std::future::pending()).await;
            })
        };
        println!("listening on {addr}");
        let _ = std::io::stdout().flush();
        let _ = server.await;
    });
}
