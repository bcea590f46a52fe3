//! Per-request cost of the fake API server through a real `kube::Client`, with few and with
//! many stored objects: the cost of a create, get, status patch and watch delivery must not
//! grow with the number of objects (no O(n) work per request, so no O(n²) at scale). The
//! baseline, measured in the same run, is `GET /version` (HTTP and client cost, no store).
//!
//! `cargo bench --bench fake_apiserver` (set `EPO_BENCH_OBJECTS` to change the large size).

// The module allows its own dead code (not every user needs every hook).
#[path = "../tests/support/fake_apiserver/mod.rs"]
mod fake_apiserver;

use std::time::{Duration, Instant};

use egress_proxies_operator::api::Proxy;
use fake_apiserver::FakeApiServer;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams, WatchEvent, WatchParams},
    core::ObjectMeta,
};
use serde_json::json;

const REQUESTS: usize = 1_000;
const WATCHERS: usize = 8;

struct Figures {
    create: Duration,
    get: Duration,
    patch_status: Duration,
    watch_delivery: Duration,
}

fn per_request(total: Duration) -> String {
    format!("{:>7.1} µs", total.as_secs_f64() * 1e6 / REQUESTS as f64)
}

async fn measure(stored: usize) -> Figures {
    let server = FakeApiServer::start().await;
    for i in 0..stored {
        server.put_json(
            "configmaps",
            json!({"metadata": {"name": format!("bulk-{i}"), "namespace": "bulk"}}),
        );
        server.put_json(
            "proxies",
            json!({"metadata": {"name": format!("bulk-{i}"), "namespace": "bulk"}, "spec": {"provider": "mem"}}),
        );
    }
    let client = server.client();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "bench");
    let started = Instant::now();
    for i in 0..REQUESTS {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("cm-{i}")),
                ..Default::default()
            },
            ..Default::default()
        };
        cms.create(&PostParams::default(), &cm).await.expect("create");
    }
    let create = started.elapsed();

    let started = Instant::now();
    for i in 0..REQUESTS {
        cms.get(&format!("cm-{i}")).await.expect("get");
    }
    let get = started.elapsed();

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "bulk");
    let started = Instant::now();
    for i in 0..REQUESTS {
        let patch = Patch::Merge(json!({"status": {"phase": "healthy", "observedGeneration": i}}));
        proxies
            .patch_status(
                &format!("bulk-{}", i % stored.max(1)),
                &PatchParams::default(),
                &patch,
            )
            .await
            .ok();
    }
    let patch_status = started.elapsed();

    // Watch fan-out: WATCHERS open watches, REQUESTS writes, until every watch saw the last.
    let rv = server.resource_version().to_string();
    let mut streams = Vec::new();
    for _ in 0..WATCHERS {
        streams.push(
            cms.watch(&WatchParams::default(), &rv)
                .await
                .expect("watch")
                .boxed(),
        );
    }
    let started = Instant::now();
    for i in 0..REQUESTS {
        let patch = Patch::Merge(json!({"data": {"n": i.to_string()}}));
        cms.patch(&format!("cm-{}", i % REQUESTS), &PatchParams::default(), &patch)
            .await
            .expect("patch");
    }
    for stream in &mut streams {
        let mut seen = 0;
        while seen < REQUESTS {
            match stream.next().await {
                Some(Ok(WatchEvent::Modified(_))) => seen += 1,
                Some(Ok(_)) => {}
                other => panic!("watch ended early: {other:?}"),
            }
        }
    }
    let watch_delivery = started.elapsed();
    Figures {
        create,
        get,
        patch_status,
        watch_delivery,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let large: usize = std::env::var("EPO_BENCH_OBJECTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);

    let server = FakeApiServer::start().await;
    let client = server.client();
    let started = Instant::now();
    for _ in 0..REQUESTS {
        client.apiserver_version().await.expect("version");
    }
    let baseline = started.elapsed();

    let small = measure(100).await;
    let big = measure(large).await;
    println!(
        "fake_apiserver: baseline GET /version          {} per request",
        per_request(baseline)
    );
    for (what, few, many) in [
        ("create", small.create, big.create),
        ("get", small.get, big.get),
        ("status merge patch", small.patch_status, big.patch_status),
        (
            "write + 8 watch deliveries",
            small.watch_delivery,
            big.watch_delivery,
        ),
    ] {
        println!(
            "fake_apiserver: {what:<27} {} with 100 objects, {} with {large} ({:.2}x; 1.0x = no growth)",
            per_request(few),
            per_request(many),
            many.as_secs_f64() / few.as_secs_f64()
        );
    }
}
