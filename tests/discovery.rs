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

/// Sends raw bytes on a fresh connection (then half-closes it if asked) and reads one response:
/// status, head, body.
async fn raw_exchange(url: &str, request: &[u8], half_close: bool) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .unwrap();
    // The server may answer (and close) before it has read everything: a failed write is fine.
    let _ = stream.write_all(request).await;
    if half_close {
        let _ = stream.shutdown().await;
    }
    let mut buf = Vec::new();
    let read = async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await.unwrap_or(0);
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if buf.len() >= end + 4 + len || n == 0 {
                    return end;
                }
            } else if n == 0 {
                return buf.len();
            }
        }
    };
    let end = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the server answers");
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let body = String::from_utf8_lossy(buf.get(end + 4..).unwrap_or_default()).into_owned();
    let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head, body)
}

#[tokio::test]
async fn errors_from_the_http_layer_have_the_json_error_body() {
    let server = Server::start(demo_store(), tokens()).await;
    let auth = format!("authorization: Bearer {TOKEN}\r\n");
    let many_headers: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    let huge_header = format!("x-big: {}\r\n", "a".repeat(500 * 1024));
    let long_uri = format!("/v1/proxies?selector={}", "a".repeat(70 * 1024));
    let cases: Vec<(&str, String, bool, u16, &str)> = vec![
        (
            "too many headers",
            format!("GET /v1/proxies HTTP/1.1\r\nhost: x\r\n{many_headers}\r\n"),
            false,
            431,
            "headers_too_large",
        ),
        (
            "headers over the buffer",
            format!("GET /v1/proxies HTTP/1.1\r\nhost: x\r\n{huge_header}\r\n"),
            false,
            431,
            "headers_too_large",
        ),
        (
            "URI too long",
            format!("GET {long_uri} HTTP/1.1\r\nhost: x\r\n\r\n"),
            false,
            414,
            "uri_too_long",
        ),
        (
            "garbage request line",
            "HELLO THERE\r\n\r\n".to_owned(),
            false,
            400,
            "malformed_request",
        ),
        (
            "Content-Length not a number",
            format!("POST /v1/leases HTTP/1.1\r\nhost: x\r\n{auth}content-length: ten\r\n\r\n{{}}"),
            false,
            400,
            "malformed_request",
        ),
        (
            "two different Content-Lengths",
            format!(
                "POST /v1/leases HTTP/1.1\r\nhost: x\r\n{auth}content-length: 2\r\ncontent-length: 3\r\n\r\n{{}}"
            ),
            false,
            400,
            "malformed_request",
        ),
        (
            "HTTP/1.0 with chunked Transfer-Encoding",
            format!(
                "POST /v1/leases HTTP/1.0\r\nhost: x\r\n{auth}transfer-encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
            ),
            false,
            400,
            "malformed_request",
        ),
        (
            "bad chunk size",
            format!(
                "POST /v1/leases HTTP/1.1\r\nhost: x\r\n{auth}transfer-encoding: chunked\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n"
            ),
            false,
            400,
            "malformed_request",
        ),
        (
            "body shorter than its Content-Length",
            format!("POST /v1/leases HTTP/1.1\r\nhost: x\r\n{auth}content-length: 100\r\n\r\n{{\"holder\":"),
            true,
            400,
            "malformed_request",
        ),
        (
            "HTTP/1.0 request on a wrong method",
            "DELETE /v1/proxies HTTP/1.0\r\n\r\n".to_owned(),
            false,
            405,
            "method_not_allowed",
        ),
    ];
    for (what, request, half_close, status, code) in cases {
        let (got, head, body) = raw_exchange(&server.url, request.as_bytes(), half_close).await;
        assert_eq!(got, status, "{what}: {head}\n{body}");
        assert!(
            head.to_lowercase().contains("content-type: application/json"),
            "{what}: {head}"
        );
        let json: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: {e}: {body:?}"));
        assert_eq!(json["error"]["code"], code, "{what}: {body}");
        assert!(json["error"]["message"].is_string(), "{what}: {body}");
    }
    // A well-formed request on a fresh connection is still served.
    let (got, _, _) = raw_exchange(&server.url, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n", false).await;
    assert_eq!(got, 200);
    server.shutdown().await;
}

/// What one probe of the race below saw, and when (wall-clock ms around the exchange).
#[derive(Debug)]
struct Probe {
    what: &'static str,
    sent_ms: u64,
    received_ms: u64,
    /// Whether the probe found the first lease still in force.
    exists: bool,
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test]
async fn listing_acquire_renew_and_release_agree_around_expires_at() {
    // One proxy, one slot, no cooldown: the moment the lease expires, its slot is free.
    let store = LeaseStore::new(LeaseStoreConfig::default());
    let key = ProxyKey::new("crawl", "solo");
    store.upsert_proxy(LeaseTarget {
        key: key.clone(),
        endpoint: Endpoint {
            host: "127.0.0.1".into(),
            port: 3128,
        },
        attributes: BTreeMap::from([("region".to_owned(), "solo".to_owned())]),
        policy: LeasePolicy {
            max_concurrent: 1,
            cooldown_seconds: 0,
            max_ttl_seconds: 3600,
        },
        credentials: None,
    });
    store.set_admission(&key, Admission::Open).unwrap();
    let server = Server::start(store, tokens()).await;
    let mut c = connect(&server.url).await;
    let (status, lease) = send(
        &mut c,
        "POST",
        "/v1/leases",
        TOKEN,
        json!({"holder": "first", "selector": {"region": "solo"}, "ttlSeconds": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{lease}");
    let expires_ms = lease["expiresAt"]
        .as_str()
        .unwrap()
        .parse::<jiff::Timestamp>()
        .unwrap()
        .as_millisecond() as u64;
    let id = lease["leaseId"].as_str().unwrap().to_owned();
    let stale = lease["fencingToken"].as_u64().unwrap() - 1;
    let until = expires_ms + 300;
    // Four kinds of probe race each other from 4 connections until 300 ms past expiresAt.
    // Stale-token renew and release change nothing (409 while the lease exists, 404 after);
    // acquire stops at its first success, which takes the slot over.
    let acquired = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for what in ["list", "renew", "release", "acquire"] {
        let (url, id, acquired) = (server.url.clone(), id.clone(), acquired.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            let mut seen = Vec::new();
            while wall_ms() < until && !(what == "acquire" && acquired.load(Ordering::SeqCst)) {
                let sent_ms = wall_ms();
                let exists = match what {
                    "list" => {
                        let (s, body) = send(&mut c, "GET", "/v1/proxies", TOKEN, Value::Null).await;
                        assert_eq!(s, StatusCode::OK);
                        let p = &body["proxies"][0];
                        match (
                            p["availability"].as_str().unwrap(),
                            p["activeLeases"].as_u64().unwrap(),
                        ) {
                            ("busy", 1) => true,
                            ("available", 0) => false,
                            other => panic!("listing: {other:?}"),
                        }
                    }
                    "renew" | "release" => {
                        let body = if what == "renew" {
                            json!({"fencingToken": stale})
                        } else {
                            json!({"fencingToken": stale, "outcome": "ok"})
                        };
                        let path = format!("/v1/leases/{id}/{what}");
                        let (s, body) = send(&mut c, "POST", &path, TOKEN, body).await;
                        match s {
                            StatusCode::CONFLICT => true,
                            StatusCode::NOT_FOUND => false,
                            other => panic!("{what}: {other} {body}"),
                        }
                    }
                    _ => {
                        let (s, body) = send(
                            &mut c,
                            "POST",
                            "/v1/leases",
                            TOKEN,
                            json!({"holder": "second", "selector": {"region": "solo"}, "ttlSeconds": 60}),
                        )
                        .await;
                        match s {
                            StatusCode::SERVICE_UNAVAILABLE => false,
                            StatusCode::CREATED => {
                                acquired.store(true, Ordering::SeqCst);
                                true
                            }
                            other => panic!("acquire: {other} {body}"),
                        }
                        // For acquire, `exists` is inverted below: 503 means the first lease holds.
                    }
                };
                let exists = if what == "acquire" { !exists } else { exists };
                seen.push(Probe {
                    what,
                    sent_ms,
                    received_ms: wall_ms(),
                    exists,
                });
            }
            seen
        }));
    }
    let mut probes = Vec::new();
    for t in tasks {
        probes.extend(t.await.unwrap());
    }
    let acquired_at = probes
        .iter()
        .find(|p| p.what == "acquire" && !p.exists)
        .map(|p| p.sent_ms)
        .expect("the slot was acquired after the expiry");
    // The second lease makes the listing busy again: listings sent after its acquire was sent
    // say nothing about the first lease.
    probes.retain(|p| !(p.what == "list" && p.received_ms >= acquired_at));
    // (1) Answered before expiresAt: the lease exists for everyone. (The store's clock may lag
    //     the wall clock by a tick, never lead it.)
    for p in probes.iter().filter(|p| p.received_ms < expires_ms) {
        assert!(
            p.exists,
            "{p:?} answered before expiresAt {expires_ms} but saw no lease"
        );
    }
    // (2) Sent well after expiresAt: gone for everyone.
    for p in probes.iter().filter(|p| p.sent_ms > expires_ms + 50) {
        assert!(
            !p.exists,
            "{p:?} sent after expiresAt {expires_ms} but saw the lease"
        );
    }
    // (3) No endpoint contradicts another: once any probe saw it gone, every probe sent after
    //     that answer arrived sees it gone too.
    for gone in probes.iter().filter(|p| !p.exists) {
        for later in probes.iter().filter(|q| q.sent_ms > gone.received_ms) {
            assert!(!later.exists, "{later:?} saw the lease after {gone:?} did not");
        }
    }
    for what in ["list", "renew", "release", "acquire"] {
        assert!(
            probes.iter().any(|p| p.what == what && p.exists),
            "no {what} probe before the expiry"
        );
    }
    server.shutdown().await;
}
