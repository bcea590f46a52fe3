//! The status page (`GET /ui`) in a real browser: standalone mode as a user runs it (the real
//! binary, real Squids from the `local` provider, one with proxy credentials from a Secret),
//! leases taken over the discovery API, one released `banned` for a domain, one Squid killed
//! with SIGKILL and restarted by the local provider's supervision; then headless Chromium
//! (Debian's `chromium`) loads the page with the discovery token as the Basic password, dumps
//! its DOM and takes a screenshot. The DOM must show the proxies' names, phases, endpoints,
//! attributes, lease counts and holders (with lease-ID tails, never whole IDs), the ban and its
//! end, the restart, provider health and audit reasons, and neither the credentials' canary
//! password nor the token; paging and filters work over HTTP, and a bad query string gets a 400.
//! Without credentials the page asks for them (401 with a Basic challenge).
//!
//! The same page in cluster mode (on the admin port, against a real kube-apiserver and etcd)
//! shows the same things from the controller's cache and its in-memory audit.
//!
//! The golden screenshot: Chromium renders the page of a fixed view (fixed clock and proxies)
//! served from a loopback socket, and the PNG must match `tests/fixtures/status_page.png` within
//! a small tolerance; `EPO_UPDATE_SCREENSHOTS=1` writes a new one.
//!
//! `EPO_UI_SCREENSHOT=FILE` keeps a copy of the real run's screenshot (to look at it).
//! Needs `chromium` and `squid` (scripts/test.sh installs them).

#[path = "support/blocking_http.rs"]
mod blocking_http;
mod support;

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use blocking_http::{base64, request};
use egress_proxies_operator::{
    api::Proxy,
    health::{HealthSnapshot, Verdict},
    lease::Availability,
    outcomes::Quantiles,
    ui,
};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, api::PostParams};
use support::{
    Origin,
    cluster_app::{ClusterApp, local_cluster, local_proxy},
    control_plane::ControlPlane,
    free_port,
    standalone::{self, Host, healthy_rows, start_operator, stop, wait_status},
};

/// The proxy credentials' password: it must never reach the page.
const CANARY_PASSWORD: &str = "ui-canary-pw-5f2c91";

/// How the page shows one restart of a proxy's Squid.
const RESTARTED_ONCE: &str = "process restarts: <b class=\"restarts\">1</b>, last ";

