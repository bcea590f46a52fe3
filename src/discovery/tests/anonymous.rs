//! The API without authentication (`NoAuthentication`): every request is `anonymous`, whose
//! identity the state makes once.

use super::*;

fn anonymous_harness() -> Harness {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    add_proxy(&store, "p0", 3128, "eu", 1);
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
        auth: Arc::new(NoAuthentication),
        readiness,
        registry: Arc::new(registry),
        metrics,
        outcomes: Default::default(),
        usage: Default::default(),
        politeness: Default::default(),
        config: DiscoveryConfig::default(),
    });
    Harness {
        state,
        ready,
        connection: Arc::default(),
    }
}

#[tokio::test]
async fn without_authentication_every_request_is_anonymous_and_shares_one_identity() {
    let h = anonymous_harness();
    let body = Bytes::from(json!({"holder": "c1"}).to_string());
    let granted = h.raw("POST", "/v1/leases", None, body).await;
    assert_eq!(granted.status, StatusCode::CREATED, "{}", granted.text);
    let id = granted.body["leaseId"].as_str().unwrap();
    let token = granted.body["fencingToken"].as_u64().unwrap();
    let release = Bytes::from(json!({"fencingToken": token, "outcome": "ok"}).to_string());
    let path = format!("/v1/leases/{id}/release");
    let released = h.raw("POST", &path, None, release).await;
    assert_eq!(released.status, StatusCode::OK, "{}", released.text);

    let usage = (h.state.inner.deps.usage.token("anonymous")).expect("counted as anonymous");
    assert_eq!(usage.requests, 1);

    let parts = Request::new(()).into_parts().0;
    let remembered = RememberedVerdict::default();
    let s = &h.state.inner;
    let first = request::authenticate(s, &parts, &remembered).await.unwrap();
    let second = request::authenticate(s, &parts, &remembered).await.unwrap();
    assert_eq!(first.name, "anonymous");
    assert!(Arc::ptr_eq(&first, &second), "one identity for every request");
}
