//! The router as a function: every status code the API documents, and a fuzz test of malformed
//! requests (never a 5xx, never a panic). Real-socket tests are in tests/discovery.rs.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::*;
use crate::{
    api::LeasePolicy,
    api::ProxyKey,
    lease::{Admission, LeaseError, LeaseStoreConfig, LeaseTarget},
    provider::{Credentials, Endpoint},
};

mod anonymous;
mod authorization;
mod outcomes;

const TOKEN: &str = "s3cret-crawler-token";

struct Harness {
    state: DiscoveryState,
    ready: watch::Sender<Readiness>,
    /// Every request goes through one keep-alive connection's memory, as a crawler's would.
    connection: Arc<Remembered>,
}

/// Adds an open proxy `crawl/{name}` with `region` and tier `dc` to `store`.
fn add_proxy(store: &LeaseStore, name: &str, port: u16, region: &str, max_concurrent: i32) {
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
            max_concurrent,
            cooldown_seconds: 0,
            max_ttl_seconds: 3600,
        },
        credentials: Some(Credentials {
            username: "crawler".into(),
            password: "pw".into(),
        }),
    });
    store.set_admission(&key, Admission::Open).unwrap();
}

fn harness(proxies: usize, max_concurrent: i32) -> Harness {
    harness_with(proxies, max_concurrent, Default::default())
}

/// `harness` with politeness entries shared as the gateway would share them.
fn harness_with(proxies: usize, max_concurrent: i32, politeness: crate::politeness::Politeness) -> Harness {
    let tokens = StaticTokens::parse(&format!("# crawlers\n{TOKEN}\n"));
    harness_authenticated_by(proxies, max_concurrent, politeness, Arc::new(tokens))
}

/// `harness_with`, whose callers `auth` authenticates.
fn harness_authenticated_by(
    proxies: usize,
    max_concurrent: i32,
    politeness: crate::politeness::Politeness,
    auth: Arc<dyn Authenticator>,
) -> Harness {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    for i in 0..proxies {
        let region = if i % 2 == 0 { "eu" } else { "us" };
        add_proxy(&store, &format!("p{i}"), 3128 + i as u16, region, max_concurrent);
    }
    let mut registry = Registry::default();
    let metrics = DiscoveryMetrics::register(&mut registry);
    let (ready, readiness) = watch::channel(Readiness {
        caches_synced: true,
        leader: true,
        ..Readiness::default()
    });
    let state = DiscoveryState::new(DiscoveryDeps {
        store,
        signer: LeaseSigner::new(&[42u8; 32]).unwrap(),
        auth,
        readiness,
        registry: Arc::new(registry),
        metrics,
        outcomes: Default::default(),
        usage: Default::default(),
        politeness,
        config: DiscoveryConfig::default(),
    });
    Harness {
        state,
        ready,
        connection: Arc::default(),
    }
}

struct Answer {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Value,
    text: String,
}

impl Harness {
    /// `POST /v1/leases` with `body`.
    async fn acquire(&self, body: Value) -> Answer {
        self.call("POST", "/v1/leases", Some(body)).await
    }

    /// `POST /v1/leases` with `body`, which must grant a lease.
    async fn granted(&self, body: Value) -> Answer {
        let answer = self.acquire(body).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.text);
        answer
    }

    /// A lease for `holder` to crawl `domain`, which must be granted.
    async fn granted_for(&self, holder: &str, domain: &str) -> Answer {
        self.granted(json!({"holder": holder, "targetDomain": domain}))
            .await
    }

    /// `POST /v1/leases/{id}/renew` with `body`.
    async fn renew(&self, id: &str, body: Value) -> Answer {
        self.call("POST", &format!("/v1/leases/{id}/renew"), Some(body))
            .await
    }

    /// `POST /v1/leases/{id}/release` with `body`.
    async fn release(&self, id: &str, body: Value) -> Answer {
        self.call("POST", &format!("/v1/leases/{id}/release"), Some(body))
            .await
    }

    /// Releases the lease an acquire `granted` with its fencing token and `outcome`, which must
    /// succeed.
    async fn released(&self, granted: &Answer, outcome: &str) {
        let id = granted.body["leaseId"].as_str().unwrap();
        let token = &granted.body["fencingToken"];
        let answer = self
            .release(id, json!({"fencingToken": token, "outcome": outcome}))
            .await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Answer {
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        self.raw(method, path, Some(TOKEN), Bytes::from(bytes)).await
    }

    /// GET without a token, as probes and scrapers ask.
    async fn get_unauthenticated(&self, path: &str) -> Answer {
        self.raw("GET", path, None, Bytes::new()).await
    }

    async fn raw(&self, method: &str, path: &str, token: Option<&str>, body: Bytes) -> Answer {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let Ok(response) = answer(
            self.state.clone(),
            self.connection.clone(),
            req.body(Full::new(body)).unwrap(),
        )
        .await;
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            body,
            text,
        }
    }
}

fn code(a: &Answer) -> &str {
    a.body["error"]["code"].as_str().unwrap_or("<none>")
}

/// `a` is a refusal with `status` and the error code `expected`.
#[track_caller]
fn assert_refused(a: &Answer, status: StatusCode, expected: &str) {
    assert_eq!((a.status, code(a)), (status, expected), "{}", a.text);
}

