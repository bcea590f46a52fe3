//! What the in-process benchmark (`benches/leasing.rs`) and the wrk benchmark's server
//! (`examples/discovery_bench_server.rs`) share: the 10k-proxy store, the discovery state
//! serving it, and the bare hyper baseline (and its durable floor).

use std::{collections::BTreeMap, convert::Infallible, sync::Arc};

use bytes::Bytes;
use egress_proxies_operator::{
    api::LeasePolicy,
    api::ProxyKey,
    discovery::{DiscoveryConfig, DiscoveryDeps, DiscoveryMetrics, DiscoveryState, Readiness, StaticTokens},
    lease::{
        Admission, LeaseStore, LeaseStoreConfig, LeaseTarget,
        journal::{Journal, Record},
        token::LeaseSigner,
    },
    provider::Endpoint,
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Proxies in the benchmark store.
pub const PROXIES: usize = 10_000;
/// Regions the proxies are spread over.
pub const REGIONS: [&str; 4] = ["eu", "us", "ap", "sa"];
/// The bearer token the benchmark clients send.
pub const TOKEN: &str = "bench-token";

/// A store of [`PROXIES`] open proxies (`region` of four, `tier` dc or res), no cooldown.
pub fn filled_store(max_concurrent: i32) -> LeaseStore {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    for i in 0..PROXIES {
        let key = ProxyKey::new("bench", &format!("p{i}"));
        store.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 3128,
            },
            attributes: BTreeMap::from([
                ("region".to_owned(), REGIONS[i % 4].to_owned()),
                (
                    "tier".to_owned(),
                    if i % 3 == 0 { "res" } else { "dc" }.to_owned(),
                ),
            ])
            .into(),
            policy: LeasePolicy {
                max_concurrent,
                cooldown_seconds: 0,
                max_ttl_seconds: 3600,
            },
            credentials: None,
        });
        store.set_admission(&key, Admission::Open).expect("just added");
    }
    store
}

/// The discovery API's state over `store`, ready and leading, accepting [`TOKEN`].
pub fn discovery_state(store: LeaseStore) -> DiscoveryState {
    let mut registry = Registry::default();
    let metrics = DiscoveryMetrics::register(&mut registry);
    let (ready, readiness) = tokio::sync::watch::channel(Readiness {
        caches_synced: true,
        leader: true,
        ..Readiness::default()
    });
    // Ready for the life of the process.
    std::mem::forget(ready);
    DiscoveryState::new(DiscoveryDeps {
        store,
        signer: LeaseSigner::new(&LeaseSigner::generate_secret()).expect("32 bytes"),
        auth: Arc::new(StaticTokens::parse(TOKEN)),
        readiness,
        registry: Arc::new(registry),
        metrics,
        outcomes: Default::default(),
        usage: Default::default(),
        politeness: Default::default(),
        config: DiscoveryConfig::default(),
    })
}

/// A bare hyper server with canned answers of the real sizes: `POST /v1/leases` gets an
/// acquire's 201 body, `GET /mib` one MiB (the gateway benchmark's target, `benches/gateway.sh`),
/// anything else a release's 200 body. It reads each request body like the real server does.
/// With `journal`, every request but `GET /mib` first appends one record to it and waits until
/// that record is synced, as a durable acquire or release does: the floor of any server that
/// makes each answer durable with this group commit on this disk (`benches/wrk.sh`'s
/// `bare-durable`).
pub async fn serve_bare(listener: TcpListener, journal: Option<Journal>) {
    let acquired = Bytes::from(format!(
        r#"{{"leaseId":"{}","fencingToken":3649891200000032,"proxyUrl":"http://127.0.0.1:3128","proxy":{{"key":"bench/p1","namespace":"bench","name":"p1","endpoint":"127.0.0.1:3128","attributes":{{"region":"eu","tier":"dc"}}}},"acquiredAt":"2026-05-28T10:00:00Z","expiresAt":"2026-05-28T10:01:00Z","ttlSeconds":60}}"#,
        "A".repeat(120)
    ));
    let released = Bytes::from(format!(
        r#"{{"leaseId":"{}","released":true,"outcome":"ok"}}"#,
        "A".repeat(120)
    ));
    // The gateway benchmark's tunnels fetch this (`GET /mib`) as their bulk transfer.
    let mebibyte = Bytes::from(vec![b'x'; 1 << 20]);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (acquired, released, mebibyte) = (acquired.clone(), released.clone(), mebibyte.clone());
        let journal = journal.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let (acquired, released, mebibyte) = (acquired.clone(), released.clone(), mebibyte.clone());
                let journal = journal.clone();
                async move {
                    let path = req.uri().path();
                    let (status, body, lease_call) = if path == "/v1/leases" {
                        (StatusCode::CREATED, acquired, true)
                    } else if path == "/mib" {
                        (StatusCode::OK, mebibyte, false)
                    } else {
                        (StatusCode::OK, released, true)
                    };
                    let _ = req.into_body().collect().await;
                    if let Some(journal) = journal.filter(|_| lease_call)
                        && journal.append(&floor_record()).wait().await.is_err()
                    {
                        let mut refused = Response::new(Full::new(Bytes::new()));
                        *refused.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                        return Ok(refused);
                    }
                    let mut response = Response::new(Full::new(body));
                    *response.status_mut() = status;
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/json"),
                    );
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// What the bare floor journals a request: a release's record (a proxy, a lease, a cooldown),
/// so each sync carries records of about the operator's size.
fn floor_record() -> Record {
    Record::Release {
        key: ProxyKey::new("bench", "p1"),
        first_token: 3_649_891_200_000_032,
        cooldown_until_ms: Some(1_780_000_060_000),
        ban: None,
    }
}
