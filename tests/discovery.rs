//! The discovery API over real sockets: the curl examples of docs/api.md run against a live
//! server, keep-alive and graceful shutdown, authentication as `run` / `standalone` wire it
//! (TokenReview against a real kube-apiserver with tokens from its TokenRequest API, frozen or
//! stopped; static tokens from a file or Secret rotated without a restart; the explicit opt-out), leases that survive a leader change, the JSON bodies of the
//! errors hyper answers by itself, every endpoint agreeing on a lease around its `expiresAt`,
//! and the OpenAPI contract (drift against docs/openapi.json, every documented response checked
//! against it).

mod support;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use bytes::Bytes;
use egress_proxies_operator::{
    api::{LeasePolicy, ProxyKey},
    app::{DiscoveryAuthOptions, TOKEN_RELOAD_INTERVAL, discovery_authenticator},
    discovery::{
        self, Authenticator, DiscoveryConfig, DiscoveryDeps, DiscoveryMetrics, DiscoveryState, Readiness,
        StaticTokens, TokenReviewAuthenticator, auth::AuthError,
    },
    lease::{
        AcquireRequest, Admission, LeaseStore, LeaseStoreConfig, LeaseTarget, Selector,
        checkpoint::{decode_chunks, encode_chunks},
        journal::{Journal, JournalConfig, JournalMetrics, SEGMENT_PREFIX},
        token::LeaseSigner,
    },
    provider::{Credentials, Endpoint},
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use support::control_plane::{ControlPlane, RequestCounts};
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
            ])
            .into(),
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
    state: DiscoveryState,
    ready: watch::Sender<Readiness>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    async fn start(store: LeaseStore, auth: Arc<dyn Authenticator>) -> Server {
        let mut registry = Registry::default();
        let metrics = DiscoveryMetrics::register(&mut registry);
        let (ready, readiness) = watch::channel(Readiness {
            caches_synced: true,
            leader: true,
            ..Readiness::default()
        });
        // The token `over-quota` has used its one acquire of the day.
        let usage = egress_proxies_operator::usage::Usage::default();
        let quotas = "quotas:\n  - {token: over-quota, requests: 1, period: 1d}\n";
        usage.set_quotas(egress_proxies_operator::usage::Quotas::parse(quotas, "quotas.yaml").unwrap());
        usage.admit("over-quota", "c", store.now_ms()).unwrap();
        let state = DiscoveryState::new(DiscoveryDeps {
            store,
            signer: LeaseSigner::new(&SECRET).unwrap(),
            auth,
            readiness,
            registry: Arc::new(registry),
            metrics,
            outcomes: Default::default(),
            usage,
            politeness: Default::default(),
            config: DiscoveryConfig::default(),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(discovery::serve(listener, state.clone(), async {
            let _ = stopped.await;
        }));
        Server {
            url,
            state,
            ready,
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
        "/outcomes",
        "/release",
        "/v1/usage",
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

/// TokenReviews the API server answered since `before` (by its own counters).
async fn token_reviews_since(plane: &ControlPlane, before: &RequestCounts) -> f64 {
    plane
        .settled_request_counts()
        .await
        .since(before, "tokenreviews", &["POST"])
}

const AUDIENCE: &str = "egress-proxies-discovery";

/// A control plane with namespaces `crawlers` and `other`, and ServiceAccount tokens from its
/// TokenRequest API: `bot` and `new` (crawlers) and `x` (other) for the discovery API's
/// audience, `lazy` (crawlers) for the API server's own audience only (what every pod gets by
/// default).
struct Tokens {
    plane: ControlPlane,
    bot: String,
    new: String,
    other: String,
    default_audience: String,
}

impl Tokens {
    async fn start() -> Self {
        let plane = ControlPlane::start().await;
        plane.create_namespace("crawlers").await;
        plane.create_namespace("other").await;
        let bot = plane.service_account_token("crawlers", "bot", &[AUDIENCE]).await;
        let new = plane.service_account_token("crawlers", "new", &[AUDIENCE]).await;
        let other = plane.service_account_token("other", "x", &[AUDIENCE]).await;
        let default_audience = plane.service_account_token("crawlers", "lazy", &[]).await;
        Self {
            plane,
            bot,
            new,
            other,
            default_audience,
        }
    }
}

#[tokio::test]
async fn token_review_against_a_real_api_server() {
    let Tokens {
        mut plane,
        bot,
        new,
        other,
        default_audience,
    } = Tokens::start().await;
    let auth = Arc::new(TokenReviewAuthenticator::new(
        plane.client().await,
        vec![AUDIENCE.to_owned()],
        vec!["system:serviceaccount:crawlers:*".to_owned()],
    ));
    let before = plane.settled_request_counts().await;

    // Valid, allowed subject.
    assert_eq!(
        auth.authenticate(&bot).await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
    // Valid token, subject not allowed.
    assert_eq!(
        auth.authenticate(&other).await,
        Err(AuthError::Forbidden("system:serviceaccount:other:x".into()))
    );
    // Invalid token.
    assert_eq!(
        auth.authenticate("garbage").await,
        Err(AuthError::Unauthenticated)
    );
    // Valid token of an allowed subject, but not for this audience.
    assert_eq!(
        auth.authenticate(&default_audience).await,
        Err(AuthError::Unauthenticated)
    );
    assert_eq!(token_reviews_since(&plane, &before).await, 4.0);
    auth.authenticate(&bot).await.unwrap();
    assert_eq!(
        token_reviews_since(&plane, &before).await,
        4.0,
        "answers are cached"
    );

    let server = Server::start(demo_store(), auth.clone()).await;
    let mut c = connect(&server.url).await;
    let (status, _) = get_with(&mut c, "/v1/proxies", Some(&bot)).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = get_with(&mut c, "/v1/proxies", Some(&other)).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
    for token in ["garbage", &default_audience] {
        let (status, body) = get_with(&mut c, "/v1/proxies", Some(token)).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (StatusCode::UNAUTHORIZED, Some("unauthorized")),
            "{token}"
        );
    }

    // API server down (connections refused): a token not cached gets 503 auth_unavailable,
    // never 401; a cached answer still serves.
    plane.stop_apiserver().await;
    let (status, body) = get_with(&mut c, "/v1/proxies", Some(&new)).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("auth_unavailable"))
    );
    let (status, _) = get_with(&mut c, "/v1/proxies", Some(&bot)).await;
    assert_eq!(status, StatusCode::OK, "cached while the API server is down");
    // Back: the failure was not cached.
    plane.start_apiserver_again().await;
    let (status, _) = get_with(&mut c, "/v1/proxies", Some(&new)).await;
    assert_eq!(status, StatusCode::OK);
    server.shutdown().await;
}

#[tokio::test]
async fn a_token_review_that_hangs_answers_503_within_the_timeout() {
    let Tokens { plane, bot, .. } = Tokens::start().await;
    let auth = TokenReviewAuthenticator::new(plane.client().await, vec![AUDIENCE.to_owned()], vec![])
        .with_timeout(Duration::from_millis(300));
    plane.freeze_apiserver();
    let asked = std::time::Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(10), auth.authenticate(&bot))
        .await
        .expect("the review gives up by itself");
    let waited = asked.elapsed();
    plane.thaw_apiserver();
    assert!(matches!(answer, Err(AuthError::Unavailable(_))), "{answer:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    // Not cached: once the API server answers again, the token works.
    assert_eq!(
        auth.authenticate(&bot).await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
}

#[tokio::test]
async fn static_tokens_and_token_review_together() {
    let Tokens { mut plane, bot, .. } = Tokens::start().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokens"), format!("{TOKEN}\n")).unwrap();
    let options = DiscoveryAuthOptions {
        tokens_file: Some(dir.path().join("tokens")),
        token_review_audiences: vec![AUDIENCE.to_owned()],
        ..DiscoveryAuthOptions::default()
    };
    let client = plane.client().await;
    let auth = discovery_authenticator(&options, Some((&client, "egress-proxies-system")))
        .await
        .unwrap();
    let before = plane.settled_request_counts().await;
    assert_eq!(auth.authenticate(TOKEN).await.unwrap().name, "token-1");
    assert_eq!(
        token_reviews_since(&plane, &before).await,
        0.0,
        "a static token needs no TokenReview"
    );
    assert_eq!(
        auth.authenticate(&bot).await.unwrap().name,
        "system:serviceaccount:crawlers:bot"
    );
    assert_eq!(
        auth.authenticate("garbage").await,
        Err(AuthError::Unauthenticated)
    );
    // The API server down: static tokens still work, others are "unavailable", not "invalid".
    plane.stop_apiserver().await;
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

/// A keep-alive connection's token is looked up once and its verdict remembered
/// (`RememberedVerdict`); a connection that keeps sending a token the reloaded file no longer
/// holds is refused from the reload on, like a new one.
#[tokio::test]
async fn a_remembered_token_is_refused_once_the_file_drops_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, "kept-token\n").unwrap();
    let auth = discovery_authenticator(&DiscoveryAuthOptions::tokens_file(path.clone()), None)
        .await
        .unwrap();
    let server = Server::start(demo_store(), auth).await;
    let mut kept = connect(&server.url).await;
    for _ in 0..3 {
        assert_eq!(
            get_with(&mut kept, "/v1/proxies", Some("kept-token")).await.0,
            StatusCode::OK
        );
    }
    replace_file(&path, "other-token\n");
    // A new connection tells when the reload is in force; the kept one must agree from then on.
    let deadline = std::time::Instant::now() + TOKEN_RELOAD_INTERVAL * 3;
    loop {
        let mut fresh = connect(&server.url).await;
        if get_with(&mut fresh, "/v1/proxies", Some("kept-token")).await.0 == StatusCode::UNAUTHORIZED {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the file was not reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        get_with(&mut kept, "/v1/proxies", Some("kept-token")).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        get_with(&mut kept, "/v1/proxies", Some("other-token")).await.0,
        StatusCode::OK
    );
    server.shutdown().await;
}

#[tokio::test]
async fn rotating_the_token_secret_takes_effect_without_a_restart() {
    let plane = ControlPlane::start().await;
    plane.create_namespace("egress-proxies-system").await;
    let client = plane.client().await;
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(client.clone(), "egress-proxies-system");
    let secret = |tokens: &[(&str, &str)]| {
        let data: serde_json::Map<String, Value> = tokens
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(base64(v))))
            .collect();
        serde_json::from_value::<k8s_openapi::api::core::v1::Secret>(json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "discovery-tokens", "namespace": "egress-proxies-system"},
            "data": data,
        }))
        .expect("a Secret")
    };
    secrets
        .create(
            &kube::api::PostParams::default(),
            &secret(&[("crawler-a", "token-a"), ("crawler-b", "token-b\n")]),
        )
        .await
        .expect("Secret created");
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

    secrets
        .replace(
            "discovery-tokens",
            &kube::api::PostParams::default(),
            &secret(&[("crawler-a", "token-a2"), ("crawler-b", "token-b")]),
        )
        .await
        .expect("Secret rotated");
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
        attributes: BTreeMap::from([("region".to_owned(), "solo".to_owned())]).into(),
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
    let until = expires_ms + 1000;
    // Four kinds of probe race each other from 4 connections until a second past expiresAt.
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

