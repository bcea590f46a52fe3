//! The discovery API over real sockets: the curl examples of docs/api.md run against a live
//! server, keep-alive and graceful shutdown, authentication as `run` / `standalone` wire it
//! (TokenReview against the fake API server, static tokens from a file or Secret rotated without
//! a restart, the explicit opt-out), and leases that survive a leader change.

mod support;

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use egress_proxies_operator::{
    api::LeasePolicy,
    app::{DiscoveryAuthOptions, TOKEN_RELOAD_INTERVAL, discovery_authenticator},
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
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use support::fake_apiserver::{FakeApiServer, RequestMatcher, Verb};
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

/// Sends `GET path` with the `authorization` header only when `token` is given.
async fn get_with(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    path: &str,
    token: Option<&str>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method("GET").uri(path).header("host", "epo");
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let response = sender
        .send_request(req.body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Number of TokenReviews the fake API server answered.
fn token_reviews(api: &FakeApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.resource == "tokenreviews" && r.verb == Verb::Create)
        .count()
}

const AUDIENCE: &str = "egress-proxies-discovery";

#[tokio::test]
async fn token_review_against_the_fake_api_server() {
    let api = FakeApiServer::start().await;
    // Projected service-account tokens: two for the discovery API's audience, one for the API
    // server's own audience only (what every pod gets by default).
    api.add_token("sa-bot", "system:serviceaccount:crawlers:bot", &[AUDIENCE]);
    api.add_token("sa-other", "system:serviceaccount:other:x", &[AUDIENCE]);
    api.add_token("sa-default-audience", "system:serviceaccount:crawlers:lazy", &[]);
    let auth = Arc::new(TokenReviewAuthenticator::new(
        api.client(),
        vec![AUDIENCE.to_owned()],
        vec!["system:serviceaccount:crawlers:*".to_owned()],
    ));

    // Valid, allowed subject.
    assert_eq!(
        auth.authenticate("sa-bot").await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
    // Valid token, subject not allowed.
    assert_eq!(
        auth.authenticate("sa-other").await,
        Err(AuthError::Forbidden("system:serviceaccount:other:x".into()))
    );
    // Invalid token.
    assert_eq!(
        auth.authenticate("garbage").await,
        Err(AuthError::Unauthenticated)
    );
    // Valid token of an allowed subject, but not for this audience.
    assert_eq!(
        auth.authenticate("sa-default-audience").await,
        Err(AuthError::Unauthenticated)
    );
    assert_eq!(token_reviews(&api), 4);
    auth.authenticate("sa-bot").await.unwrap();
    assert_eq!(token_reviews(&api), 4, "answers are cached");

    let server = Server::start(demo_store(), auth.clone()).await;
    let mut c = connect(&server.url).await;
    let (status, _) = get_with(&mut c, "/v1/proxies", Some("sa-bot")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = get_with(&mut c, "/v1/proxies", Some("sa-other")).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
    for token in ["garbage", "sa-default-audience"] {
        let (status, body) = get_with(&mut c, "/v1/proxies", Some(token)).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (StatusCode::UNAUTHORIZED, Some("unauthorized")),
            "{token}"
        );
    }

    // API server down (answers 500, then not at all): a token not cached gets 503
    // auth_unavailable, never 401; a cached answer still serves.
    api.add_token("sa-new", "system:serviceaccount:crawlers:new", &[AUDIENCE]);
    api.fail_next(RequestMatcher::any().resource("tokenreviews"), 100, 500);
    let (status, body) = get_with(&mut c, "/v1/proxies", Some("sa-new")).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("auth_unavailable"))
    );
    let (status, _) = get_with(&mut c, "/v1/proxies", Some("sa-bot")).await;
    assert_eq!(status, StatusCode::OK, "cached while the API server is down");
    // Back: the failure was not cached.
    api.fail_next(RequestMatcher::any().resource("tokenreviews"), 0, 500);
    let (status, _) = get_with(&mut c, "/v1/proxies", Some("sa-new")).await;
    assert_eq!(status, StatusCode::OK);
    // Gone: connections refused.
    drop(api);
    let (status, body) = get_with(&mut c, "/v1/proxies", Some("sa-unknown")).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("auth_unavailable"))
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_token_review_that_hangs_answers_503_within_the_timeout() {
    let api = FakeApiServer::start().await;
    api.add_token("sa-bot", "system:serviceaccount:crawlers:bot", &[AUDIENCE]);
    api.set_latency(Duration::from_secs(30));
    let auth = TokenReviewAuthenticator::new(api.client(), vec![AUDIENCE.to_owned()], vec![])
        .with_timeout(Duration::from_millis(300));
    let asked = std::time::Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(10), auth.authenticate("sa-bot"))
        .await
        .expect("the review gives up by itself");
    assert!(matches!(answer, Err(AuthError::Unavailable(_))), "{answer:?}");
    assert!(asked.elapsed() < Duration::from_secs(5), "{:?}", asked.elapsed());
    // Not cached: once the API server answers again, the token works.
    api.set_latency(Duration::ZERO);
    assert_eq!(
        auth.authenticate("sa-bot").await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
}

#[tokio::test]
async fn static_tokens_and_token_review_together() {
    let api = FakeApiServer::start().await;
    api.add_token("sa-bot", "system:serviceaccount:crawlers:bot", &[AUDIENCE]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokens"), format!("{TOKEN}\n")).unwrap();
    let options = DiscoveryAuthOptions {
        tokens_file: Some(dir.path().join("tokens")),
        token_review_audiences: vec![AUDIENCE.to_owned()],
        ..DiscoveryAuthOptions::default()
    };
    let client = api.client();
    let auth = discovery_authenticator(&options, Some((&client, "egress-proxies-system")))
        .await
        .unwrap();
    assert_eq!(auth.authenticate(TOKEN).await.unwrap().name, "token-1");
    assert_eq!(token_reviews(&api), 0, "a static token needs no TokenReview");
    assert_eq!(
        auth.authenticate("sa-bot").await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
    assert_eq!(
        auth.authenticate("garbage").await,
        Err(AuthError::Unauthenticated)
    );
    // The API server down: static tokens still work, others are "unavailable", not "invalid".
    drop(api);
    assert_eq!(auth.authenticate(TOKEN).await.unwrap().name, "token-1");
    assert!(matches!(
        auth.authenticate("unknown").await,
        Err(AuthError::Unavailable(_))
    ));
}

/// Writes `content` to `path` the way the kubelet updates a mounted Secret: a new file renamed
/// over the old one, so no reader sees half a file.
fn replace_file(path: &std::path::Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn rotating_the_token_file_takes_effect_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, "old-token\n").unwrap();
    // The options `run --discovery-tokens FILE` and `standalone --discovery-tokens FILE` build.
    let options = DiscoveryAuthOptions::tokens_file(path.clone());
    assert_eq!(options.reload_interval, TOKEN_RELOAD_INTERVAL);
    let auth = discovery_authenticator(&options, None).await.unwrap();
    let server = Server::start(demo_store(), auth).await;
    let mut c = connect(&server.url).await;
    assert_eq!(
        get_with(&mut c, "/v1/proxies", Some("old-token")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        get_with(&mut c, "/v1/proxies", Some("new-token")).await.0,
        StatusCode::UNAUTHORIZED
    );

    let rotated = std::time::Instant::now();
    replace_file(&path, "# rotated\nnew-token\n");
    let deadline = rotated + TOKEN_RELOAD_INTERVAL * 3;
    loop {
        let new = get_with(&mut c, "/v1/proxies", Some("new-token")).await.0;
        let old = get_with(&mut c, "/v1/proxies", Some("old-token")).await.0;
        if new == StatusCode::OK && old == StatusCode::UNAUTHORIZED {
            break;
        }
        // Never both, never neither: the set is swapped whole.
        assert!(
            (new == StatusCode::OK) != (old == StatusCode::OK),
            "new {new}, old {old}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "rotation not in force after {:?}",
            rotated.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("token file rotation in force after {:?}", rotated.elapsed());

    // An unreadable file keeps the tokens last read (a transient error locks nobody out)...
    std::fs::remove_file(&path).unwrap();
    let gone = std::time::Instant::now();
    while gone.elapsed() < TOKEN_RELOAD_INTERVAL * 2 {
        assert_eq!(
            get_with(&mut c, "/v1/proxies", Some("new-token")).await.0,
            StatusCode::OK
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // ...and a file that is back is read again.
    replace_file(&path, "third-token\n");
    let deadline = std::time::Instant::now() + TOKEN_RELOAD_INTERVAL * 3;
    while get_with(&mut c, "/v1/proxies", Some("third-token")).await.0 != StatusCode::OK {
        assert!(
            std::time::Instant::now() < deadline,
            "the restored file was not read"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        get_with(&mut c, "/v1/proxies", Some("new-token")).await.0,
        StatusCode::UNAUTHORIZED
    );
    server.shutdown().await;
}

#[tokio::test]
async fn rotating_the_token_secret_takes_effect_without_a_restart() {
    let api = FakeApiServer::start().await;
    let secret = |tokens: &[(&str, &str)]| {
        let data: serde_json::Map<String, Value> = tokens
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(base64(v))))
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "discovery-tokens", "namespace": "egress-proxies-system"},
            "data": data,
        })
    };
    api.put_json(
        "secrets",
        secret(&[("crawler-a", "token-a"), ("crawler-b", "token-b\n")]),
    );
    let client = api.client();
    let options = DiscoveryAuthOptions {
        tokens_secret: Some("discovery-tokens".into()),
        reload_interval: Duration::from_millis(100),
        ..DiscoveryAuthOptions::default()
    };
    let auth = discovery_authenticator(&options, Some((&client, "egress-proxies-system")))
        .await
        .unwrap();
    assert_eq!(auth.authenticate("token-a").await.unwrap().name, "crawler-a");
    assert_eq!(auth.authenticate("token-b").await.unwrap().name, "crawler-b");

    api.put_json(
        "secrets",
        secret(&[("crawler-a", "token-a2"), ("crawler-b", "token-b")]),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while auth.authenticate("token-a").await.is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "the rotated Secret was not read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(auth.authenticate("token-a2").await.unwrap().name, "crawler-a");
    assert_eq!(auth.authenticate("token-b").await.unwrap().name, "crawler-b");

    // A missing Secret is a start-up error, not an open door.
    let missing = DiscoveryAuthOptions {
        tokens_secret: Some("absent".into()),
        ..options.clone()
    };
    assert!(
        discovery_authenticator(&missing, Some((&client, "egress-proxies-system")))
            .await
            .is_err()
    );
}

fn base64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[tokio::test]
async fn no_authentication_only_as_an_explicit_opt_out() {
    // Nothing chosen: refused, naming the opt-out.
    let err = discovery_authenticator(&DiscoveryAuthOptions::default(), None)
        .await
        .err()
        .expect("no method and no opt-out is an error");
    assert!(err.to_string().contains("--discovery-no-auth"), "{err}");
    // The opt-out does not combine with a method.
    let both = DiscoveryAuthOptions {
        no_auth: true,
        ..DiscoveryAuthOptions::tokens_file("tokens".into())
    };
    assert!(both.validate(true).is_err());
    // Kubernetes-only methods need cluster mode.
    let review = DiscoveryAuthOptions {
        token_review_audiences: vec![AUDIENCE.to_owned()],
        ..DiscoveryAuthOptions::default()
    };
    assert!(review.validate(true).is_ok() && review.validate(false).is_err());
    let subjects_alone = DiscoveryAuthOptions {
        allowed_subjects: vec!["system:serviceaccount:crawlers:*".to_owned()],
        ..DiscoveryAuthOptions::tokens_file("tokens".into())
    };
    assert!(subjects_alone.validate(true).is_err());

    let open = DiscoveryAuthOptions {
        no_auth: true,
        ..DiscoveryAuthOptions::default()
    };
    let server = Server::start(demo_store(), discovery_authenticator(&open, None).await.unwrap()).await;
    let mut c = connect(&server.url).await;
    let (status, body) = get_with(&mut c, "/v1/proxies", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.to_string().contains("crawl/eu-1"), "{body}");
    server.shutdown().await;
}
