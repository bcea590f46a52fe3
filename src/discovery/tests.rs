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

const TOKEN: &str = "s3cret-crawler-token";

struct Harness {
    state: DiscoveryState,
    ready: watch::Sender<Readiness>,
}

fn harness(proxies: usize, max_concurrent: i32) -> Harness {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    for i in 0..proxies {
        let key = ProxyKey::new("crawl", &format!("p{i}"));
        store.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 3128 + i as u16,
            },
            attributes: BTreeMap::from([
                (
                    "region".to_owned(),
                    if i % 2 == 0 { "eu" } else { "us" }.to_owned(),
                ),
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
    let mut registry = Registry::default();
    let metrics = DiscoveryMetrics::register(&mut registry);
    let (ready, readiness) = watch::channel(Readiness {
        caches_synced: true,
        leader: true,
        ..Readiness::default()
    });
    let tokens = StaticTokens::parse(&format!("# crawlers\n{TOKEN}\n"));
    let state = DiscoveryState::new(DiscoveryDeps {
        store,
        signer: LeaseSigner::new(&[42u8; 32]).unwrap(),
        auth: Arc::new(tokens),
        readiness,
        registry: Arc::new(registry),
        metrics,
        config: DiscoveryConfig::default(),
    });
    Harness { state, ready }
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
        let response = handle(&self.state, req.body(Full::new(body)).unwrap()).await;
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

#[tokio::test]
async fn lease_lifecycle_over_the_router() {
    let h = harness(2, 1);
    let a = h
        .acquire(json!({"selector": {"region": "eu"}, "holder": "crawler-7", "ttlSeconds": 30}))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
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
        .call(
            "POST",
            &format!("/v1/leases/{id}/release"),
            Some(json!({"fencingToken": new_token, "outcome": "banned", "targetDomain": "shop.example"})),
        )
        .await;
    assert_eq!(rel.status, StatusCode::OK, "{}", rel.text);
    let again = h
        .call(
            "POST",
            &format!("/v1/leases/{id}/release"),
            Some(json!({"fencingToken": new_token, "outcome": "ok"})),
        )
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
            "GET",
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
        config: DiscoveryConfig::default(),
    });
    let h2 = Harness {
        state,
        ready: h.ready,
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
    let first = h.acquire(body.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text);
    let again = h.acquire(body.clone()).await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text);
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
        assert_eq!(
            (refused.status, code(&refused)),
            (StatusCode::BAD_REQUEST, "malformed_request"),
            "{}",
            refused.text
        );
        assert!(refused.text.contains("requestId"), "{}", refused.text);
    }
}

/// A `banned` release that names no domain bans the lease's own target domain, and the journal
/// keeps that ban: what a restart replays is what the store did.
#[tokio::test]
async fn a_ban_without_a_domain_is_journaled_with_the_leases_domain() {
    let (h, journal, dir) = journaled_harness(1);
    let acquired = h
        .acquire(json!({"holder": "c1", "targetDomain": "Shop.Example"}))
        .await;
    assert_eq!(acquired.status, StatusCode::CREATED, "{}", acquired.text);
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
    let acquired = h.acquire(json!({"holder": "c1"})).await;
    assert_eq!(acquired.status, StatusCode::CREATED, "{}", acquired.text);
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
    assert_eq!(
        (refused.status, code(&refused)),
        (StatusCode::SERVICE_UNAVAILABLE, "journal_unavailable"),
        "{}",
        refused.text
    );
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
    let again = h.acquire(json!({"holder": "c3"})).await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text);
    journal.close();
}
