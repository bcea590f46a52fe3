//! The discovery API over real sockets: the curl examples of docs/api.md run against a live
//! server, keep-alive and graceful shutdown, TokenReview against a loopback API server, and
//! leases that survive a leader change.

mod support;

use std::{
    collections::{BTreeMap, HashMap},
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use egress_proxies_operator::{
    api::LeasePolicy,
    discovery::{
        self, Authenticator, DiscoveryConfig, DiscoveryMetrics, DiscoveryState, Readiness, StaticTokens,
        TokenReviewAuthenticator, auth::AuthError,
    },
    lease::{
        Admission, LeaseStore, LeaseStoreConfig, LeaseTarget, ProxyKey,
        checkpoint::{decode_chunks, encode_chunks},
        token::LeaseSigner,
    },
    provider::{Credentials, Endpoint},
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::{net::TcpListener, sync::watch};

const TOKEN: &str = "demo-token";
const SECRET: [u8; 32] = [9; 32];

fn demo_store() -> LeaseStore {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    for (name, region, port) in [("eu-1", "eu", 3128), ("eu-2", "eu", 3129), ("us-1", "us", 3130)] {
        let key = ProxyKey::new("crawl", name);
        store.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port,
            },
            attributes: BTreeMap::from([
                ("region".to_owned(), region.to_owned()),
                ("tier".to_owned(), "dc".to_owned()),
            ]),
            policy: LeasePolicy {
                max_concurrent: 2,
                cooldown_seconds: 0,
                max_ttl_seconds: 3600,
            },
            credentials: Some(Credentials {
                username: "crawler".into(),
                password: "secret".into(),
            }),
        });
        store.set_admission(&key, Admission::Open).unwrap();
    }
    store
}