/// Tokens with fixed verdicts: [`TOKEN`] passes, `forbidden-token` is 403, `down-token` 503.
struct Verdicts;

#[async_trait::async_trait]
impl Authenticator for Verdicts {
    async fn authenticate(&self, token: &str) -> Result<discovery::Identity, AuthError> {
        match token {
            TOKEN => Ok(discovery::Identity {
                name: "crawler".into(),
            }),
            "forbidden-token" => Err(AuthError::Forbidden("the outsider".into())),
            "down-token" => Err(AuthError::Unavailable("API server unreachable".into())),
            // Its quota is used up (`Server::start`).
            "quota-token" => Ok(discovery::Identity {
                name: "over-quota".into(),
            }),
            _ => Err(AuthError::Unauthenticated),
        }
    }
}

#[test]
fn checked_in_openapi_contract_matches_the_types() {
    let on_disk = std::fs::read_to_string(support::crate_path("docs/openapi.json")).unwrap();
    assert!(
        on_disk == discovery::openapi::json(),
        "docs/openapi.json drifted from src/discovery; run `cargo run -- openapi > docs/openapi.json` and commit"
    );
    let doc: Value = serde_json::from_str(&on_disk).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
}

/// Checks one real answer against the contract: the operation documents its status (or, for
/// answers no operation owns, the component response does), the content type is the documented
/// one, the body validates against the documented schema, an error's description names its
/// code, and documented headers are present and valid.
struct Contract {
    doc: Value,
    seen: std::collections::BTreeSet<(String, String, u16)>,
    codes: std::collections::BTreeSet<String>,
}