#[tokio::test]
async fn a_connection_remembers_its_selector_only_while_that_stays_right() {
    let h = harness(2, 1);
    let region = |a: &Answer| {
        a.body["proxy"]["attributes"]["region"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let eu = h
        .granted(json!({"holder": "c", "selector": {"region": "eu"}}))
        .await;
    assert_eq!(region(&eu), "eu");
    h.released(&eu, "ok").await;
    // Another selector on the same connection is not answered from memory.
    let us = h
        .granted(json!({"holder": "c", "selector": {"region": "us"}}))
        .await;
    assert_eq!(region(&us), "us");
    h.released(&us, "ok").await;
    // A pair no proxy carries matches nothing, until a proxy brings it.
    let ap = json!({"holder": "c", "selector": {"region": "ap", "tier": "dc"}});
    assert_refused(
        &h.acquire(ap.clone()).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "no_proxy_available",
    );
    add_proxy(h.state.store(), "p-ap", 3200, "ap", 1);
    assert_eq!(region(&h.granted(ap).await), "ap");
}

/// The refusal says which reasons may hold, without claiming a selector the caller did not send
/// (it said "no proxy matching the selector" to every acquire), and where each proxy's shows.
#[tokio::test]
async fn a_refused_acquire_says_what_may_hold_and_where_to_look_without_naming_a_selector() {
    let h = harness(1, 1);
    let first = h.granted(json!({"holder": "c"})).await;
    let refused = h.acquire(json!({"holder": "c"})).await;
    assert_refused(&refused, StatusCode::SERVICE_UNAVAILABLE, "no_proxy_available");
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(!message.contains("matching the selector"), "{message}");
    assert!(
        message.contains("none matches, or each that does is full"),
        "{message}"
    );
    assert!(message.contains("GET /v1/proxies"), "{message}");
    h.released(&first, "ok").await;
}

#[tokio::test]
async fn lease_lifecycle_over_the_router() {
    let h = harness(2, 1);
    let a = h
        .granted(json!({"selector": {"region": "eu"}, "holder": "crawler-7", "ttlSeconds": 30}))
        .await;
    assert_eq!(a.body["proxy"]["key"], "crawl/p0");
    assert_eq!(a.body["proxyUrl"], "http://crawler:pw@127.0.0.1:3128");
    assert_eq!(a.body["ttlSeconds"], 30);
    let id = a.body["leaseId"].as_str().unwrap().to_owned();
    let token = a.body["fencingToken"].as_u64().unwrap();

    // The same renewal twice: the first moves the token on, so the second is stale.
    let renew_with_first_token = async || {
        let path = format!("/v1/leases/{id}/renew");
        h.call("POST", &path, Some(json!({"fencingToken": token}))).await
    };
    let r = renew_with_first_token().await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let new_token = r.body["fencingToken"].as_u64().unwrap();
    assert!(new_token > token);

    let stale = renew_with_first_token().await;
    assert_eq!(
        (stale.status, code(&stale)),
        (StatusCode::CONFLICT, "stale_token")
    );

    let busy = h
        .acquire(json!({"selector": {"region": "eu"}, "holder": "c"}))
        .await;
    assert_eq!(
        (busy.status, code(&busy)),
        (StatusCode::SERVICE_UNAVAILABLE, "no_proxy_available")
    );
    assert!(busy.headers.contains_key("retry-after"));

    let rel = h
        .release(
            &id,
            json!({"fencingToken": new_token, "outcome": "banned", "targetDomain": "shop.example"}),
        )
        .await;
    assert_eq!(rel.status, StatusCode::OK, "{}", rel.text);
    let again = h
        .release(&id, json!({"fencingToken": new_token, "outcome": "ok"}))
        .await;
    assert_eq!(
        (again.status, code(&again)),
        (StatusCode::NOT_FOUND, "lease_not_found")
    );

    let list = h.call("GET", "/v1/proxies?selector=region%3Deu", None).await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(list.body["proxies"].as_array().unwrap().len(), 1);
    assert_eq!(list.body["proxies"][0]["availability"], "available");
    assert!(!list.text.contains("pw"), "listings carry no credentials");

    let metrics = h.get_unauthenticated("/metrics").await;
    assert_eq!(metrics.status, StatusCode::OK);
    assert!(
        metrics.text.contains("epo_discovery_leases_acquired_total 1"),
        "{}",
        metrics.text
    );
    assert!(metrics.text.contains(r#"code="stale_token""#));
    assert!(metrics.text.contains("epo_discovery_leases_active 0"));
}

#[tokio::test]
async fn documented_error_statuses() {
    let h = harness(1, 1);
    type Case<'a> = (&'a str, &'a str, Option<&'a str>, String, StatusCode, &'a str);
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/v1/leases",
            Some(TOKEN),
            "{".into(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "POST",
            "/v1/leases",
            Some(TOKEN),
            r#"{"holder":"a","colour":"red"}"#.into(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "POST",
            "/v1/leases",
            Some(TOKEN),
            r#"{"holder":"a"} x"#.into(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "POST",
            "/v1/leases",
            Some(TOKEN),
            format!(r#"{{"holder":"{}"}}"#, "a".repeat(20_000)),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            "POST",
            "/v1/leases",
            Some(TOKEN),
            r#"{"holder":""}"#.into(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "POST",
            "/v1/leases",
            None,
            r#"{"holder":"a"}"#.into(),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "POST",
            "/v1/leases",
            Some("wrong"),
            r#"{"holder":"a"}"#.into(),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "DELETE",
            "/v1/leases",
            Some(TOKEN),
            String::new(),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
        (
            "GET",
            "/nope",
            Some(TOKEN),
            String::new(),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/v1/leases/AAAA/renew",
            Some(TOKEN),
            r#"{"fencingToken":1}"#.into(),
            StatusCode::NOT_FOUND,
            "lease_not_found",
        ),
        (
            "POST",
            "/v1/leases/AAAA/x/release",
            Some(TOKEN),
            r#"{"fencingToken":1}"#.into(),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/v1/leases/AAAA/release/",
            Some(TOKEN),
            r#"{"fencingToken":1}"#.into(),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/v1/leases/%2e%2e/renew",
            Some(TOKEN),
            r#"{"fencingToken":1}"#.into(),
            StatusCode::NOT_FOUND,
            "lease_not_found",
        ),
        (
            "POST",
            "/v1/leases/AAAA/release",
            Some(TOKEN),
            r#"{"fencingToken":1,"outcome":"meh"}"#.into(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "GET",
            "/v1/proxies?selector=region",
            Some(TOKEN),
            String::new(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "GET",
            "/v1/proxies?targetDomain=not%20a%20host",
            Some(TOKEN),
            String::new(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "GET",
            "/v1/proxies?colour=red",
            Some(TOKEN),
            String::new(),
            StatusCode::BAD_REQUEST,
            "malformed_request",
        ),
        (
            "POST",
            "/v1/leases",
            Some(TOKEN),
            r#"{"holder":"a","selector":{"region":"mars"}}"#.into(),
            StatusCode::SERVICE_UNAVAILABLE,
            "no_proxy_available",
        ),
    ];
    for (method, path, token, body, status, want) in cases {
        let a = h.raw(method, path, token, Bytes::from(body.clone())).await;
        assert_eq!(
            (a.status, code(&a)),
            (status, want),
            "{method} {path} {}: {}",
            &body[..body.len().min(60)],
            a.text
        );
        assert_eq!(a.headers["content-type"], "application/json");
    }
}

#[tokio::test]
async fn readiness_gates_leases_but_not_liveness() {
    let h = harness(1, 1);
    assert_eq!(h.get_unauthenticated("/readyz").await.status, StatusCode::OK);
    let set_readiness = |caches_synced, leader| {
        h.ready.send_replace(Readiness {
            caches_synced,
            leader,
            ..Readiness::default()
        })
    };
    set_readiness(true, false);
    let r = h.get_unauthenticated("/readyz").await;
    assert_eq!(
        (r.status, code(&r)),
        (StatusCode::SERVICE_UNAVAILABLE, "not_leader")
    );
    let a = h.acquire(json!({"holder": "a"})).await;
    assert_eq!(
        (a.status, code(&a)),
        (StatusCode::SERVICE_UNAVAILABLE, "not_leader")
    );
    assert_eq!(a.headers["retry-after"], "1");
    set_readiness(false, true);
    let r = h.get_unauthenticated("/readyz").await;
    assert_eq!(
        (r.status, code(&r)),
        (StatusCode::SERVICE_UNAVAILABLE, "not_ready")
    );
    assert_eq!(h.get_unauthenticated("/healthz").await.status, StatusCode::OK);
}

struct Forbidding;

#[async_trait::async_trait]
impl Authenticator for Forbidding {
    async fn authenticate(&self, token: &str) -> Result<Identity, AuthError> {
        match token {
            "outsider" => Err(AuthError::Forbidden("system:serviceaccount:other:default".into())),
            "down" => Err(AuthError::Unavailable("api server unreachable".into())),
            _ => Err(AuthError::Unauthenticated),
        }
    }
}

#[tokio::test]
async fn authenticator_verdicts_map_to_401_403_503() {
    let h = harness(1, 1);
    let state = DiscoveryState::new(DiscoveryDeps {
        store: h.state.store().clone(),
        signer: LeaseSigner::new(&[1u8; 32]).unwrap(),
        auth: Arc::new(Forbidding),
        readiness: h.ready.subscribe(),
        registry: Arc::new(Registry::default()),
        metrics: DiscoveryMetrics::register(&mut Registry::default()),
        outcomes: Default::default(),
        usage: Default::default(),
        politeness: Default::default(),
        config: DiscoveryConfig::default(),
    });
    let h2 = Harness {
        state,
        ready: h.ready,
        connection: Arc::default(),
    };
    for (token, status, want) in [
        ("outsider", StatusCode::FORBIDDEN, "forbidden"),
        ("down", StatusCode::SERVICE_UNAVAILABLE, "auth_unavailable"),
        ("nobody", StatusCode::UNAUTHORIZED, "unauthorized"),
    ] {
        let a = h2.raw("GET", "/v1/proxies", Some(token), Bytes::new()).await;
        assert_eq!((a.status, code(&a)), (status, want));
    }
}

/// Mutates valid requests at random (seeded, so failures reproduce) and checks that nothing
/// malformed gets a 5xx or panics; 503 is allowed only as the documented no_proxy_available.
#[tokio::test]
async fn malformed_requests_never_get_a_5xx() {
    let h = harness(8, 1000);
    let seed = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_u64);
    let mut rng = fastrand::Rng::with_seed(seed);
    let acquired = h
        .acquire(json!({"holder": "fuzz", "targetDomain": "a.example"}))
        .await;
    let id = acquired.body["leaseId"].as_str().unwrap().to_owned();
    let token = acquired.body["fencingToken"].as_u64().unwrap();
    let valid_bodies = [
        json!({"selector": {"region": "eu"}, "holder": "fuzz", "ttlSeconds": 30, "targetDomain": "a.example", "sessionKey": "s"}).to_string(),
        json!({"fencingToken": token, "ttlSeconds": 10}).to_string(),
        json!({"fencingToken": token, "outcome": "banned", "targetDomain": "a.example"}).to_string(),
    ];
    let paths = [
        "/v1/leases".to_owned(),
        format!("/v1/leases/{id}/renew"),
        format!("/v1/leases/{id}/release"),
        "/v1/proxies?selector=region=eu".to_owned(),
        "/readyz".to_owned(),
    ];
    let tokens: [&[u8]; 14] = [
        b"{",
        b"}",
        b"[",
        b"]",
        b"\"",
        b":",
        b",",
        b"null",
        b"-1",
        b"1e999",
        b"18446744073709551616",
        b"\"\\u0000\"",
        b"\xff\xfe",
        b"{\"a\":",
    ];
    for round in 0..20_000 {
        let which = rng.usize(..paths.len());
        let mut path = paths[which].clone();
        let mut body = valid_bodies[which.min(2)].clone().into_bytes();
        for _ in 0..rng.usize(1..4) {
            match rng.u8(..8) {
                0 if !body.is_empty() => {
                    let i = rng.usize(..body.len());
                    body[i] = rng.u8(..);
                }
                1 => body.truncate(rng.usize(..=body.len())),
                2 => {
                    let i = rng.usize(..=body.len());
                    let t = tokens[rng.usize(..tokens.len())];
                    body.splice(i..i, t.iter().copied());
                }
                3 => body = b"[".repeat(rng.usize(1..5000)),
                4 => body.extend(std::iter::repeat_n(b' ', rng.usize(..20_000))),
                5 => {
                    // Deep but small: every level is one byte.
                    body = format!("{}1{}", "{\"a\":".repeat(200), "}".repeat(200)).into_bytes()
                }
                6 if !path.is_empty() => {
                    let boundaries: Vec<usize> = path.char_indices().map(|(i, _)| i).collect();
                    let i = boundaries[rng.usize(..boundaries.len())];
                    let end = i + path[i..].chars().next().map_or(0, char::len_utf8);
                    path.replace_range(i..end, ["%", "/", "?", "..", "%00", "é", "x"][rng.usize(..7)]);
                }
                _ => body = serde_json::to_vec(&json!({"holder": rng.u64(..), "extra": [1, 2, 3]})).unwrap(),
            }
        }
        let method = ["GET", "POST", "PUT", "DELETE"][rng.usize(..4)];
        if !path.starts_with('/') || path.parse::<hyper::Uri>().is_err() {
            continue;
        }
        let a = h.raw(method, &path, Some(TOKEN), Bytes::from(body)).await;
        let ok_5xx = a.status == StatusCode::SERVICE_UNAVAILABLE && code(&a) == "no_proxy_available";
        assert!(
            !a.status.is_server_error() || ok_5xx,
            "round {round} (seed {seed}): {method} {path} -> {} {}",
            a.status,
            a.text
        );
        if a.status.is_client_error() {
            assert_ne!(code(&a), "<none>", "every error has a JSON code: {}", a.text);
        }
    }
}

/// A body is a JSON object: anything else is refused with a message that says so; an array is
/// never read as the fields in declaration order (serde's derive would take it).
#[tokio::test]
async fn a_body_that_is_not_a_json_object_is_refused_as_such() {
    let h = harness(1, 10);
    let not_an_object = "the body must be a JSON object";
    for (body, says) in [
        (
            json!([{}, "crawler-1", 30, null, null, null]).to_string(),
            not_an_object,
        ),
        (json!([]).to_string(), not_an_object),
        ("\"crawler-1\"".to_owned(), not_an_object),
        (" 7".to_owned(), not_an_object),
        // A broken object says where it broke, with no placeholder for a path never reached.
        ("{".to_owned(), "invalid JSON body: EOF while parsing"),
    ] {
        let a = h
            .raw("POST", "/v1/leases", Some(TOKEN), Bytes::from(body.clone()))
            .await;
        assert_refused(&a, StatusCode::BAD_REQUEST, "malformed_request");
        assert!(a.text.contains(says), "{body}: {}", a.text);
    }
}

#[test]
fn error_codes_are_stable() {
    let codes: Vec<_> = [
        LeaseError::NotFound,
        LeaseError::StaleToken {
            presented: 1,
            current: 2,
        },
        LeaseError::Draining,
        LeaseError::NoProxyAvailable {
            retry_after: Duration::from_secs(1),
        },
        LeaseError::BanNeedsDomain,
    ]
    .into_iter()
    .map(|e| {
        let api: ApiError = e.into();
        (api.status.as_u16(), api.code)
    })
    .collect();
    assert_eq!(
        codes,
        vec![
            (404, "lease_not_found"),
            (409, "stale_token"),
            (409, "proxy_draining"),
            (503, "no_proxy_available"),
            (400, "target_domain_required")
        ]
    );
}

#[tokio::test]
async fn length_limits_count_characters_where_the_docs_say_characters() {
    let h = harness(4, 4);
    // docs/api.md: holder 1-128 characters, sessionKey 1-256, selector values up to 256.
    for (body, want) in [
        (json!({"holder": "é".repeat(128)}), StatusCode::CREATED),
        (json!({"holder": "💡".repeat(128)}), StatusCode::CREATED),
        (json!({"holder": "é".repeat(129)}), StatusCode::BAD_REQUEST),
        (json!({"holder": ""}), StatusCode::BAD_REQUEST),
        (
            json!({"holder": "h", "sessionKey": "ü".repeat(256)}),
            StatusCode::CREATED,
        ),
        (
            json!({"holder": "h", "sessionKey": "ü".repeat(257)}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"holder": "h", "selector": {"tier": "ß".repeat(256)}}),
            StatusCode::SERVICE_UNAVAILABLE,
        ),
        (
            json!({"holder": "h", "selector": {"tier": "ß".repeat(257)}}),
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let a = h.acquire(body.clone()).await;
        assert_eq!(a.status, want, "{body}: {}", a.text);
    }
}

/// A harness over `proxies` proxies whose operations are journaled in a fresh folder.
fn journaled_harness(proxies: usize) -> (Harness, Journal, tempfile::TempDir) {
    use crate::lease::journal::{JournalConfig, JournalMetrics};
    let dir = tempfile::tempdir().unwrap();
    let h = harness(proxies, 1);
    let journal = Journal::start(JournalConfig::new(dir.path()), 1, JournalMetrics::default()).unwrap();
    h.state.set_journal(journal.clone());
    (h, journal, dir)
}

/// An acquire sent again with its `requestId` is answered the lease the first one got (same
/// ID, current token), takes no second slot, and still is after a restart (journal replayed
/// into a new store); bad request IDs are 400s.
#[tokio::test]
async fn an_acquire_repeated_with_its_request_id_gets_the_same_lease_across_a_restart() {
    let (h, journal, dir) = journaled_harness(2);
    let body = json!({"holder": "c1", "requestId": "0b7f6e3c-req", "targetDomain": "Shop.Example"});
    let first = h.granted(body.clone()).await;
    let again = h.granted(body.clone()).await;
    for field in [
        "leaseId",
        "fencingToken",
        "proxy",
        "acquiredAt",
        "expiresAt",
        "ttlSeconds",
    ] {
        assert_eq!(again.body[field], first.body[field], "{field}");
    }
    let listing = h.call("GET", "/v1/proxies", None).await;
    let active: u64 = listing.body["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["activeLeases"].as_u64().unwrap())
        .sum();
    assert_eq!(active, 1, "one slot: {}", listing.text);
    // Another request ID is another lease.
    let other = h.acquire(json!({"holder": "c1", "requestId": "another"})).await;
    assert_ne!(other.body["leaseId"], first.body["leaseId"]);

    // A restart: the journal replayed into a new store knows the request.
    journal.close();
    let recovered = crate::lease::journal::recover(dir.path(), None).unwrap();
    let restarted = harness(2, 1);
    restarted.state.store().restore(&recovered.checkpoint);
    let after = restarted.acquire(body).await;
    assert_eq!(after.status, StatusCode::CREATED, "{}", after.text);
    // The same lease (its ID may encode where the new process keeps it: both IDs work).
    for field in ["fencingToken", "proxy", "acquiredAt", "expiresAt"] {
        assert_eq!(after.body[field], first.body[field], "{field}: {}", after.text);
    }
    // Renewing through one ID makes the token the other presents stale: one lease.
    for (id, want) in [
        (&after.body["leaseId"], StatusCode::OK),
        (&first.body["leaseId"], StatusCode::CONFLICT),
    ] {
        let renewed = restarted
            .call(
                "POST",
                &format!("/v1/leases/{}/renew", id.as_str().unwrap()),
                Some(json!({"fencingToken": first.body["fencingToken"]})),
            )
            .await;
        assert_eq!(renewed.status, want, "{}", renewed.text);
    }

    for bad in [json!(""), json!("x".repeat(129)), json!("a\u{7}b")] {
        let refused = h.acquire(json!({"holder": "c1", "requestId": bad})).await;
        assert_refused(&refused, StatusCode::BAD_REQUEST, "malformed_request");
        assert!(refused.text.contains("requestId"), "{}", refused.text);
    }
}

/// A `banned` release that names no domain bans the lease's own target domain, and the journal
/// keeps that ban: what a restart replays is what the store did.
#[tokio::test]
async fn a_ban_without_a_domain_is_journaled_with_the_leases_domain() {
    let (h, journal, dir) = journaled_harness(1);
    let acquired = h.granted_for("c1", "Shop.Example").await;
    let released = h
        .call(
            "POST",
            &format!(
                "/v1/leases/{}/release",
                acquired.body["leaseId"].as_str().unwrap()
            ),
            Some(json!({"fencingToken": acquired.body["fencingToken"], "outcome": "banned"})),
        )
        .await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.text);
    let recovered = crate::lease::journal::recover(dir.path(), None).unwrap();
    let bans: Vec<&str> = recovered.checkpoint.proxies[0]
        .bans
        .iter()
        .map(|b| b.domain.as_str())
        .collect();
    assert_eq!(bans, ["shop.example"]);
    journal.close();
}

#[tokio::test]
async fn with_a_journal_operations_are_durable_before_they_are_answered_and_a_failed_sync_is_a_503() {
    use crate::lease::journal::SEGMENT_PREFIX;
    let (h, journal, dir) = journaled_harness(2);
    let acquired = h.granted(json!({"holder": "c1"})).await;
    let renewed = h
        .call(
            "POST",
            &format!("/v1/leases/{}/renew", acquired.body["leaseId"].as_str().unwrap()),
            Some(json!({"fencingToken": acquired.body["fencingToken"]})),
        )
        .await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.text);
    // Answered, so already in the log (no close, no flush).
    let r = crate::lease::journal::recover(dir.path(), None).unwrap();
    let lease = &r.checkpoint.proxies[0].leases[0];
    assert_eq!(Some(lease.token), renewed.body["fencingToken"].as_u64());

    // The next segment is a full disk.
    let through = journal.rotate().await.unwrap();
    std::os::unix::fs::symlink(
        "/dev/full",
        dir.path().join(format!("{SEGMENT_PREFIX}{:020}", through + 1)),
    )
    .unwrap();
    let refused = h.acquire(json!({"holder": "c2"})).await;
    assert_refused(&refused, StatusCode::SERVICE_UNAVAILABLE, "journal_unavailable");
    assert!(refused.headers.contains_key("retry-after"));
    // Until it recovers, /readyz says why and lease operations are refused up front.
    let ready = h.get_unauthenticated("/readyz").await;
    assert_eq!(code(&ready), "journal_unavailable", "{}", ready.text);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.get_unauthenticated("/readyz").await.status != StatusCode::OK {
        assert!(
            std::time::Instant::now() < deadline,
            "the journal never recovered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.granted(json!({"holder": "c3"})).await;
    journal.close();
}

/// Renewals and releases of a lease this process issued compare the ID with the one kept with
/// the lease instead of verifying the HMAC (`lease::token::IssuedId`); they must refuse
/// exactly what the full verification refuses: altered and forged IDs are unknown, stale tokens
/// are stale, and a lease restored from a checkpoint (which keeps no IDs) is still recognised by
/// its signed ID.
#[tokio::test]
async fn lease_ids_are_compared_with_the_issued_one_and_verified_in_full_without_it() {
    let h = harness(1, 2);
    let a = h.granted_for("c1", "shop.example").await;
    let id = a.body["leaseId"].as_str().unwrap().to_owned();
    let mut token = a.body["fencingToken"].as_u64().unwrap();
    let renew = async |id: &str, token: u64| h.renew(id, json!({"fencingToken": token})).await;

    // Every character altered (in the head that names the lease, in the claim, in the tag),
    // one dropped, one added: unknown, and the lease itself is untouched.
    let mut altered: Vec<String> = (0..id.len())
        .map(|i| {
            let mut bytes = id.clone().into_bytes();
            bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
            String::from_utf8(bytes).unwrap()
        })
        .collect();
    altered.push(id[..id.len() - 1].to_owned());
    altered.push(format!("{id}A"));
    // The same claim signed with another key: the head names the very lease, the rest differs.
    let claim = h.state.inner.deps.signer.verify(&id).unwrap();
    altered.push(LeaseSigner::new(&[7u8; 32]).unwrap().sign(&claim));
    for other in &altered {
        let r = renew(other, token).await;
        assert_eq!(
            (r.status, code(&r)),
            (StatusCode::NOT_FOUND, "lease_not_found"),
            "{other}: {}",
            r.text
        );
    }
    assert_eq!(h.state.store().active_leases(&claim.id.key), 1);

    // The issued ID is fenced like any: the current token renews, an older one is stale.
    let r = renew(&id, token).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let stale = token;
    token = r.body["fencingToken"].as_u64().unwrap();
    let r = renew(&id, stale).await;
    assert_refused(&r, StatusCode::CONFLICT, "stale_token");
    let release = async |id: &str, token: u64| {
        h.release(id, json!({"fencingToken": token, "outcome": "ok"}))
            .await
    };
    let r = release(&id, stale).await;
    assert_refused(&r, StatusCode::CONFLICT, "stale_token");

    // A restart: the lease comes back from a checkpoint, without its ID. The ID is verified in
    // full, then renewed and released; altered IDs are still unknown there.
    let restarted = harness(1, 2);
    restarted.state.store().restore(&h.state.store().checkpoint());
    let token_here = token;
    let renew_there = async |id: &str, token: u64| restarted.renew(id, json!({"fencingToken": token})).await;
    for other in altered.iter().step_by(7) {
        let r = renew_there(other, token).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{other}: {}", r.text);
    }
    let r = renew_there(&id, token).await;
    assert_eq!(r.status, StatusCode::OK, "restored lease: {}", r.text);
    let r2 = renew_there(&id, token).await;
    assert_refused(&r2, StatusCode::CONFLICT, "stale_token");
    token = r.body["fencingToken"].as_u64().unwrap();
    for other in altered.iter().step_by(5) {
        let r = renew_there(other, token).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{other}: {}", r.text);
    }
    let r = restarted
        .release(&id, json!({"fencingToken": token, "outcome": "ok"}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(restarted.state.store().active_leases(&claim.id.key), 0);

    // And in the first process the lease is released once, by its issued ID only.
    assert_eq!(
        release(&altered[3], token_here).await.status,
        StatusCode::NOT_FOUND
    );
    let r = release(&id, token_here).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(release(&id, token_here).await.status, StatusCode::NOT_FOUND);
}

/// A listing shows each proxy's active bans per domain, and one for a `targetDomain` shows a
/// proxy banned for it as `banned` (and for another domain as it stands).
#[tokio::test]
async fn listings_show_bans_and_what_a_crawler_of_a_domain_can_lease() {
    let h = harness(2, 1);
    let acquired = h.granted_for("c1", "Shop.Example.").await;
    let banned_key = acquired.body["proxy"]["key"].as_str().unwrap().to_owned();
    h.released(&acquired, "banned").await;

    let by_key = |list: &Answer| -> BTreeMap<String, Value> {
        list.body["proxies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["key"].as_str().unwrap().to_owned(), p.clone()))
            .collect()
    };
    let all = h.call("GET", "/v1/proxies", None).await;
    assert_eq!(all.status, StatusCode::OK, "{}", all.text);
    for (key, proxy) in by_key(&all) {
        assert_eq!(proxy["availability"], "available", "{key}: no domain asked");
        let bans = proxy["bans"].as_array().unwrap();
        if key == banned_key {
            assert_eq!(bans.len(), 1, "{proxy}");
            assert_eq!(bans[0]["domain"], "shop.example");
            let until = bans[0]["until"].as_str().unwrap();
            assert!(until.parse::<jiff::Timestamp>().is_ok(), "{until}");
        } else {
            assert!(bans.is_empty(), "{proxy}");
        }
    }
    let shop = h.call("GET", "/v1/proxies?targetDomain=SHOP.example", None).await;
    for (key, proxy) in by_key(&shop) {
        let want = if key == banned_key { "banned" } else { "available" };
        assert_eq!(proxy["availability"], want, "{key}");
    }
    let other = h
        .call("GET", "/v1/proxies?targetDomain=other.example", None)
        .await;
    for (key, proxy) in by_key(&other) {
        assert_eq!(proxy["availability"], "available", "{key}");
    }
}

/// `GET /v1/leases` lists active leases a page at a time (none twice, none lost to a lease that
/// ends between pages), filters by proxy and holder, and never shows an ID or a token.
#[tokio::test]
async fn leases_are_listed_a_page_at_a_time_without_ids_or_tokens() {
    let h = harness(3, 2);
    let mut granted = Vec::new();
    for holder in ["a", "b", "a", "b", "a"] {
        let acquired = h.granted(json!({"holder": holder})).await;
        granted.push(acquired);
    }
    let mut listed = Vec::new();
    let mut path = "/v1/leases?limit=2".to_owned();
    loop {
        let page = h.call("GET", &path, None).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.text);
        for secret in ["leaseId", "fencingToken", "proxyUrl"] {
            assert!(!page.text.contains(secret), "{secret} in {}", page.text);
        }
        let leases = page.body["leases"].as_array().unwrap();
        assert!(leases.len() <= 2);
        listed.extend(leases.iter().cloned());
        if listed.len() == 2 {
            // A lease listed on the first page ends: the next page goes on after it.
            h.released(&granted[0], "ok").await;
        }
        match page.body["next"].as_str() {
            Some(next) => {
                path = format!(
                    "/v1/leases?limit=2&after={}",
                    form_urlencoded::byte_serialize(next.as_bytes()).collect::<String>()
                )
            }
            None => break,
        }
    }
    let keys: Vec<(String, String)> = listed
        .iter()
        .map(|l| {
            (
                l["proxy"].as_str().unwrap().to_owned(),
                l["acquiredAt"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "by proxy key");
    let first_released = granted[0].body["proxy"]["key"].as_str().unwrap();
    // Five granted, one released after the first page: four or five listed, and no lease twice.
    assert!(listed.len() == 5 || listed.len() == 4, "{listed:?}");
    assert!(listed.iter().any(|l| l["proxy"] == first_released));

    let a = h.call("GET", "/v1/leases?holder=a", None).await;
    let a_leases = a.body["leases"].as_array().unwrap();
    assert!(a_leases.iter().all(|l| l["holder"] == "a"), "{}", a.text);
    assert_eq!(a_leases.len(), 2, "one of a's three was released: {}", a.text);
    assert!(a.body.get("next").is_none(), "{}", a.text);

    let on_p1 = h.call("GET", "/v1/leases?proxy=crawl/p1", None).await;
    let p1 = on_p1.body["leases"].as_array().unwrap();
    assert!(
        !p1.is_empty() && p1.iter().all(|l| l["proxy"] == "crawl/p1"),
        "{}",
        on_p1.text
    );

    for bad in [
        "/v1/leases?limit=0",
        "/v1/leases?limit=1001",
        "/v1/leases?proxy=nokey",
        "/v1/leases?after=garbage",
        "/v1/leases?colour=red",
    ] {
        let refused = h.call("GET", bad, None).await;
        assert_eq!(
            (refused.status, code(&refused)),
            (StatusCode::BAD_REQUEST, "malformed_request"),
            "{bad}: {}",
            refused.text
        );
    }
    let wrong = h.call("PUT", "/v1/leases", None).await;
    assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(wrong.headers["allow"], "GET, POST");
}

/// The pattern `name` in the served contract (a query parameter's, else a body property's).
fn contract_pattern(name: &str) -> regex::Regex {
    let doc: Value = serde_json::from_str(&super::openapi::json()).unwrap();
    let mut found = None;
    for operation in doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|p| p.as_object().unwrap().values())
    {
        for param in operation["parameters"].as_array().into_iter().flatten() {
            if param["name"] == name {
                found = param["schema"]["pattern"].as_str().map(str::to_owned);
            }
        }
    }
    let found = found.or_else(|| {
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        schemas
            .values()
            .find_map(|s| s["properties"][name]["pattern"].as_str().map(str::to_owned))
    });
    regex::Regex::new(&found.unwrap_or_else(|| panic!("no pattern for {name}"))).unwrap()
}

use proptest::strategy::Strategy as _;

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

    /// The contract's selector pattern accepts exactly what `Selector::parse` accepts, so a
    /// client that checks its query against the contract is never refused, nor told a query
    /// is wrong that the server takes (2048 characters and 32 terms are the schema's
    /// `maxLength` and the pattern's repetition; short strings over this alphabet reach
    /// every rule: empty terms, blanks around keys and values, a second `=`, a blank key).
    #[test]
    fn the_selector_pattern_is_what_the_server_parses(
        text in proptest::collection::vec(proptest::sample::select(vec!["a", "b", " ", "\t", ",", "=", "é", "\n"]), 0..24)
            .prop_map(|parts| parts.concat())
    ) {
        let pattern = contract_pattern("selector");
        proptest::prop_assert_eq!(
            pattern.is_match(&text),
            crate::lease::Selector::parse(&text).is_ok(),
            "{:?}", text
        );
    }

    /// The same for the printable strings of a body (`holder`, `sessionKey`, `requestId`).
    #[test]
    fn the_printable_pattern_is_what_the_server_checks(
        c in proptest::char::any()
    ) {
        let pattern = contract_pattern("holder");
        let text = format!("crawler{c}");
        let body = json!({"holder": text}).to_string();
        let accepted = serde_json::from_str::<super::wire::AcquireBody>(&body)
            .map_err(|e| e.to_string())
            .and_then(|b| super::wire::RequestBody::validate(&b));
        proptest::prop_assert_eq!(pattern.is_match(&text), accepted.is_ok(), "{:?}", c);
    }
}

/// 33 terms are one too many for both.
#[test]
fn the_selector_pattern_counts_terms_as_the_server_does() {
    let pattern = contract_pattern("selector");
    for n in [32, 33] {
        let text: Vec<String> = (0..n).map(|i| format!("k{i}=v")).collect();
        let text = text.join(" , ,");
        assert_eq!(pattern.is_match(&text), n <= 32, "{n} terms");
        assert_eq!(crate::lease::Selector::parse(&text).is_ok(), n <= 32, "{n} terms");
    }
}

/// JSON Schema's `integer` includes whole numbers written with a fraction or an exponent; the
/// server takes them as the contract says, and refuses what is not a whole number.
#[tokio::test]
async fn whole_numbers_are_integers_however_written() {
    let h = harness(1, 2);
    let a = h.granted(json!({"holder": "c1", "ttlSeconds": 6e1})).await;
    assert_eq!(a.body["ttlSeconds"], 60, "{}", a.text);
    let id = a.body["leaseId"].as_str().unwrap();
    let token = a.body["fencingToken"].as_u64().unwrap();
    for bad in [json!(token as f64 + 0.5), json!(-1), json!(1e20), json!("7")] {
        let r = h.renew(id, json!({"fencingToken": bad})).await;
        assert_eq!(
            (r.status, code(&r)),
            (StatusCode::BAD_REQUEST, "malformed_request"),
            "{bad}: {}",
            r.text
        );
    }
    let r = h
        .renew(id, json!({"fencingToken": token as f64, "ttlSeconds": 30.0}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
}

/// Milliseconds since the epoch of an RFC 3339 field of an answer.
fn millis_of(answer: &Answer, field: &str) -> i64 {
    let text = answer.body[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} in {}", answer.text));
    text.parse::<jiff::Timestamp>()
        .expect("RFC 3339")
        .as_millisecond()
}

/// Under a politeness entry (one start a second per proxy and domain), an acquire for a
/// covered domain answers when its first request may start and reserves that start, so the
/// next holder of the same proxy is told a second later; each outcome report answers (and
/// reserves) the holder's next start. Other domains, and acquires without one, get no
/// `notBefore`; a repeated acquire (same `requestId`) reserves nothing again.
#[tokio::test]
async fn under_politeness_acquires_and_outcome_reports_say_when_the_next_request_may_go() {
    use crate::politeness::{DomainPattern, Politeness, PolitenessEntry};
    let politeness = Politeness::new(vec![PolitenessEntry {
        domains: vec![DomainPattern::Exact("shop.example".into())],
        proxies: Vec::new(),
        min_interval: Some(Duration::from_secs(1)),
        max_concurrent: None,
        max_wait: Duration::from_secs(5),
    }]);
    let h = harness_with(1, 10, politeness.clone());
    // Close enough for two stamps taken a few statements apart on a loaded machine.
    let near = |a: i64, b: i64| (a - b).abs() < 300;

    let first = h
        .granted(json!({"holder": "a", "targetDomain": "shop.example", "requestId": "r1"}))
        .await;
    let start = millis_of(&first, "notBefore");
    assert!(
        near(start, millis_of(&first, "acquiredAt")),
        "the first may go at once: {}",
        first.text
    );
    let second = h.granted_for("b", "Shop.Example.").await;
    assert!(
        near(millis_of(&second, "notBefore"), start + 1_000),
        "the same proxy and domain, a second later: {}",
        second.text
    );
    let again = h
        .granted(json!({"holder": "a", "targetDomain": "shop.example", "requestId": "r1"}))
        .await;
    assert_eq!(again.body["leaseId"], first.body["leaseId"]);
    assert!(
        again.body.get("notBefore").is_none(),
        "a repeat reserves nothing: {}",
        again.text
    );

    for uncovered in [
        json!({"holder": "c", "targetDomain": "other.example"}),
        json!({"holder": "c"}),
    ] {
        let answer = h.granted(uncovered).await;
        assert!(answer.body.get("notBefore").is_none(), "{}", answer.text);
    }

    let id = first.body["leaseId"].as_str().unwrap();
    let reported = h
        .call(
            "POST",
            &format!("/v1/leases/{id}/outcomes"),
            Some(json!({"fencingToken": first.body["fencingToken"], "targetDomain": "shop.example", "status": 200})),
        )
        .await;
    assert_eq!(reported.status, StatusCode::OK, "{}", reported.text);
    assert!(
        near(millis_of(&reported, "notBefore"), start + 2_000),
        "after the two reserved starts: {}",
        reported.text
    );
    let elsewhere = h
        .call(
            "POST",
            &format!("/v1/leases/{id}/outcomes"),
            Some(json!({"fencingToken": first.body["fencingToken"], "targetDomain": "other.example"})),
        )
        .await;
    assert!(elsewhere.body.get("notBefore").is_none(), "{}", elsewhere.text);

    // The gateway shares the state: its next request to the domain through the proxy waits
    // behind the three starts the lease API reserved.
    let wait = politeness
        .reserve_start(&ProxyKey::new("crawl", "p0"), &Default::default(), "shop.example")
        .expect("covered");
    assert!(wait > Duration::from_millis(2_500), "{wait:?}");
}