/// A live server on 127.0.0.1:0; stops (gracefully) on Drop.
struct Server {
    url: String,
    _ready: watch::Sender<Readiness>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    async fn start(store: LeaseStore, auth: Arc<dyn Authenticator>) -> Server {
        let mut registry = Registry::default();
        let metrics = DiscoveryMetrics::register(&mut registry);
        let (ready, readiness) = watch::channel(Readiness {
            synced: true,
            leader: true,
        });
        let state = DiscoveryState::new(
            store,
            LeaseSigner::new(&SECRET).unwrap(),
            auth,
            readiness,
            Arc::new(registry),
            metrics,
            DiscoveryConfig::default(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(discovery::serve(listener, state, async {
            let _ = stopped.await;
        }));
        Server {
            url,
            _ready: ready,
            stop: Some(stop),
            task: Some(task),
        }
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(15), task)
                .await
                .expect("serve returns after shutdown")
                .unwrap()
                .unwrap();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn tokens() -> Arc<dyn Authenticator> {
    Arc::new(StaticTokens::parse(TOKEN))
}

struct Example {
    line: usize,
    expect: u16,
    command: String,
}

fn examples(markdown: &str) -> Vec<Example> {
    let mut out = Vec::new();
    let mut lines = markdown.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        if line.trim() != "```sh" {
            continue;
        }
        let block: Vec<&str> = lines
            .by_ref()
            .map(|(_, l)| l)
            .take_while(|l| l.trim() != "```")
            .collect();
        let Some(expect) = block.first().and_then(|l| l.strip_prefix("# expect ")) else {
            continue;
        };
        out.push(Example {
            line: n + 1,
            expect: expect.trim().parse().expect("# expect NNN"),
            command: block[1..].join("\n"),
        });
    }
    out
}

#[tokio::test]
async fn docs_examples_run_against_a_live_server() {
    let markdown = std::fs::read_to_string(support::crate_path("docs/api.md")).unwrap();
    let examples = examples(&markdown);
    // Every endpoint has at least one example.
    for endpoint in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/proxies",
        "/v1/leases\"",
        "/renew",
        "/release",
    ] {
        assert!(
            examples.iter().any(|e| e.command.contains(endpoint)),
            "docs/api.md has no example for {endpoint}"
        );
    }
    let server = Server::start(demo_store(), tokens()).await;
    let dir = tempfile::tempdir().unwrap();
    let body_file = dir.path().join("body");
    let mut env: HashMap<&str, String> =
        HashMap::from([("EPO_URL", server.url.clone()), ("EPO_TOKEN", TOKEN.to_owned())]);
    for example in &examples {
        let command = format!(
            "{} -o '{}' -w '%{{http_code}}'",
            example.command,
            body_file.display()
        );
        let output = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(&command)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .await
            .expect("bash and curl are installed");
        let status = String::from_utf8_lossy(&output.stdout);
        let body = std::fs::read_to_string(&body_file).unwrap_or_default();
        assert_eq!(
            status.trim(),
            example.expect.to_string(),
            "docs/api.md line {}: {}\nbody: {body}\nstderr: {}",
            example.line,
            example.command,
            String::from_utf8_lossy(&output.stderr)
        );
        if let Ok(json) = serde_json::from_str::<Value>(&body) {
            if example.expect >= 400 {
                assert!(json["error"]["code"].is_string(), "line {}: {body}", example.line);
            }
            if let Some(id) = json["leaseId"].as_str() {
                env.insert("LEASE_ID", id.to_owned());
            }
            if let Some(token) = json["fencingToken"].as_u64()
                && let Some(old) = env.insert("FENCING_TOKEN", token.to_string())
            {
                env.insert("OLD_FENCING_TOKEN", old);
            }
        }
    }
    assert!(examples.len() >= 13, "found {} examples", examples.len());
    server.shutdown().await;
}

async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    method: &str,
    path: &str,
    token: &str,
    body: Value,
) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "epo")
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::from(if body.is_null() {
            String::new()
        } else {
            body.to_string()
        })))
        .unwrap();
    let response = sender.send_request(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

async fn connect(url: &str) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let addr = url.trim_start_matches("http://");
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

#[tokio::test]
async fn keep_alive_connection_serves_a_lease_lifecycle_then_shuts_down() {
    let server = Server::start(demo_store(), tokens()).await;
    let mut c = connect(&server.url).await;
    for _ in 0..50 {
        let (status, lease) = send(
            &mut c,
            "POST",
            "/v1/leases",
            TOKEN,
            json!({"holder": "k", "selector": {"region": "us"}}),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{lease}");
        let path = format!("/v1/leases/{}/release", lease["leaseId"].as_str().unwrap());
        let (status, _) = send(
            &mut c,
            "POST",
            &path,
            TOKEN,
            json!({"fencingToken": lease["fencingToken"], "outcome": "ok"}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    // An idle keep-alive connection does not hold the shutdown up: the server closes it.
    server.shutdown().await;
    support::eventually(
        Duration::from_secs(5),
        "the server closing the idle connection",
        || c.is_closed(),
    )
    .await;
}

#[tokio::test]
async fn leases_survive_a_leader_change() {
    let store_a = demo_store();
    let server_a = Server::start(store_a.clone(), tokens()).await;
    let mut c = connect(&server_a.url).await;
    let (_, known) = send(
        &mut c,
        "POST",
        "/v1/leases",
        TOKEN,
        json!({"holder": "a", "selector": {"region": "us"}}),
    )
    .await;
    // The leader's last checkpoint, as cluster mode stores it: chunks in Kubernetes objects.
    let chunks = encode_chunks(&store_a.checkpoint(), 900 * 1024).unwrap();
    let (_, missed) = send(
        &mut c,
        "POST",
        "/v1/leases",
        TOKEN,
        json!({"holder": "b", "selector": {"region": "us"}}),
    )
    .await;
    assert!(missed["leaseId"].is_string(), "{missed}");
    drop(c);
    server_a.shutdown().await;
    drop(store_a);

    let store_b = demo_store();
    store_b.restore(&decode_chunks(&chunks).unwrap().unwrap());
    let server_b = Server::start(store_b.clone(), tokens()).await;
    let mut c = connect(&server_b.url).await;
    let renew = |lease: &Value| {
        (
            format!("/v1/leases/{}/renew", lease["leaseId"].as_str().unwrap()),
            json!({"fencingToken": lease["fencingToken"]}),
        )
    };
    let (path, body) = renew(&known);
    let (status, renewed) = send(&mut c, "POST", &path, TOKEN, body).await;
    assert_eq!(status, StatusCode::OK, "{renewed}");
    assert!(renewed["fencingToken"].as_u64() > known["fencingToken"].as_u64());
    let (path, body) = renew(&missed);
    let (status, renewed_missed) = send(&mut c, "POST", &path, TOKEN, body).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the lease the checkpoint missed is honoured: {renewed_missed}"
    );
    // Limits count both: us-1 allows 2.
    let (status, refused) = send(
        &mut c,
        "POST",
        "/v1/leases",
        TOKEN,
        json!({"holder": "c", "selector": {"region": "us"}}),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{refused}");
    assert_eq!(store_b.active_leases(&ProxyKey::new("crawl", "us-1")), 2);
    // A forged ID (signed with another key) is unknown.
    let forged = LeaseSigner::new(&[1u8; 32]).unwrap();
    let mut claim = LeaseSigner::new(&SECRET)
        .unwrap()
        .verify(missed["leaseId"].as_str().unwrap())
        .unwrap();
    claim.holder = "mallory".into();
    let (status, _) = send(
        &mut c,
        "POST",
        &format!("/v1/leases/{}/renew", forged.sign(&claim)),
        TOKEN,
        json!({"fencingToken": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    server_b.shutdown().await;
}

/// A loopback stand-in for the API server's TokenReview endpoint.
async fn fake_token_review_server(calls: Arc<AtomicUsize>) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let calls = calls.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let calls = calls.clone();
                    async move {
                        let ok = req.method() == "POST"
                            && req.uri().path() == "/apis/authentication.k8s.io/v1/tokenreviews";
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let review: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        calls.fetch_add(1, Ordering::SeqCst);
                        let status = match review["spec"]["token"].as_str() {
                            Some("sa-bot") => {
                                json!({"authenticated": true, "user": {"username": "system:serviceaccount:crawlers:bot"}})
                            }
                            Some("sa-other") => {
                                json!({"authenticated": true, "user": {"username": "system:serviceaccount:other:x"}})
                            }
                            _ => json!({"authenticated": false}),
                        };
                        let answer = json!({
                            "apiVersion": "authentication.k8s.io/v1",
                            "kind": "TokenReview",
                            "metadata": {},
                            "spec": review["spec"],
                            "status": status,
                        });
                        let mut response = Response::new(Full::new(Bytes::from(answer.to_string())));
                        *response.status_mut() = if ok {
                            StatusCode::CREATED
                        } else {
                            StatusCode::NOT_FOUND
                        };
                        response
                            .headers_mut()
                            .insert("content-type", "application/json".parse().unwrap());
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, task)
}

#[tokio::test]
async fn token_review_lets_allowed_service_accounts_in() {
    let calls = Arc::new(AtomicUsize::new(0));
    let (api_url, api_task) = fake_token_review_server(calls.clone()).await;
    let config = kube::Config::new(api_url.parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let auth = Arc::new(TokenReviewAuthenticator::new(
        client,
        vec![],
        vec!["system:serviceaccount:crawlers:*".to_owned()],
    ));
    assert_eq!(
        auth.authenticate("sa-bot").await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
    assert_eq!(
        auth.authenticate("sa-other").await,
        Err(AuthError::Forbidden("system:serviceaccount:other:x".into()))
    );
    assert_eq!(
        auth.authenticate("garbage").await,
        Err(AuthError::Unauthenticated)
    );
    let before = calls.load(Ordering::SeqCst);
    assert_eq!(before, 3);
    auth.authenticate("sa-bot").await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), before, "answers are cached");

    let server = Server::start(demo_store(), auth).await;
    let mut c = connect(&server.url).await;
    let (status, _) = send(&mut c, "GET", "/v1/proxies", "sa-bot", Value::Null).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = send(&mut c, "GET", "/v1/proxies", "sa-other", Value::Null).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
    let (status, _) = send(&mut c, "GET", "/v1/proxies", "garbage", Value::Null).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    server.shutdown().await;
    api_task.abort();
}
