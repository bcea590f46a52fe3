//! `POST /v1/leases/{id}/outcomes` and the statistics `GET /v1/proxies` serves.

use super::*;

#[tokio::test]
async fn outcomes_are_fenced_like_renewals_and_listed_per_proxy() {
    let h = harness(2, 1);
    let a = h
        .granted(json!({"holder": "crawler-1", "targetDomain": "shop.example"}))
        .await;
    let id = a.body["leaseId"].as_str().unwrap();
    let proxy = a.body["proxy"]["key"].as_str().unwrap().to_owned();
    let token = a.body["fencingToken"].as_u64().unwrap();
    let path = format!("/v1/leases/{id}/outcomes");
    let report = |body: Value| h.call("POST", &path, Some(body));

    let ok = report(
        json!({"fencingToken": token, "targetDomain": "Shop.Example", "status": 200,
        "latencyMs": 120, "bytesReceived": 5120}),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text);
    assert_eq!(
        ok.body,
        json!({"leaseId": id, "proxy": proxy, "targetDomain": "shop.example", "recorded": true})
    );
    for body in [
        json!({"fencingToken": token, "targetDomain": "shop.example", "error": "timeout", "latencyMs": 30000}),
        json!({"fencingToken": token, "targetDomain": "shop.example", "status": 503, "error": "proxy_error"}),
        json!({"fencingToken": token, "targetDomain": "news.example"}),
    ] {
        let answer = report(body).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    }

    // Five more domains, one request each: the listing shows the busiest five (ties by name),
    // and with targetDomain the one asked for after them.
    for n in 0..5 {
        let body = json!({"fencingToken": token, "targetDomain": format!("d{n}.example")});
        assert_eq!(report(body).await.status, StatusCode::OK);
    }
    let domains = |list: &Answer| -> Vec<String> {
        let entry = (list.body["proxies"].as_array().unwrap().iter())
            .find(|p| p["key"] == proxy.as_str())
            .unwrap();
        (entry["outcomes"]["domains"].as_array().unwrap().iter())
            .map(|d| d["domain"].as_str().unwrap().to_owned())
            .collect()
    };
    let list = h.call("GET", "/v1/proxies", None).await;
    assert_eq!(
        domains(&list),
        [
            "shop.example",
            "d0.example",
            "d1.example",
            "d2.example",
            "d3.example"
        ]
    );
    let list = h.call("GET", "/v1/proxies?targetDomain=News.example", None).await;
    assert_eq!(domains(&list).last().map(String::as_str), Some("news.example"));
    assert_eq!(domains(&list).len(), 6);

    // Bad bodies say what to fix.
    for (body, says) in [
        (json!({"fencingToken": token}), "targetDomain"),
        (json!({"fencingToken": token, "targetDomain": "a b"}), "host name"),
        (
            json!({"fencingToken": token, "targetDomain": "x", "status": 99}),
            "100 to 599",
        ),
        (
            json!({"fencingToken": token, "targetDomain": "x", "error": "gone"}),
            "unknown variant",
        ),
        (
            json!({"fencingToken": token, "targetDomain": "x", "colour": 1}),
            "colour",
        ),
    ] {
        let answer = report(body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.text);
        assert!(answer.text.contains(says), "{says}: {}", answer.text);
    }
    // Fenced as a renewal: a stale token, a foreign ID, a released lease.
    let renewed = h.renew(id, json!({"fencingToken": token})).await;
    assert_eq!(renewed.status, StatusCode::OK, "{}", renewed.text);
    let stale = report(json!({"fencingToken": token, "targetDomain": "x"})).await;
    assert_eq!(
        (stale.status, code(&stale)),
        (StatusCode::CONFLICT, "stale_token")
    );
    let foreign = h
        .call(
            "POST",
            "/v1/leases/AAAAnot-a-lease-we-signed/outcomes",
            Some(json!({"fencingToken": 1, "targetDomain": "x"})),
        )
        .await;
    assert_eq!(
        (foreign.status, code(&foreign)),
        (StatusCode::NOT_FOUND, "lease_not_found")
    );
    let current = renewed.body["fencingToken"].as_u64().unwrap();
    h.released(&renewed, "banned").await;
    let released = report(json!({"fencingToken": current, "targetDomain": "x"})).await;
    assert_eq!(
        (released.status, code(&released)),
        (StatusCode::NOT_FOUND, "lease_not_found")
    );

    // The listing: totals and the busiest domains; the ban the release reported counts.
    let list = h.call("GET", "/v1/proxies", None).await;
    let entry = (list.body["proxies"].as_array().unwrap().iter())
        .find(|p| p["key"] == proxy.as_str())
        .unwrap();
    let outcomes = &entry["outcomes"];
    assert_eq!(outcomes["total"]["requests"], 9, "{outcomes}");
    assert_eq!(outcomes["total"]["successes"], 7, "{outcomes}");
    assert_eq!(outcomes["total"]["bans"], 1, "{outcomes}");
    assert_eq!(outcomes["domains"][0]["domain"], "shop.example", "{outcomes}");
    let shop = &outcomes["domains"][0]["stats"];
    assert_eq!(shop["failures"]["timeout"], 1, "{outcomes}");
    assert_eq!(shop["failures"]["proxyError"], 1, "{outcomes}");
    assert_eq!(shop["bans"], 1, "{outcomes}");
    assert_eq!(shop["latencyMs"], json!({"p50": 120, "p95": 30000, "samples": 2}));
    assert_eq!(shop["bytesReceived"], 5120);
    assert_eq!(outcomes["otherDomains"], 2, "{outcomes}");
    // A proxy nothing went through has no statistics.
    let other = (list.body["proxies"].as_array().unwrap().iter())
        .find(|p| p["key"] != proxy.as_str())
        .unwrap();
    assert!(other.get("outcomes").is_none(), "{other}");
}