impl Contract {
    /// Why `instance` does not conform to `schema` (empty if it does).
    fn violations(&self, schema: &Value, instance: &Value) -> Vec<String> {
        // The whole document is the root, so `#/components/...` references resolve.
        let mut root = self.doc.clone();
        root["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
        root["allOf"] = json!([schema]);
        let validator = jsonschema::validator_for(&root).unwrap();
        validator.iter_errors(instance).map(|e| e.to_string()).collect()
    }

    fn validate(&self, schema: &Value, instance: &Value, what: &str) {
        let errors = self.violations(schema, instance);
        assert!(
            errors.is_empty(),
            "{what}: {instance} does not conform: {errors:?}"
        );
    }

    /// `template` is the documented path, or `None` for the component responses.
    fn check(&mut self, method: &str, template: Option<&str>, status: u16, head: &str, body: &str) {
        let what = format!("{method} {template:?} -> {status}");
        let response = match template {
            Some(t) => self.doc["paths"][t][method.to_lowercase()]["responses"][status.to_string()].clone(),
            None => {
                let name = match status {
                    400 => "HttpLayerBadRequest",
                    404 => "NotFound",
                    405 => "MethodNotAllowed",
                    414 => "HttpLayerUriTooLong",
                    431 => "HttpLayerHeadersTooLarge",
                    other => panic!("{what}: no component response for {other}"),
                };
                self.doc["components"]["responses"][name].clone()
            }
        };
        assert!(response.is_object(), "{what}: not documented");
        let header = |name: &str| {
            head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
            })
        };
        let content_type = header("content-type").unwrap_or_default();
        let content = response["content"]
            .as_object()
            .expect("every response has content");
        let (documented_type, media) = content.iter().next().unwrap();
        assert!(
            content_type.starts_with(documented_type.split(';').next().unwrap()),
            "{what}: content type {content_type}, documented {documented_type}"
        );
        if documented_type == "application/json" {
            let instance: Value =
                serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: {body}"));
            self.validate(&media["schema"], &instance, &what);
            if let Some(code) = instance["error"]["code"].as_str() {
                let description = response["description"].as_str().unwrap_or_default();
                assert!(
                    description.contains(&format!("`{code}`")),
                    "{what}: code {code} is not in the documented description {description:?}"
                );
                self.codes.insert(code.to_owned());
            }
        }
        if let Some(headers) = response["headers"].as_object() {
            for (name, spec) in headers {
                let value = header(name).unwrap_or_else(|| panic!("{what}: no {name} header"));
                let number: Value = value.parse::<u64>().map_or(json!(value), |n| json!(n));
                self.validate(&spec["schema"], &number, &format!("{what} header {name}"));
            }
        }
        if status == 405 {
            assert!(header("allow").is_some(), "{what}: 405 without Allow");
        }
        if let Some(t) = template {
            self.seen.insert((t.to_owned(), method.to_lowercase(), status));
        }
    }
}

