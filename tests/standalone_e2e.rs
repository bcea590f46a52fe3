//! Standalone mode end to end, as a user runs it: the real binary, real Squid processes through
//! the local provider, the discovery API over a socket. Healthy proxies, a lease, a fetch
//! through the leased proxy, a release; a removed manifest takes its Squid away; a restart
//! duplicates nothing and keeps the earlier state.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use support::{
    Origin, free_port,
    standalone::{self, Host, healthy_rows, metrics_when, squids, start_operator, status, stop, wait_status},
};

fn manifest(name: &str, port: u16, health_url: &str) -> String {
    standalone::manifest(
        name,
        port,
        health_url,
        &[("pool", "e2e")],
        &[("maxConcurrent", 1)],
    )
}

async fn api(host: &Host, method: &str, path: &str, body: &str) -> (StatusCode, serde_json::Value) {
    let token = std::fs::read_to_string(host.dir.path().join("state/discovery-tokens")).expect("token");
    let timeout = Duration::from_secs(30);
    match standalone::try_api(host.api_port, token.trim(), method, path, body, timeout).await {
        standalone::Answer::Got(status, body) => (status, body),
        other => panic!("{method} {path}: {other:?}"),
    }
}

/// GET `url` through the HTTP proxy at `proxy` (absolute-form request), with basic proxy
/// credentials `(user, password)` if given.
async fn fetch_through(proxy: &str, url: &str, credentials: Option<(&str, &str)>) -> (StatusCode, String) {
    use base64::Engine as _;
    let stream = tokio::net::TcpStream::connect(proxy)
        .await
        .expect("connect to proxy");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut request = Request::get(url).header("host", "127.0.0.1");
    if let Some((user, password)) = credentials {
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        request = request.header("proxy-authorization", format!("Basic {basic}"));
    }
    let request = request.body(Full::new(Bytes::new())).expect("request");
    let response = sender
        .send_request(request)
        .await
        .expect("response through the proxy");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Releases the lease of an acquire answer with outcome `ok`.
async fn release(host: &Host, lease: &serde_json::Value) -> (StatusCode, serde_json::Value) {
    let id = lease["leaseId"].as_str().expect("leaseId");
    let token = &lease["fencingToken"];
    api(
        host,
        "POST",
        &format!("/v1/leases/{id}/release"),
        &format!(r#"{{"fencingToken":{token},"outcome":"ok"}}"#),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_end_to_end_with_real_squid() {
    let origin = Origin::start().await;
    let host = Host::new();
    let root = host.dir.path();
    let health_url = origin.http_url("/health");
    let (port_a, port_b) = (free_port(), free_port());
    std::fs::write(root.join("manifests/a.yaml"), manifest("a", port_a, &health_url)).expect("a");
    std::fs::write(root.join("manifests/b.yaml"), manifest("b", port_b, &health_url)).expect("b");

    let operator = start_operator(&host, "operator-1.log");
    let table = wait_status(&host, "two healthy proxies", |t| healthy_rows(t) == 2).await;
    assert!(table.contains(&format!("127.0.0.1:{port_a}")), "{table}");
    assert_eq!(squids(root).len(), 2, "one Squid per proxy");

    // A crawler leases a proxy and fetches through it.
    let (code, lease) = api(
        &host,
        "POST",
        "/v1/leases",
        r#"{"selector":{"pool":"e2e"},"holder":"crawler-1","ttlSeconds":120}"#,
    )
    .await;
    assert_eq!(code, StatusCode::CREATED, "{lease}");
    let proxy_url = lease["proxyUrl"].as_str().expect("proxyUrl");
    let proxy = proxy_url.trim_start_matches("http://");
    let (code, body) = fetch_through(proxy, &origin.http_url("/ip"), None).await;
    assert_eq!(code, StatusCode::OK);
    assert!(
        body.contains("127.0.0.1"),
        "the origin saw the proxy's loopback address: {body}"
    );
    let (code, released) = release(&host, &lease).await;
    assert!(code.is_success(), "{code} {released}");

    // Removing a manifest takes its Squid away.
    std::fs::remove_file(root.join("manifests/b.yaml")).expect("rm");
    wait_status(&host, "b deleted", |t| {
        !t.lines().any(|l| l.split_whitespace().nth(1) == Some("b"))
    })
    .await;
    assert_eq!(squids(root).len(), 1, "b's Squid is gone");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port_b)).is_err(),
        "b's port is closed"
    );

    // Standalone mode exposes the same metrics as cluster mode, on the discovery API.
    let metrics = metrics_when(&host, "one healthy proxy left", |t| {
        t.lines().any(|l| l == r#"epo_proxies{phase="healthy"} 1"#)
    })
    .await;
    for line in [
        r#"epo_transitions_total{from="provisioning",to="healthy",reason="Healthy"} 2"#,
        r#"epo_transitions_total{from="deleting",to="deleted",reason="Deleted"} 1"#,
        r#"epo_provider_available{provider="local"} 1"#,
        r#"epo_discovery_leases_released_total{code="ok"} 1"#,
        "epo_discovery_leases_active 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "no {line} in:\n{metrics}");
    }
    for prefix in [
        r#"epo_reconciles_total{result="ok"} "#,
        r#"epo_probe_duration_seconds_count{result="ok"} "#,
    ] {
        assert!(
            metrics.lines().any(|l| l.starts_with(prefix)),
            "no {prefix} in:\n{metrics}"
        );
    }

    // Restart: nothing is duplicated and the earlier state is there.
    stop(operator);
    let before = status(&host);
    let operator = start_operator(&host, "operator-2.log");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !operator.log().contains("standalone mode running") {
        assert!(
            Instant::now() < deadline,
            "restart did not come up:\n{}",
            operator.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // After the restarted operator's first reconcile of `a` (its only proxy), counted by this
    // process's metrics: it adopted the running Squid instead of starting another.
    metrics_when(&host, "a reconcile by the restarted operator", |t| {
        t.lines()
            .any(|l| l.starts_with(r#"epo_reconciles_total{result="ok"} "#))
    })
    .await;
    assert_eq!(healthy_rows(&status(&host)), 1, "a is still healthy");
    assert_eq!(squids(root).len(), 1, "no Squid was started again");
    assert!(!operator.log().contains("started squid"), "{}", operator.log());
    assert_eq!(status(&host).lines().count(), before.lines().count());
    let audit = standalone::status_command(&host)
        .args(["--audit", "a"])
        .output()
        .expect("audit");
    let audit = String::from_utf8_lossy(&audit.stdout);
    assert!(
        audit.contains("provisioning --health_passed--> healthy"),
        "{audit}"
    );
    // A name the state folder never knew is an error that names the ones it knows.
    let unknown = standalone::status_command(&host)
        .args(["--audit", "nope"])
        .output()
        .expect("audit");
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(!unknown.status.success(), "{stderr}");
    assert!(
        stderr.contains("no proxy default/nope in") && stderr.contains("default/a"),
        "{stderr}"
    );

    // Clean up through the operator itself: no manifests, no Squids.
    std::fs::remove_file(root.join("manifests/a.yaml")).expect("rm");
    wait_status(&host, "everything deleted", |t| t.lines().count() == 1).await;
    assert!(squids(root).is_empty());
    stop(operator);
}

/// After a restart, a proxy is leasable only once this process has seen it pass a probe: a
/// Squid that died while the operator was down is never handed out (before, the checkpointed
/// "open" state leased it for the seconds until the first supervisor pass and probe). Prints the
/// time from start to "all verified".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_no_lease_is_handed_out_on_an_unverified_proxy() {
    let origin = Origin::start().await;
    let host = Host::new();
    let root = host.dir.path();
    let health_url = origin.http_url("/health");
    let ports = [free_port(), free_port()];
    for (name, port) in ["a", "b"].iter().zip(ports) {
        let yaml = standalone::manifest(
            name,
            port,
            &health_url,
            &[("pool", "verify"), ("name", name)],
            &[("maxConcurrent", 4)],
        );
        std::fs::write(root.join(format!("manifests/{name}.yaml")), yaml).expect("manifest");
    }
    let operator = start_operator(&host, "operator-1.log");
    wait_status(&host, "two healthy proxies", |t| healthy_rows(t) == 2).await;
    stop(operator);

    // b's Squid dies while the operator is down.
    let pids_before = squids(root);
    let b_pid = pids_before
        .iter()
        .copied()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("epo-default-b-"))
        })
        .expect("b's Squid");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(b_pid).expect("pid"),
        rustix::process::Signal::KILL,
    )
    .expect("kill b's Squid");

    let started = Instant::now();
    let operator = start_operator(&host, "operator-2.log");
    // Hammer acquire for b from the first moment the API answers: every lease granted must
    // point at a proxy that accepts connections.
    let mut granted = 0;
    let mut verified_after = None;
    while started.elapsed() < Duration::from_secs(12) {
        if std::net::TcpStream::connect(("127.0.0.1", host.api_port)).is_err() {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let (code, lease) = match tokio::time::timeout(
            Duration::from_secs(1),
            api(
                &host,
                "POST",
                "/v1/leases",
                r#"{"selector":{"name":"b"},"holder":"verify","ttlSeconds":30}"#,
            ),
        )
        .await
        {
            Ok(answer) => answer,
            Err(_) => continue,
        };
        if code == StatusCode::CREATED {
            granted += 1;
            verified_after.get_or_insert(started.elapsed());
            let endpoint = lease["proxy"]["endpoint"].as_str().expect("endpoint").to_owned();
            assert!(
                std::net::TcpStream::connect(&endpoint).is_ok(),
                "a lease on {endpoint} was handed out while nothing listens there: {lease}"
            );
            let (id, token) = (
                lease["leaseId"].as_str().expect("id"),
                lease["fencingToken"].clone(),
            );
            api(
                &host,
                "POST",
                &format!("/v1/leases/{id}/release"),
                &format!(r#"{{"fencingToken":{token},"outcome":"ok"}}"#),
            )
            .await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match verified_after {
        Some(after) => eprintln!(
            "standalone restart: b verified and leasable {:.1} s after start ({granted} leases)",
            after.as_secs_f64()
        ),
        None => eprintln!("standalone restart: b not leasable within 12 s (its Squid was dead)"),
    }
    stop(operator);
}

/// Rotating a proxy's credentials Secret reaches the running Squid in place: the new password
/// works, the old one gets 407, a lease held across the rotation is not revoked, and the API
/// hands out the new password only once Squid accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_credentials_reach_the_running_squid_without_a_replacement() {
    let origin = Origin::start().await;
    let host = Host::new();
    let root = host.dir.path();
    let port = free_port();
    let proxy = format!("127.0.0.1:{port}");
    let yaml = standalone::manifest(
        "c",
        port,
        &origin.http_url("/health"),
        &[("pool", "rotate")],
        &[("maxConcurrent", 4)],
    );
    std::fs::write(
        root.join("manifests/c.yaml"),
        standalone::with_auth(&yaml, "c-auth"),
    )
    .expect("manifest");
    let secret = root.join("manifests/c-auth.yaml");
    std::fs::write(
        &secret,
        standalone::credentials_secret("c-auth", "crawler", "old-password-1"),
    )
    .expect("secret");
    let operator = start_operator(&host, "operator.log");
    wait_status(&host, "c healthy", |t| healthy_rows(t) == 1).await;
    let squid_pids = squids(root);

    let (code, held) = api(
        &host,
        "POST",
        "/v1/leases",
        r#"{"selector":{"pool":"rotate"},"holder":"before","ttlSeconds":120}"#,
    )
    .await;
    assert_eq!(code, StatusCode::CREATED, "{held}");
    assert!(held["proxyUrl"].as_str().expect("url").contains("old-password-1"));
    let url = origin.http_url("/ip");
    assert_eq!(
        fetch_through(&proxy, &url, Some(("crawler", "old-password-1")))
            .await
            .0,
        StatusCode::OK
    );

    let rotated = Instant::now();
    std::fs::write(
        &secret,
        standalone::credentials_secret("c-auth", "crawler", "new-password-2"),
    )
    .expect("rotate");
    let deadline = rotated + Duration::from_secs(20);
    loop {
        // Until Squid accepts the new password, the API keeps handing out the old one.
        let (code, lease) = api(
            &host,
            "POST",
            "/v1/leases",
            r#"{"selector":{"pool":"rotate"},"holder":"during","ttlSeconds":30}"#,
        )
        .await;
        assert_eq!(code, StatusCode::CREATED, "{lease}");
        let handed = lease["proxyUrl"].as_str().expect("url").to_owned();
        let (id, token) = (
            lease["leaseId"].as_str().expect("id").to_owned(),
            lease["fencingToken"].clone(),
        );
        api(
            &host,
            "POST",
            &format!("/v1/leases/{id}/release"),
            &format!(r#"{{"fencingToken":{token},"outcome":"ok"}}"#),
        )
        .await;
        let password = if handed.contains("new-password-2") {
            "new-password-2"
        } else {
            "old-password-1"
        };
        assert_eq!(
            fetch_through(&proxy, &url, Some(("crawler", password))).await.0,
            StatusCode::OK,
            "the API handed out credentials Squid does not accept ({password})"
        );
        if password == "new-password-2" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new credentials never reached the API"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "credentials rotation: Secret change to new credentials accepted and handed out in {:.2} s",
        rotated.elapsed().as_secs_f64()
    );
    assert_eq!(
        fetch_through(&proxy, &url, Some(("crawler", "old-password-1")))
            .await
            .0,
        StatusCode::PROXY_AUTHENTICATION_REQUIRED,
        "the old password is refused"
    );
    assert_eq!(
        squids(root),
        squid_pids,
        "the same Squid serves on: nothing was replaced"
    );
    // The lease held across the rotation is still valid.
    let (code, renewed) = api(
        &host,
        "POST",
        &format!("/v1/leases/{}/renew", held["leaseId"].as_str().expect("id")),
        &format!(r#"{{"fencingToken":{}}}"#, held["fencingToken"]),
    )
    .await;
    assert_eq!(
        code,
        StatusCode::OK,
        "the lease held across the rotation was not revoked: {renewed}"
    );
    stop(operator);
}

/// Issue 24, as it was found: one Proxy whose first create is rejected because its port is
/// briefly taken (`--retry-initial 1 --retry-cap 3`); after the retry succeeds, the operator made
/// about 250 reconciles a second until the Proxy was Healthy (a past `nextAttemptTime` requeued
/// at 0 s). Here the instance then "boots" for 5 s (its health URL answers only after that), and
/// the operator's own `epo_reconciles_total` stays at a handful from the first create to Healthy.
#[tokio::test]
async fn a_create_rejected_once_then_booting_takes_a_handful_of_reconciles() {
    let host = Host::new();
    let port = free_port();
    let taken = std::net::TcpListener::bind(("127.0.0.1", port)).expect("take the port");
    // The health URL: nothing listens there until the instance has "booted".
    let health_port = free_port();
    host.add_manifest(
        "a",
        &manifest("a", port, &format!("http://127.0.0.1:{health_port}/health")),
    );
    let operator = standalone::start_operator_with(
        &host,
        "operator.log",
        &["--retry-initial", "1", "--retry-cap", "3"],
    );
    let key = egress_proxies_operator::api::ProxyKey::new("default", "a");
    let trail = || {
        egress_proxies_operator::standalone::store::Store::read_only(&host.path().join("state"))
            .ok()
            .and_then(|store| store.audit(&key).ok())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !trail().iter().any(|l| l.entry.reason == "CreateRejected") {
        assert!(Instant::now() < deadline, "the create was never rejected");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(taken);
    while !trail().iter().any(|l| l.entry.reason == "InstanceCreated") {
        assert!(Instant::now() < deadline, "the retry never created the instance");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Booting: probes fail for 5 s, then the health URL answers.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", health_port))
        .await
        .expect("health port");
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    .await;
            });
        }
    });
    while healthy_rows(&status(&host)) != 1 {
        assert!(
            Instant::now() < deadline,
            "never healthy: {}\n{}",
            status(&host),
            operator.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = metrics_when(&host, "reconciles", |m| m.contains("epo_reconciles_total{")).await;
    let reconciles: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("epo_reconciles_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    // The rejected create, the retry 3 s later, a poll, the health verdicts (failing, passing).
    assert!(
        reconciles <= 12.0,
        "{reconciles} reconciles from the first create to Healthy"
    );
    eprintln!("{reconciles} reconciles from the first create to Healthy");
    stop(operator);
}

/// Started with a soft open-file limit of 64 (the hard one far above, as a login shell's 1,024
/// is), the operator raises its own to the hard limit: 300 crawler connections held open at
/// once are all answered. Within 64 descriptors, accepts past the first few dozen failed
/// (EMFILE) and those connections waited unserved while the others stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_soft_open_file_limit_it_started_with_are_served() {
    const CONNECTIONS: usize = 300;
    const SOFT: u64 = 64;
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    assert!(
        hard.is_none_or(|hard| hard >= 1024),
        "this test needs a hard open-file limit of 1,024 or more: {hard:?}"
    );
    let host = Host::new();
    let mut command = standalone::operator_command(&host, &[]);
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
            let limit = rustix::process::Rlimit {
                current: Some(SOFT),
                maximum: hard,
            };
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).map_err(std::io::Error::from)
        });
    }
    let operator = support::process::GroupChild::spawn(&mut command, &host.path().join("operator.log"));
    let ready = Instant::now() + Duration::from_secs(30);
    let token = loop {
        if host.token_file().exists() {
            let token = host.token();
            let answer = standalone::try_api(
                host.api_port,
                &token,
                "GET",
                "/v1/proxies",
                "",
                Duration::from_secs(2),
            )
            .await;
            if matches!(answer, standalone::Answer::Got(StatusCode::OK, _)) {
                break token;
            }
        }
        assert!(
            Instant::now() < ready,
            "the API never answered:\n{}",
            operator.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", operator.pid().expect("running")))
        .expect("the operator's limits");
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("an open-file limit");
    let fields: Vec<&str> = open_files.split_whitespace().collect();
    assert_eq!(fields[3], fields[4], "soft raised to hard: {open_files}");

    // Every connection is opened (and held) before any is used.
    let mut streams = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        streams.push(
            tokio::net::TcpStream::connect(("127.0.0.1", host.api_port))
                .await
                .expect("connect"),
        );
    }
    let answers = futures::future::join_all(streams.into_iter().map(|stream| {
        let token = token.clone();
        async move {
            let exchange = async {
                let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .ok()?;
                tokio::spawn(conn);
                let request = Request::get("/v1/proxies")
                    .header("host", "127.0.0.1")
                    .header("authorization", format!("Bearer {token}"))
                    .body(Full::new(Bytes::new()))
                    .expect("request");
                let status = sender.send_request(request).await.ok()?.status();
                // The connection stays open (its sender is kept) until every answer is in.
                Some((status, sender))
            };
            tokio::time::timeout(Duration::from_secs(10), exchange)
                .await
                .ok()
                .flatten()
        }
    }))
    .await;
    let answered = answers
        .iter()
        .filter(|a| a.as_ref().is_some_and(|(status, _)| *status == StatusCode::OK))
        .count();
    assert_eq!(
        answered, CONNECTIONS,
        "connections answered 200 while all were open"
    );
    drop(answers);
    stop(operator);
}

/// A proxy whose health check fails says why in the log line of the change (it said only
/// `verdict=Failing`; the reason was on the status page alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_verdict_says_why_in_the_log() {
    let host = Host::new();
    let nothing_listens = format!("http://127.0.0.1:{}/health", free_port());
    let manifest = manifest("a", free_port(), &nothing_listens);
    std::fs::write(host.dir.path().join("manifests/a.yaml"), manifest).expect("a");
    let operator = start_operator(&host, "operator.log");
    let line = support::wait_until(Duration::from_secs(60), "the failing verdict", async || {
        let log = operator.log();
        log.lines()
            .find(|l| l.contains("health verdict changed") && l.contains("verdict=Failing"))
            .map(str::to_owned)
    })
    .await;
    // Squid answers for the origin it cannot reach.
    assert!(line.contains("last_error=") && line.contains("503"), "{line}");
    stop(operator);
}

/// A healthy proxy whose checks start failing says why in its audit trail (the Event's note in
/// cluster mode): the last probe's error, not only that a threshold was crossed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_health_check_says_why_in_the_audit_trail() {
    let origin = Origin::start().await;
    let host = Host::new();
    let port = free_port();
    let a = host.dir.path().join("manifests/a.yaml");
    std::fs::write(&a, manifest("a", port, &origin.http_url("/health"))).expect("a");
    let operator = start_operator(&host, "operator.log");
    wait_status(&host, "a healthy", |t| healthy_rows(t) == 1).await;
    // The health check now asks for a page the origin answers with 500.
    std::fs::write(&a, manifest("a", port, &origin.http_url("/status/500"))).expect("a");
    let failed = support::wait_until(
        Duration::from_secs(60),
        "the health_failed transition",
        async || {
            standalone::audit_lines(&host, "a")
                .into_iter()
                .find(|line| line["event"] == "health_failed")
        },
    )
    .await;
    let message = failed["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("the last probe") && message.contains("500"),
        "{failed}"
    );
    stop(operator);
}
