//! The `Authorization` header a lease API request is judged by: the first one, as
//! `HeaderMap::get` reads it, both for the verdict a connection recalls and for a fresh
//! look-up.

use super::*;

/// `GET /v1/leases` with these `Authorization` values, in order, on `h`'s connection.
async fn with_authorizations(h: &Harness, values: &[&str]) -> StatusCode {
    let mut req = Request::builder().method("GET").uri("/v1/leases");
    for value in values {
        req = req.header("authorization", *value);
    }
    let request = req.body(Full::new(Bytes::new())).unwrap();
    let Ok(response) = answer(h.state.clone(), h.connection.clone(), request).await;
    response.status()
}

#[tokio::test]
async fn the_first_authorization_header_is_the_one_judged() {
    let valid = format!("Bearer {TOKEN}");
    let bogus = "Bearer not-the-token";
    // A fresh look-up on each of two connections.
    let first_valid = harness(1, 1);
    assert_eq!(
        with_authorizations(&first_valid, &[&valid, bogus]).await,
        StatusCode::OK
    );
    let first_bogus = harness(1, 1);
    let refused = with_authorizations(&first_bogus, &[bogus, &valid]).await;
    assert_eq!(refused, StatusCode::UNAUTHORIZED);
    // Then the verdict the first connection recalls: only for the same first header.
    assert_eq!(with_authorizations(&first_valid, &[&valid]).await, StatusCode::OK);
    let recalled_refused = with_authorizations(&first_valid, &[bogus, &valid]).await;
    assert_eq!(recalled_refused, StatusCode::UNAUTHORIZED);
    assert_eq!(
        with_authorizations(&first_valid, &[&valid, bogus]).await,
        StatusCode::OK
    );
}
