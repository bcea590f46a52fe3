//! The API without authentication (`NoAuthentication`): every request is `anonymous`, whose
//! identity the state makes once.

use super::*;

fn anonymous_harness() -> Harness {
    harness_authenticated_by(1, 1, Default::default(), Arc::new(NoAuthentication))
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