#[tokio::test]
async fn every_documented_response_conforms_to_the_openapi_contract() {
    let store = demo_store();
    let server = Server::start(store.clone(), Arc::new(Verdicts)).await;
    let served = raw_exchange(
        &server.url,
        b"GET /v1/openapi.json HTTP/1.1\r\nhost: x\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(
        served.2,
        discovery::openapi::json(),
        "the served contract is the generated one"
    );
    let mut contract = Contract {
        doc: serde_json::from_str(&served.2).unwrap(),
        seen: Default::default(),
        codes: Default::default(),
    };
    // The check can fail: what the contract does not allow is caught.
    let error = json!({"$ref": "#/components/schemas/Error"});
    for bad in [
        json!({"error": {"code": "made_up", "message": "m"}}),
        json!({"error": {"code": "not_found"}}),
        json!({"error": {"code": "not_found", "message": "m", "extra": 1}}),
        json!({"code": "not_found", "message": "m"}),
    ] {
        assert!(!contract.violations(&error, &bad).is_empty(), "{bad} passed");
    }
    let proxy = json!({"$ref": "#/components/schemas/Proxy"});
    let listed = json!({"key": "a/b", "namespace": "a", "name": "b", "endpoint": "h:1", "attributes": {}, "availability": "sleeping"});
    assert!(!contract.violations(&proxy, &listed).is_empty());

    // One request on a fresh connection: method, path, token, body.
    async fn call(
        url: &str,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (u16, String, String) {
        let auth = token
            .map(|t| format!("authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        raw_exchange(url, request.as_bytes(), false).await
    }
    let url = server.url.clone();
    let big = format!("{{\"holder\":\"{}\"}}", "a".repeat(20_000));
    let acquire = r#"{"holder":"c","selector":{"region":"us"},"targetDomain":"shop.example"}"#;

    // A lease to renew and release, on us-1 (two slots).
    let (status, head, body) = call(&url, "POST", "/v1/leases", Some(TOKEN), acquire).await;
    contract.check("POST", Some("/v1/leases"), status, &head, &body);
    assert_eq!(status, 201, "{body}");
    let lease: Value = serde_json::from_str(&body).unwrap();
    let id = lease["leaseId"].as_str().unwrap().to_owned();
    let first = lease["fencingToken"].as_u64().unwrap();
    let renew_path = format!("/v1/leases/{id}/renew");
    let release_path = format!("/v1/leases/{id}/release");
    let (status, head, body) = call(
        &url,
        "POST",
        &renew_path,
        Some(TOKEN),
        &format!(r#"{{"fencingToken":{first}}}"#),
    )
    .await;
    contract.check("POST", Some("/v1/leases/{leaseId}/renew"), status, &head, &body);
    assert_eq!(status, 200, "{body}");
    let current = serde_json::from_str::<Value>(&body).unwrap()["fencingToken"]
        .as_u64()
        .unwrap();

    let renew = "/v1/leases/{leaseId}/renew";
    let release = "/v1/leases/{leaseId}/release";
    let outcomes = "/v1/leases/{leaseId}/outcomes";
    let outcomes_path = format!("/v1/leases/{id}/outcomes");
    let stale_release = format!(r#"{{"fencingToken":{first},"outcome":"ok"}}"#);
    // method, path, token, body, documented path (None: a component response), status
    type Case<'a> = (&'a str, String, Option<&'a str>, String, Option<&'a str>, u16);
    let mut listed_outcomes = false;
    let cases: Vec<Case> = vec![
        (
            "GET",
            "/healthz".into(),
            None,
            String::new(),
            Some("/healthz"),
            200,
        ),
        ("GET", "/readyz".into(), None, String::new(), Some("/readyz"), 200),
        (
            "GET",
            "/metrics".into(),
            None,
            String::new(),
            Some("/metrics"),
            200,
        ),
        (
            "GET",
            "/v1/openapi.json".into(),
            None,
            String::new(),
            Some("/v1/openapi.json"),
            200,
        ),
        (
            "GET",
            "/v1/proxies?selector=region%3Deu".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/proxies"),
            200,
        ),
        (
            "GET",
            "/v1/proxies?selector=region".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/proxies"),
            400,
        ),
        (
            "GET",
            "/v1/proxies".into(),
            None,
            String::new(),
            Some("/v1/proxies"),
            401,
        ),
        (
            "GET",
            "/v1/proxies".into(),
            Some("forbidden-token"),
            String::new(),
            Some("/v1/proxies"),
            403,
        ),
        (
            "GET",
            "/v1/proxies".into(),
            Some("down-token"),
            String::new(),
            Some("/v1/proxies"),
            503,
        ),
        (
            "GET",
            "/v1/leases?limit=5".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/leases"),
            200,
        ),
        (
            "GET",
            "/v1/leases?limit=0".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/leases"),
            400,
        ),
        (
            "GET",
            "/v1/leases".into(),
            None,
            String::new(),
            Some("/v1/leases"),
            401,
        ),
        (
            "GET",
            "/v1/leases".into(),
            Some("forbidden-token"),
            String::new(),
            Some("/v1/leases"),
            403,
        ),
        (
            "GET",
            "/v1/leases".into(),
            Some("down-token"),
            String::new(),
            Some("/v1/leases"),
            503,
        ),
        (
            "POST",
            "/v1/leases".into(),
            Some(TOKEN),
            r#"{"holder":"c","colour":"red"}"#.into(),
            Some("/v1/leases"),
            400,
        ),
        (
            "POST",
            "/v1/leases".into(),
            Some("nobody"),
            acquire.into(),
            Some("/v1/leases"),
            401,
        ),
        (
            "POST",
            "/v1/leases".into(),
            Some("forbidden-token"),
            acquire.into(),
            Some("/v1/leases"),
            403,
        ),
        (
            "POST",
            "/v1/leases".into(),
            Some(TOKEN),
            big.clone(),
            Some("/v1/leases"),
            413,
        ),
        (
            "POST",
            "/v1/leases".into(),
            Some(TOKEN),
            r#"{"holder":"c","selector":{"region":"mars"}}"#.into(),
            Some("/v1/leases"),
            503,
        ),
        (
            "POST",
            renew_path.clone(),
            Some(TOKEN),
            "[]".into(),
            Some(renew),
            400,
        ),
        ("POST", renew_path.clone(), None, "{}".into(), Some(renew), 401),
        (
            "POST",
            renew_path.clone(),
            Some("forbidden-token"),
            "{}".into(),
            Some(renew),
            403,
        ),
        (
            "POST",
            "/v1/leases/not-a-lease/renew".into(),
            Some(TOKEN),
            r#"{"fencingToken":1}"#.into(),
            Some(renew),
            404,
        ),
        (
            "POST",
            renew_path.clone(),
            Some(TOKEN),
            format!(r#"{{"fencingToken":{first}}}"#),
            Some(renew),
            409,
        ),
        (
            "POST",
            renew_path.clone(),
            Some(TOKEN),
            big.clone(),
            Some(renew),
            413,
        ),
        (
            "POST",
            renew_path.clone(),
            Some("down-token"),
            "{}".into(),
            Some(renew),
            503,
        ),
        (
            "POST",
            release_path.clone(),
            Some(TOKEN),
            r#"{"outcome":"ok"}"#.into(),
            Some(release),
            400,
        ),
        (
            "POST",
            release_path.clone(),
            None,
            "{}".into(),
            Some(release),
            401,
        ),
        (
            "POST",
            release_path.clone(),
            Some("forbidden-token"),
            "{}".into(),
            Some(release),
            403,
        ),
        (
            "POST",
            "/v1/leases/not-a-lease/release".into(),
            Some(TOKEN),
            stale_release.clone(),
            Some(release),
            404,
        ),
        (
            "POST",
            release_path.clone(),
            Some(TOKEN),
            stale_release.clone(),
            Some(release),
            409,
        ),
        (
            "POST",
            release_path.clone(),
            Some(TOKEN),
            big.clone(),
            Some(release),
            413,
        ),
        (
            "POST",
            release_path.clone(),
            Some("down-token"),
            "{}".into(),
            Some(release),
            503,
        ),
        (
            "POST",
            outcomes_path.clone(),
            Some(TOKEN),
            format!(
                r#"{{"fencingToken":{current},"targetDomain":"shop.example","status":200,"latencyMs":40,"bytesReceived":512}}"#
            ),
            Some(outcomes),
            200,
        ),
        (
            "POST",
            outcomes_path.clone(),
            Some(TOKEN),
            format!(r#"{{"fencingToken":{current}}}"#),
            Some(outcomes),
            400,
        ),
        (
            "POST",
            outcomes_path.clone(),
            None,
            "{}".into(),
            Some(outcomes),
            401,
        ),
        (
            "POST",
            outcomes_path.clone(),
            Some("forbidden-token"),
            "{}".into(),
            Some(outcomes),
            403,
        ),
        (
            "POST",
            "/v1/leases/not-a-lease/outcomes".into(),
            Some(TOKEN),
            r#"{"fencingToken":1,"targetDomain":"x"}"#.into(),
            Some(outcomes),
            404,
        ),
        (
            "POST",
            outcomes_path.clone(),
            Some(TOKEN),
            format!(r#"{{"fencingToken":{first},"targetDomain":"x"}}"#),
            Some(outcomes),
            409,
        ),
        (
            "POST",
            outcomes_path.clone(),
            Some(TOKEN),
            big.clone(),
            Some(outcomes),
            413,
        ),
        (
            "POST",
            outcomes_path.clone(),
            Some("down-token"),
            "{}".into(),
            Some(outcomes),
            503,
        ),
        // The listing with the outcome just reported.
        (
            "GET",
            "/v1/proxies".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/proxies"),
            200,
        ),
        (
            "POST",
            "/v1/leases".into(),
            Some("quota-token"),
            acquire.into(),
            Some("/v1/leases"),
            429,
        ),
        (
            "GET",
            "/v1/usage?limit=3".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/usage"),
            200,
        ),
        (
            "GET",
            "/v1/usage?limit=0".into(),
            Some(TOKEN),
            String::new(),
            Some("/v1/usage"),
            400,
        ),
        (
            "GET",
            "/v1/usage".into(),
            None,
            String::new(),
            Some("/v1/usage"),
            401,
        ),
        (
            "GET",
            "/v1/usage".into(),
            Some("forbidden-token"),
            String::new(),
            Some("/v1/usage"),
            403,
        ),
        (
            "GET",
            "/v1/usage".into(),
            Some("down-token"),
            String::new(),
            Some("/v1/usage"),
            503,
        ),
        ("GET", "/nowhere".into(), Some(TOKEN), String::new(), None, 404),
        (
            "DELETE",
            "/v1/proxies".into(),
            Some(TOKEN),
            String::new(),
            None,
            405,
        ),
    ];
    for (method, path, token, body, template, want) in &cases {
        let (status, head, answer) = call(&url, method, path, *token, body).await;
        assert_eq!(status, *want, "{method} {path}: {answer}");
        contract.check(method, *template, status, &head, &answer);
        if *template == Some("/v1/proxies") && answer.contains("shop.example") {
            listed_outcomes = true;
        }
    }
    assert!(
        listed_outcomes,
        "the reported outcome is listed (and so checked against the contract)"
    );
    // A ban without a domain anywhere: a lease without targetDomain, released as banned.
    let (_, _, body) = call(
        &url,
        "POST",
        "/v1/leases",
        Some(TOKEN),
        r#"{"holder":"c","selector":{"region":"eu"}}"#,
    )
    .await;
    let plain: Value = serde_json::from_str(&body).unwrap();
    let (status, head, body) = call(
        &url,
        "POST",
        &format!("/v1/leases/{}/release", plain["leaseId"].as_str().unwrap()),
        Some(TOKEN),
        &format!(
            r#"{{"fencingToken":{},"outcome":"banned"}}"#,
            plain["fencingToken"]
        ),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    contract.check("POST", Some(release), status, &head, &body);
    // Draining: renewals refused, release still fine.
    store.drain(&ProxyKey::new("crawl", "us-1"));
    let (status, head, body) = call(
        &url,
        "POST",
        &renew_path,
        Some(TOKEN),
        &format!(r#"{{"fencingToken":{current}}}"#),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    contract.check("POST", Some(renew), status, &head, &body);
    let (status, head, body) = call(
        &url,
        "POST",
        &release_path,
        Some(TOKEN),
        &format!(r#"{{"fencingToken":{current},"outcome":"banned"}}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    contract.check("POST", Some(release), status, &head, &body);
    // Not ready, then not the leader: every lease operation and /readyz say so.
    for readiness in [
        Readiness {
            caches_synced: false,
            leader: true,
            ..Readiness::default()
        },
        Readiness {
            caches_synced: true,
            leader: false,
            ..Readiness::default()
        },
    ] {
        server.ready.send(readiness).unwrap();
        for (method, path, template) in [
            ("GET", "/readyz", "/readyz"),
            ("GET", "/v1/proxies", "/v1/proxies"),
            ("POST", "/v1/leases", "/v1/leases"),
            ("POST", renew_path.as_str(), renew),
            ("POST", release_path.as_str(), release),
            ("POST", outcomes_path.as_str(), outcomes),
        ] {
            let (status, head, body) = call(&url, method, path, Some(TOKEN), "{}").await;
            assert_eq!(status, 503, "{method} {path}: {body}");
            contract.check(method, Some(template), status, &head, &body);
        }
    }
    server
        .ready
        .send(Readiness {
            caches_synced: true,
            leader: true,
            ..Readiness::default()
        })
        .unwrap();
    // An acquire repeating a request ID whose first grant is not durable yet (granted here
    // straight from the store and never confirmed): ask again in a moment.
    let pending = AcquireRequest {
        selector: &store.compile(&Selector::default()),
        holder: "c",
        ttl: Duration::from_secs(60),
        target_domain: None,
        session_key: None,
        request_id: Some("pending-1"),
    };
    store
        .acquire_granted_at(&pending, store.now_ms())
        .expect("a proxy takes the pending lease");
    let (status, head, body) = call(
        &url,
        "POST",
        "/v1/leases",
        Some(TOKEN),
        r#"{"holder":"c","requestId":"pending-1"}"#,
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("request_in_progress"), "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1\r\n"), "{head}");
    contract.check("POST", Some("/v1/leases"), status, &head, &body);
    // A lease journal whose disk is full: the acquire is not durable, so not answered 201, and
    // /readyz says why.
    let journal_dir = tempfile::tempdir().unwrap();
    let journal = Journal::start(
        JournalConfig::new(journal_dir.path()),
        1,
        JournalMetrics::default(),
    )
    .unwrap();
    std::os::unix::fs::symlink(
        "/dev/full",
        journal_dir.path().join(format!("{SEGMENT_PREFIX}{:020}", 1)),
    )
    .unwrap();
    server.state.set_journal(journal.clone());
    for (method, path) in [("POST", "/v1/leases"), ("GET", "/readyz")] {
        let (status, head, body) = call(&url, method, path, Some(TOKEN), r#"{"holder":"c"}"#).await;
        assert_eq!(status, 503, "{method} {path}: {body}");
        assert!(body.contains("journal_unavailable"), "{body}");
        contract.check(method, Some(path), status, &head, &body);
    }
    journal.close();
    // What the HTTP layer answers by itself.
    for (request, want) in [
        (b"HELLO THERE\r\n\r\n".to_vec(), 400),
        (
            format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(70 * 1024)).into_bytes(),
            414,
        ),
        (
            format!("GET /healthz HTTP/1.1\r\n{}\r\n", "x-h: v\r\n".repeat(150)).into_bytes(),
            431,
        ),
    ] {
        let (status, head, body) = raw_exchange(&url, &request, false).await;
        assert_eq!(status, want, "{body}");
        contract.check("GET", None, status, &head, &body);
    }

    // Every documented (operation, status) was met, except the 500 a bug would cause.
    let mut documented = std::collections::BTreeSet::new();
    for (path, item) in contract.doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for status in op["responses"].as_object().unwrap().keys() {
                documented.insert((path.clone(), method.clone(), status.parse::<u16>().unwrap()));
            }
        }
    }
    documented.remove(&("/metrics".to_owned(), "get".to_owned(), 500));
    let missing: Vec<_> = documented.difference(&contract.seen).collect();
    assert!(missing.is_empty(), "documented but never checked: {missing:?}");
    // And every documented error code, except `internal`.
    let codes: std::collections::BTreeSet<String> = discovery::ERROR_CODES
        .iter()
        .filter(|c| **c != "internal")
        .map(|c| c.to_string())
        .collect();
    assert_eq!(contract.codes, codes, "error codes met vs documented");
    server.shutdown().await;
}