/// Runs Chromium headless on `url` with `args`; returns its stdout. Killed after 90 s.
fn chromium(profile: &Path, args: &[&str], url: &str) -> String {
    let output = Command::new("timeout")
        .args(["90", "chromium", "--headless", "--no-sandbox", "--disable-gpu"])
        .args([
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
        ])
        .args(["--disable-component-update", "--disable-sync"])
        .args(["--disable-dev-shm-usage", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .expect("running chromium (Debian package `chromium`; scripts/test.sh installs it)");
    assert!(
        output.status.success(),
        "chromium {args:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8 DOM")
}

/// The DOM's text between tags, whitespace collapsed and entities decoded (what a reader
/// sees, in order).
fn visible_text(dom: &str) -> String {
    let mut text = String::new();
    let mut in_tag = false;
    for c in dom.chars() {
        match c {
            '<' => {
                in_tag = true;
                text.push(' ');
            }
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// The HTML of the element that starts with `start` up to the next `</tr>` (one table row).
fn row<'a>(dom: &'a str, start: &str) -> &'a str {
    let at = dom
        .find(start)
        .unwrap_or_else(|| panic!("no {start} in the DOM:\n{dom}"));
    let rest = &dom[at..];
    &rest[..rest.find("</tr>").unwrap_or(rest.len())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_in_headless_chromium_shows_proxies_leases_and_audit() {
    let origin = Origin::start().await;
    let host = Host::new();
    let health_url = origin.http_url("/health");
    host.add_manifest(
        "credentials",
        &standalone::credentials_secret("web-credentials", "crawler", CANARY_PASSWORD),
    );
    let (port_1, port_2) = (free_port(), free_port());
    let web_1 = standalone::manifest(
        "web-1",
        port_1,
        &health_url,
        &[("pool", "ui"), ("slot", "one")],
        &[("maxConcurrent", 3)],
    );
    host.add_manifest("web-1", &standalone::with_auth(&web_1, "web-credentials"));
    host.add_manifest(
        "web-2",
        &standalone::manifest(
            "web-2",
            port_2,
            &health_url,
            &[("pool", "ui"), ("slot", "two")],
            &[("maxConcurrent", 1)],
        ),
    );
    // web-3's health URL answers 500: it stays provisioning with a failing verdict.
    let port_3 = free_port();
    host.add_manifest(
        "web-3",
        &standalone::manifest(
            "web-3",
            port_3,
            &origin.http_url("/status/500"),
            &[("pool", "ui"), ("slot", "three")],
            &[("maxConcurrent", 1)],
        ),
    );
    let operator = start_operator(&host, "operator.log");
    wait_status(&host, "two healthy proxies", |t| healthy_rows(t) == 2).await;
    let token = host.token();
    let api: SocketAddr = ([127, 0, 0, 1], host.api_port).into();
    ui_page_until(api, &token, "web-3 shown failing", |page| {
        page.contains("data-proxy=\"default/web-3\"")
            && visible_text(row(page, "data-proxy=\"default/web-3\"")).contains("failing")
    })
    .await;

    // Two leases on web-1 (whose URL carries the password: the page must not).
    let mut lease_ids = Vec::new();
    for holder in ["crawler-a", "crawler-b"] {
        let lease = acquire(api, &token, r#"{"slot":"one"}"#, holder);
        assert!(
            lease.contains(CANARY_PASSWORD),
            "the lease itself carries the credentials"
        );
        lease_ids.push((holder, field(&lease, "leaseId")));
    }
    // web-2 banned for shop.example through the release API.
    let lease = acquire_for(
        api,
        &token,
        r#"{"slot":"two"}"#,
        "crawler-c",
        Some("shop.example"),
    );
    let released = request(
        api,
        "POST",
        &format!("/v1/leases/{}/release", field(&lease, "leaseId")),
        &[
            ("Authorization", format!("Bearer {token}")),
            ("Content-Type", "application/json".to_owned()),
        ],
        &format!(
            r#"{{"fencingToken":{},"outcome":"banned"}}"#,
            field(&lease, "fencingToken")
        ),
    )
    .expect("release");
    assert_eq!(released.status, 200, "{}", released.body);
    // web-3's Squid killed (-9): the local provider's supervision restarts it, and the page
    // counts the restart.
    let web_3_dir = std::fs::read_dir(host.path().join("local"))
        .expect("the local provider's state folder")
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().contains("-web-3-"))
        })
        .expect("web-3's instance folder");
    let before = standalone::squids(&web_3_dir);
    assert_eq!(before.len(), 1, "{before:?}");
    let killed = Command::new("kill")
        .args(["-KILL", &before[0].to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    ui_page_until(api, &token, "web-3's restart shown", |page| {
        row(page, "data-proxy=\"default/web-3\"").contains(RESTARTED_ONCE)
    })
    .await;
    let now = standalone::squids(&web_3_dir);
    assert!(now.len() == 1 && now != before, "a new Squid: {now:?}");
    // A probe in the moment between the kill and the new Squid's listening fails with
    // "connection refused"; the page below shows the last probe's error, so wait for one
    // through the new Squid (the health URL's 500 again).
    ui_page_until(api, &token, "web-3 probed through its new Squid", |page| {
        visible_text(row(page, "data-proxy=\"default/web-3\"")).contains("500")
    })
    .await;

    // No credentials, or wrong ones: a Basic challenge, and nothing of the page.
    for headers in [
        vec![],
        vec![("Authorization", format!("Basic {}", base64(b"ui:wrong-token")))],
    ] {
        let denied = request(api, "GET", "/ui", &headers, "").expect("GET /ui");
        assert_eq!(denied.status, 401, "{}", denied.body);
        assert!(
            denied
                .header("www-authenticate")
                .is_some_and(|v| v.starts_with("Basic ")),
            "{:?}",
            denied.headers
        );
        assert!(!denied.body.contains("web-1"), "{}", denied.body);
    }
    let page = ui_page(api, &token);
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        page.header("content-type")
            .is_some_and(|v| v.starts_with("text/html"))
    );
    assert!(!page.body.contains("<script"), "no JavaScript");

    // The browser: credentials in the URL answer the page's Basic challenge.
    let url = format!("http://ui:{token}@127.0.0.1:{}/ui", host.api_port);
    let profile = tempfile::tempdir().expect("chromium profile");
    let dom = chromium(profile.path(), &["--dump-dom"], &url);
    let text = visible_text(&dom);

    assert!(text.contains("standalone mode"), "{text}");
    // Attributes, holders (lease-ID tails only), the ban and process restarts.
    let cells = visible_text(row(&dom, "data-proxy=\"default/web-1\""));
    assert!(cells.contains("pool=ui") && cells.contains("slot=one"), "{cells}");
    for (holder, id) in &lease_ids {
        let tail = &id[id.len() - 8..];
        assert!(cells.contains(&format!("{holder} …{tail}")), "{holder}: {cells}");
        assert!(!dom.contains(id.as_str()), "a whole lease ID reached the page");
    }
    assert!(cells.contains("process restarts: 0"), "{cells}");
    assert!(
        !cells.contains("process restarts: 0 , last"),
        "never restarted: {cells}"
    );
    let cells = visible_text(row(&dom, "data-proxy=\"default/web-2\""));
    assert!(cells.contains("slot=two"), "{cells}");
    assert!(
        cells.contains("banned for shop.example until "),
        "the ban and its end: {cells}"
    );
    let web_3 = row(&dom, "data-proxy=\"default/web-3\"");
    assert!(web_3.contains(RESTARTED_ONCE), "{web_3}");
    let cells = visible_text(web_3);
    assert!(cells.contains("process restarts: 1 , last "), "{cells}");
    assert!(cells.contains("not measured"), "traffic: {cells}");
    // web-2's lease released as banned: a ban in its traffic.
    let cells = visible_text(row(&dom, "data-proxy=\"default/web-2\""));
    assert!(cells.contains("0 requests 0 errors, 1 ban"), "traffic: {cells}");
    assert!(cells.contains("most: shop.example (0)"), "traffic: {cells}");
    // The page reloads itself (same URL, so filters stay).
    assert!(
        page.body.contains("<meta http-equiv=\"refresh\" content=\"10\">"),
        "{}",
        page.body
    );
    // Filtering and paging over HTTP, and a bad query string gets a 400 that says why.
    let filtered = ui_query(api, &token, "phase=provisioning");
    assert_eq!(filtered.status, 200);
    assert!(filtered.body.contains("data-proxy=\"default/web-3\""));
    assert!(!filtered.body.contains("data-proxy=\"default/web-1\""));
    let paged = ui_query(api, &token, "limit=1&page=2");
    assert!(
        paged.body.contains("data-proxy=\"default/web-2\""),
        "{}",
        paged.body
    );
    assert!(!paged.body.contains("data-proxy=\"default/web-1\""));
    assert!(
        paged.body.contains("rel=\"next\" href=\"?page=3&amp;limit=1\""),
        "{}",
        paged.body
    );
    let bad = ui_query(api, &token, "limit=0");
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("limit must be 1-500"), "{}", bad.body);

    for (name, port, leases) in [("web-1", port_1, "2 / 3"), ("web-2", port_2, "0 / 1")] {
        let proxy = row(&dom, &format!("data-proxy=\"default/{name}\""));
        assert!(proxy.contains("data-phase=\"healthy\""), "{proxy}");
        let cells = visible_text(proxy);
        assert!(cells.contains(&format!("default/ {name}")), "{cells}");
        assert!(cells.contains(&format!("127.0.0.1:{port}")), "{cells}");
        assert!(cells.contains(&format!("{leases} slots")), "{cells}");
        assert!(cells.contains("passing"), "health: {cells}");
        assert!(
            cells.contains("changes:") && cells.contains(" passing"),
            "history: {cells}"
        );
        assert!(cells.contains("local"), "provider: {cells}");
    }
    let web_3 = row(&dom, "data-proxy=\"default/web-3\"");
    assert!(web_3.contains("data-phase=\"provisioning\""), "{web_3}");
    let cells = visible_text(web_3);
    assert!(cells.contains(&format!("127.0.0.1:{port_3}")), "{cells}");
    assert!(cells.contains("failing"), "health: {cells}");
    assert!(cells.contains("500"), "the probe's error: {cells}");
    assert!(
        visible_text(row(&dom, "data-provider=\"local\"")).contains("available 3"),
        "{text}"
    );
    assert!(text.contains("2 active leases"), "{text}");
    // The audit trail: how each became healthy, newest first.
    for name in ["web-1", "web-2"] {
        let at = dom
            .find(&format!("class=\"audit\" data-proxy=\"default/{name}\""))
            .expect("audit section");
        let audit = visible_text(&dom[at..at + dom[at..].find("</details>").expect("end of section")]);
        for reason in ["ProvisioningStarted", "InstanceCreated", "Healthy"] {
            assert!(audit.contains(reason), "{name}'s audit lacks {reason}: {audit}");
        }
        assert!(
            audit.contains("provisioning --health_passed--> healthy"),
            "{audit}"
        );
    }
    assert!(
        !dom.contains(CANARY_PASSWORD),
        "the proxy password reached the page"
    );
    assert!(!dom.contains(&token), "the token reached the page");

    let shot = host.path().join("status-page.png");
    chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1400,1100",
        ],
        &url,
    );
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    // A blank or error page compresses to a few kB; this one has tables and text.
    assert!(
        png.len() > 40_000,
        "the screenshot is {} bytes: nearly empty?",
        png.len()
    );
    if let Some(copy) = std::env::var_os("EPO_UI_SCREENSHOT") {
        std::fs::copy(&shot, copy).expect("copy of the screenshot");
    }

    stop(operator);
}

/// `GET /ui` with `token` as a bearer token.
fn ui_page(api: SocketAddr, token: &str) -> blocking_http::Response {
    let bearer = [("Authorization", format!("Bearer {token}"))];
    request(api, "GET", "/ui", &bearer, "").expect("GET /ui")
}

/// Reads `/ui` every 200 ms until a 200 page satisfies `shows` (60 s at most: then fails,
/// naming `what` and showing the last page). The blocking request runs off the runtime, so the
/// test's origin server keeps answering the probes meanwhile.
async fn ui_page_until(api: SocketAddr, token: &str, what: &str, shows: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let token = token.to_owned();
        let page = tokio::task::spawn_blocking(move || ui_page(api, &token))
            .await
            .expect("request task");
        if page.status == 200 && shows(&page.body) {
            return;
        }
        assert!(Instant::now() < deadline, "never {what}:\n{}", page.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `GET /ui?query` with `token` as a bearer token.
fn ui_query(api: SocketAddr, token: &str, query: &str) -> blocking_http::Response {
    let bearer = [("Authorization", format!("Bearer {token}"))];
    request(api, "GET", &format!("/ui?{query}"), &bearer, "").expect("GET /ui")
}

/// A top-level field of a JSON body, as text (strings unquoted).
fn field(body: &str, name: &str) -> String {
    let json: serde_json::Value = serde_json::from_str(body).expect("JSON");
    match &json[name] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => panic!("no {name} in {body}"),
        other => other.to_string(),
    }
}

/// Acquires a lease on the proxies matching `selector` (`{"key":"value"}`) for `holder`.
fn acquire(api: SocketAddr, token: &str, selector: &str, holder: &str) -> String {
    acquire_for(api, token, selector, holder, None)
}

/// [`acquire`] for `domain`, if given.
fn acquire_for(api: SocketAddr, token: &str, selector: &str, holder: &str, domain: Option<&str>) -> String {
    let domain = domain.map_or_else(String::new, |d| format!(r#","targetDomain":"{d}""#));
    let lease = request(
        api,
        "POST",
        "/v1/leases",
        &[
            ("Authorization", format!("Bearer {token}")),
            ("Content-Type", "application/json".to_owned()),
        ],
        &format!(r#"{{"selector":{selector},"holder":"{holder}","ttlSeconds":300{domain}}}"#),
    )
    .expect("acquire");
    assert_eq!(lease.status, 201, "{}", lease.body);
    lease.body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_in_cluster_mode_is_on_the_admin_port() {
    const TOKEN: &str = "status-page-cluster-token-0123456789";
    let origin = Origin::start().await;
    let (_plane, client) = ControlPlane::with_crds(&["crawl"]).await;
    let host = Host::new(); // Kills the local provider's Squids under it on Drop.
    let (admin_port, discovery_port, proxy_port) = (free_port(), free_port(), free_port());
    let admin: SocketAddr = ([127, 0, 0, 1], admin_port).into();
    let discovery: SocketAddr = ([127, 0, 0, 1], discovery_port).into();
    let options = local_cluster(host.path(), &host.path().join("local"), TOKEN, admin, discovery);
    let operator = ClusterApp::start(client.clone(), options);

    let secret: Secret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "web-credentials", "namespace": "crawl"},
        "data": {"username": base64(b"crawler"), "password": base64(CANARY_PASSWORD.as_bytes())},
    }))
    .expect("valid Secret");
    Api::<Secret>::namespaced(client.clone(), "crawl")
        .create(&PostParams::default(), &secret)
        .await
        .expect("Secret created");
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    let proxy = local_proxy(
        "edge-1",
        proxy_port,
        &origin.http_url("/health"),
        // Every 2 s: the timeout (1 s) must be shorter, as the CRD's rule says.
        2,
        serde_json::json!({
            "attributes": {"pool": "cluster"},
            "lease": {"maxConcurrent": 2},
            "auth": {"secretRef": {"name": "web-credentials"}},
        }),
    );
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("Proxy created");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let phase = proxies.get("edge-1").await.ok().and_then(|p| p.status?.phase);
        if phase.as_deref() == Some("healthy") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "edge-1 never became healthy: {phase:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lease =
        tokio::task::spawn_blocking(move || acquire(discovery, TOKEN, r#"{"pool":"cluster"}"#, "crawler-c"))
            .await
            .expect("acquire task");
    assert!(
        lease.contains(CANARY_PASSWORD),
        "the lease carries the credentials"
    );

    let denied = tokio::task::spawn_blocking(move || request(admin, "GET", "/ui", &[], "").expect("GET /ui"))
        .await
        .expect("request task");
    assert_eq!(
        denied.status, 401,
        "the admin port's /ui needs the discovery token: {}",
        denied.body
    );

    let url = format!("http://ui:{TOKEN}@127.0.0.1:{admin_port}/ui");
    let profile = tempfile::tempdir().expect("chromium profile");
    let dom = tokio::task::spawn_blocking(move || chromium(profile.path(), &["--dump-dom"], &url))
        .await
        .expect("chromium task");
    let text = visible_text(&dom);
    assert!(text.contains("cluster mode"), "{text}");
    let cells = visible_text(row(&dom, "data-proxy=\"crawl/edge-1\""));
    for expected in [
        "crawl/ edge-1",
        "healthy",
        "local",
        &format!("127.0.0.1:{proxy_port}"),
        "1 / 2 slots",
        "passing",
    ] {
        assert!(cells.contains(expected), "{expected:?} not in {cells}");
    }
    let at = dom
        .find("class=\"audit\" data-proxy=\"crawl/edge-1\"")
        .expect("audit section");
    let audit = visible_text(&dom[at..at + dom[at..].find("</details>").expect("end of section")]);
    assert!(
        audit.contains("provisioning --health_passed--> healthy"),
        "{audit}"
    );
    assert!(audit.contains("InstanceCreated"), "{audit}");
    assert!(
        !dom.contains(CANARY_PASSWORD),
        "the proxy password reached the page"
    );
    assert!(!dom.contains(TOKEN), "the token reached the page");
    operator.stop().await;
}

/// Cluster mode keeps its trail in memory, and every process starts with none: a replica that
/// takes over reads back what earlier leaders published as Events, so the page still shows how
/// each Proxy got where it is (here: transitions only the first leader took).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_status_page_shows_the_trail_across_a_leader_change() {
    const TOKEN: &str = "status-page-history-token-0123456789";
    let origin = Origin::start().await;
    let (_plane, client) = ControlPlane::with_crds(&["crawl"]).await;
    let host = Host::new();
    let proxy_port = free_port();
    let local = host.path().join("local");
    let addresses = || -> (SocketAddr, SocketAddr) {
        (
            ([127, 0, 0, 1], free_port()).into(),
            ([127, 0, 0, 1], free_port()).into(),
        )
    };
    let (admin, discovery) = addresses();
    let first = ClusterApp::start(
        client.clone(),
        local_cluster(host.path(), &local, TOKEN, admin, discovery),
    );
    let proxy = local_proxy(
        "edge-2",
        proxy_port,
        &origin.http_url("/health"),
        // Every 2 s: the timeout (1 s) must be shorter, as the CRD's rule says.
        2,
        serde_json::json!({}),
    );
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .expect("Proxy created");
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxies
        .get("edge-2")
        .await
        .ok()
        .and_then(|p| p.status?.phase)
        .as_deref()
        != Some("healthy")
    {
        assert!(Instant::now() < deadline, "edge-2 never became healthy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first.stop().await;

    let (admin, discovery) = addresses();
    let second = ClusterApp::start(
        client.clone(),
        local_cluster(host.path(), &local, TOKEN, admin, discovery),
    );
    let authorization = format!("Basic {}", base64(format!("ui:{TOKEN}").as_bytes()));
    let deadline = Instant::now() + Duration::from_secs(60);
    let audit = loop {
        let headers = vec![("Authorization", authorization.clone())];
        let page = tokio::task::spawn_blocking(move || request(admin, "GET", "/ui", &headers, ""))
            .await
            .expect("request task");
        let last_seen = match &page {
            Ok(page) => format!("{} {}", page.status, visible_text(&page.body)),
            Err(err) => format!("{err}"),
        };
        if let Ok(page) = page
            && page.status == 200
            && let Some(at) = page.body.find("class=\"audit\" data-proxy=\"crawl/edge-2\"")
        {
            let section = &page.body[at..at + page.body[at..].find("</details>").expect("end of section")];
            let audit = visible_text(section);
            if audit.contains("pending --spec_observed--> provisioning") {
                break audit;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the new leader's page never showed the first leader's trail; last seen:\n{last_seen}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for expected in [
        "ProvisioningStarted",
        "InstanceCreated",
        "provisioning --health_passed--> healthy",
    ] {
        assert!(audit.contains(expected), "{expected:?} not in {audit}");
    }
    second.stop().await;
}

/// The golden screenshot: `tests/fixtures/status_page.png`.
const GOLDEN: &str = "tests/fixtures/status_page.png";
/// A pixel differs when one of its channels differs by more than this (anti-aliasing noise).
const CHANNEL_TOLERANCE: u8 = 40;
/// The share of differing pixels allowed (0.5 %): a changed word or row moves far more.
const PIXEL_TOLERANCE: f64 = 0.005;

/// A fixed view of the page: a fixed clock and fixed proxies, so every age and time is the same
/// on every run. It shows every part: attributes, slots, holders with lease-ID tails, bans,
/// process restarts, health with history, a down provider, pagination and the audit trail.
fn fixed_view() -> ui::StatusView {
    let at = |s: &str| s.parse::<Timestamp>().expect("timestamp");
    let now = at("2026-12-04T12:00:00Z");
    let state = |name: &str, phase: &str, port: u16, ready: (&str, &str)| ui::ProxyState {
        namespace: "crawl".to_owned(),
        name: name.to_owned(),
        provider: "local".to_owned(),
        phase: phase.to_owned(),
        deleting: false,
        endpoint: Some(format!("127.0.0.1:{port}")),
        ready: Some((ready.0.to_owned(), ready.1.to_owned())),
        created: Some(at("2026-12-04T09:12:00Z")),
        provider_id: Some(format!("local/local/epo-crawl-{name}-0a1b2c3d")),
    };
    let attributes = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<Vec<_>>()
    };
    let passing = |since: &str| HealthSnapshot {
        verdict: Verdict::Passing,
        consecutive_successes: 42,
        last_latency: Some(Duration::from_millis(12)),
        last_probe_at: Some(at("2026-12-04T11:59:48Z")),
        verdict_since: Some(at(since)),
        probes: 44,
        ..HealthSnapshot::default()
    };
    let audit = |reason: &str, arrow: &str, when: &str| ui::AuditRow {
        at: at(when),
        arrow: arrow.to_owned(),
        reason: reason.to_owned(),
        message: String::new(),
    };
    let trail = vec![
        audit(
            "ProvisioningStarted",
            "pending --spec_observed--> provisioning",
            "2026-12-04T09:12:01Z",
        ),
        audit(
            "InstanceCreated",
            "provisioning --instance_created--> provisioning",
            "2026-12-04T09:12:02Z",
        ),
        audit(
            "Healthy",
            "provisioning --health_passed--> healthy",
            "2026-12-04T09:12:05Z",
        ),
    ];
    let web_1 = ui::ProxyRow {
        state: state("web-1", "healthy", 31281, ("Healthy", "health checks pass")),
        attributes: attributes(&[("pool", "retail"), ("region", "eu-west")]),
        leases: Some(ui::LeaseRow {
            availability: Availability::Available,
            active: 2,
            max_concurrent: 4,
            cooldown_until: None,
            bans: vec![("shop.example".to_owned(), at("2026-12-04T12:25:00Z"))],
            holders: vec![
                ui::HolderRow {
                    holder: "crawler-a".to_owned(),
                    id_tail: Some("Q2x9fTbA".to_owned()),
                    acquired: at("2026-12-04T11:58:00Z"),
                    expires: at("2026-12-04T12:03:00Z"),
                    target_domain: Some("news.example".to_owned()),
                },
                ui::HolderRow {
                    holder: "crawler-b".to_owned(),
                    id_tail: Some("u7RkP0zc".to_owned()),
                    acquired: at("2026-12-04T11:59:30Z"),
                    expires: at("2026-12-04T12:04:30Z"),
                    target_domain: None,
                },
            ],
        }),
        process: Some(ui::ProcessRow {
            restarts: 0,
            last_restart: None,
            last_error: None,
        }),
        traffic: Some(ui::Traffic {
            requests: 1_284,
            errors: 37,
            bans: 1,
            latency: Some(Quantiles {
                p50: 182,
                p95: 940,
                samples: 64,
            }),
            top_domain: Some(("shop.example".to_owned(), 1_020)),
            domains: 3,
        }),
        health: Some(passing("2026-12-04T09:12:05Z")),
        health_history: vec![ui::HealthChange {
            at: at("2026-12-04T09:12:05Z"),
            verdict: Verdict::Passing,
            error: None,
        }],
        audit: trail.clone(),
    };
    let web_2 = ui::ProxyRow {
        state: state("web-2", "healthy", 31282, ("Healthy", "health checks pass")),
        attributes: attributes(&[("pool", "retail"), ("region", "us-east")]),
        leases: Some(ui::LeaseRow {
            availability: Availability::CoolingDown,
            active: 0,
            max_concurrent: 1,
            cooldown_until: Some(at("2026-12-04T12:00:20Z")),
            bans: Vec::new(),
            holders: Vec::new(),
        }),
        process: Some(ui::ProcessRow {
            restarts: 2,
            last_restart: Some(at("2026-12-04T11:57:00Z")),
            last_error: None,
        }),
        traffic: None,
        health: Some(HealthSnapshot {
            recovered: true,
            ..passing("2026-12-04T11:57:10Z")
        }),
        health_history: vec![
            ui::HealthChange {
                at: at("2026-12-04T11:56:55Z"),
                verdict: Verdict::Failing,
                error: Some("connection refused".to_owned()),
            },
            ui::HealthChange {
                at: at("2026-12-04T11:57:10Z"),
                verdict: Verdict::Passing,
                error: None,
            },
        ],
        audit: trail.clone(),
    };
    let web_3 = ui::ProxyRow {
        state: state(
            "web-3",
            "provisioning",
            31283,
            ("HealthCheckFailed", "probe answered 500 Internal Server Error"),
        ),
        attributes: Vec::new(),
        leases: None,
        process: Some(ui::ProcessRow {
            restarts: 0,
            last_restart: None,
            last_error: None,
        }),
        traffic: None,
        health: Some(HealthSnapshot {
            verdict: Verdict::Failing,
            consecutive_failures: 5,
            last_error: Some("probe answered 500 Internal Server Error".to_owned()),
            last_probe_at: Some(at("2026-12-04T11:59:55Z")),
            verdict_since: Some(at("2026-12-04T11:58:00Z")),
            probes: 5,
            ..HealthSnapshot::default()
        }),
        health_history: Vec::new(),
        audit: trail[..2].to_vec(),
    };
    ui::StatusView {
        mode: "standalone",
        now,
        providers: vec![
            ui::ProviderRow {
                name: "local".to_owned(),
                down_reason: None,
                proxies: 240,
            },
            ui::ProviderRow {
                name: "kvm".to_owned(),
                down_reason: Some("connecting to qemu:///system: no such file".to_owned()),
                proxies: 0,
            },
        ],
        proxies: vec![web_1, web_2, web_3],
        // Page 2 of a filtered pool, three per page: every pagination link shows.
        total: 240,
        matched: 12,
        phases: [("healthy".to_owned(), 231), ("provisioning".to_owned(), 9)]
            .into_iter()
            .collect(),
        active_leases: 57,
        query: ui::PageQuery {
            page: 2,
            limit: 3,
            q: Some("pool=retail".to_owned()),
            ..ui::PageQuery::default()
        },
        usage: fixed_usage(now),
    }
}

/// Two tokens, one with a quota it used up, and their holders.
fn fixed_usage(now: jiff::Timestamp) -> ui::UsageView {
    use egress_proxies_operator::usage::{Quotas, Usage};
    let now_ms = u64::try_from(now.as_millisecond()).expect("after 1970");
    let usage = Usage::default();
    let quotas = "quotas:\n  - {token: crawler-a, requests: 40, period: 1h}\n";
    usage.set_quotas(Quotas::parse(quotas, "quotas.yaml").expect("quotas"));
    for (token, holder, requests, bytes) in [
        ("crawler-a", "scrapy/shop", 30, 1_250_000),
        ("crawler-a", "scrapy/news", 10, 310_000),
        ("token-2", "batch-7", 4, 52_000),
    ] {
        for _ in 0..requests {
            usage.admit(token, holder, now_ms).expect("within the quota");
        }
        usage.add_bytes(token, holder, bytes, now_ms);
        usage.lease_ended(token, holder, requests * 1_400, holder == "scrapy/shop");
    }
    ui::UsageView::of(&usage, now_ms)
}

/// Serves `html` to every request on 127.0.0.1 (a port of its own) until dropped.
struct FixedServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FixedServer {
    fn start(html: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut stream) = stream else { continue };
                // The request head (the page is the same for every request).
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                    head.push(byte[0]);
                }
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{html}",
                    html.len()
                );
            }
        });
        Self {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for FixedServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = std::net::TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// RGBA pixels and size of a PNG.
fn decode(png_bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buffer = vec![0; reader.output_buffer_size().expect("size")];
    let info = reader.next_frame(&mut buffer).expect("PNG pixels");
    let pixels = &buffer[..info.buffer_size()];
    let rgba = match info.color_type {
        png::ColorType::Rgba => pixels.to_vec(),
        png::ColorType::Rgb => pixels
            .chunks_exact(3)
            .flat_map(|p| [p[0], p[1], p[2], 255])
            .collect(),
        png::ColorType::GrayscaleAlpha => pixels
            .chunks_exact(2)
            .flat_map(|p| [p[0], p[0], p[0], p[1]])
            .collect(),
        png::ColorType::Grayscale => pixels.iter().flat_map(|&g| [g, g, g, 255]).collect(),
        png::ColorType::Indexed => unreachable!("normalize_to_color8 expands palettes"),
    };
    (info.width, info.height, rgba)
}

/// The share of pixels that differ by more than [`CHANNEL_TOLERANCE`] in a channel.
fn differing_share(a: &[u8], b: &[u8]) -> f64 {
    let differing = a
        .chunks_exact(4)
        .zip(b.chunks_exact(4))
        .filter(|(p, q)| {
            p.iter()
                .zip(q.iter())
                .any(|(x, y)| x.abs_diff(*y) > CHANNEL_TOLERANCE)
        })
        .count();
    differing as f64 / (a.len() / 4) as f64
}

/// Headless Chromium renders the page of a fixed view; the screenshot must match the committed
/// golden image within a small tolerance. `EPO_UPDATE_SCREENSHOTS=1` writes a new golden image
/// instead (look at it before committing it).
#[test]
fn the_status_page_screenshot_matches_the_golden_image() {
    let html = ui::render(&fixed_view());
    let server = FixedServer::start(html);
    let profile = tempfile::tempdir().expect("chromium profile");
    let shot = profile.path().join("shot.png");
    chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1400,1000",
            "--force-device-scale-factor=1",
            "--font-render-hinting=none",
        ],
        &format!("http://{}/ui", server.addr),
    );
    drop(server);
    let actual = std::fs::read(&shot).expect("the screenshot was written");
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
    if std::env::var_os("EPO_UPDATE_SCREENSHOTS").is_some() {
        std::fs::write(&golden, &actual).expect("writing the golden image");
        return;
    }
    let expected = std::fs::read(&golden)
        .unwrap_or_else(|e| panic!("{GOLDEN}: {e} (EPO_UPDATE_SCREENSHOTS=1 writes it)"));
    let (w, h, got) = decode(&actual);
    let (gw, gh, want) = decode(&expected);
    let keep = || {
        let copy = std::env::temp_dir().join("status_page.actual.png");
        let _ = std::fs::write(&copy, &actual);
        copy
    };
    assert_eq!(
        (w, h),
        (gw, gh),
        "screenshot size differs from {GOLDEN}; this run's is in {}",
        keep().display()
    );
    let share = differing_share(&got, &want);
    assert!(
        share <= PIXEL_TOLERANCE,
        "{:.2} % of the pixels differ from {GOLDEN} (at most {:.2} % may): this run's screenshot \
         is in {}; if the change is intended, EPO_UPDATE_SCREENSHOTS=1 regenerates the golden image",
        share * 100.0,
        PIXEL_TOLERANCE * 100.0,
        keep().display()
    );
}

/// The comparison can fail: a page with one proxy's phase changed is far from the golden view.
#[test]
fn the_screenshot_comparison_sees_a_changed_pixel_region() {
    let base = vec![255u8; 100 * 100 * 4];
    let mut changed = base.clone();
    // One 10x10 block (1 % of the pixels) turned black.
    for y in 0..10 {
        for x in 0..10 {
            let i = (y * 100 + x) * 4;
            changed[i..i + 3].copy_from_slice(&[0, 0, 0]);
        }
    }
    assert!(differing_share(&base, &changed) > PIXEL_TOLERANCE);
    // Anti-aliasing noise within the channel tolerance is not a difference.
    let noisy: Vec<u8> = base.iter().map(|v| v - CHANNEL_TOLERANCE).collect();
    assert_eq!(differing_share(&base, &noisy), 0.0);
}
