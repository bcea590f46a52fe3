//! The gateway end to end, as a crawler uses it: the real binary in standalone mode with
//! `--gateway-listen`, three real Squids through the local provider, each with its own
//! outgoing address (127.0.0.2-4) so the origin can tell which one a request came through, and
//! the real `curl` as the client.
//!
//! - a plain `curl -x http://HOLDER:TOKEN@gateway URL` fetch goes through a leased Squid (its
//!   access log has the URL) and leaves no lease behind;
//! - a session key sticks to one Squid; a target that answers 403 to that Squid bans it for the
//!   domain (`GET /v1/proxies` shows the ban) and the session moves to another;
//! - `CONNECT` (curl's `--proxytunnel`) splices a tunnel through a Squid;
//! - missing credentials, a bad token and a bad user name get 407/400 answers that say what to fix;
//! - a client that goes away mid-answer, and an idle session, leave no lease behind;
//! - a rules file (`--gateway-rules`): body and header rules ban and move a session, a Squid the
//!   target keeps refusing climbs the escalation ladder to a fresh instance, recycles stay
//!   within the pool's budget, a bad file is refused at start, reading ahead for a body
//!   pattern is bounded in time, politeness spaces requests or answers 429; in cluster mode a
//!   recycle is a patch of the Proxy's annotation;
//! - usage and quotas (`--quotas`): a token over its requests quota gets 429 `quota_exceeded`
//!   from the gateway and from acquires while releases still work, and `GET /v1/usage` and
//!   `/metrics` show what the token and the holder used, a lease that expires unreleased counts
//!   for its holder; a bad quotas file is refused at start;
//! - the gateway's leases are never journalled, and a clean restart restores none of them.

mod support;

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use egress_proxies_operator::api::ProxyKey;
use serde_json::Value;
use support::{
    free_port,
    process::GroupChild,
    standalone::{self, Answer, Host, audit_lines, healthy_rows, start_operator_with, try_api, wait_status},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// How long the origin takes to answer a `/delayed/...` path.
const DELAY: Duration = Duration::from_secs(1);

/// The outgoing address of each Squid, by proxy name.
const SQUIDS: [(&str, &str); 3] = [("a", "127.0.0.2"), ("b", "127.0.0.3"), ("c", "127.0.0.4")];

/// An origin on 127.0.0.1: `/health` is always 200; `/slow` sends its head and part of its
/// body, then waits; `/delayed/...` answers after [`DELAY`]; every other path answers 200 naming
/// the address it came from, or, when that address is one [`Origin::refuse`] named, refuses it: a
/// 200 page asking for a captcha (`/captcha...`: the word comes after 1 KiB, the page is
/// [`CAPTCHA_PAGE_BYTES`] long), a 200 with `X-Blocked: yes` (`/header...`), else a 403.
struct Origin {
    addr: SocketAddr,
    refused: Arc<Mutex<Vec<IpAddr>>>,
    seen: Arc<Mutex<Vec<(String, IpAddr)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Origin {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
        let addr = listener.local_addr().expect("origin address");
        let refused: Arc<Mutex<Vec<IpAddr>>> = Arc::default();
        let seen: Arc<Mutex<Vec<(String, IpAddr)>>> = Arc::default();
        let (refusing, seeing) = (refused.clone(), seen.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, peer)) = listener.accept().await {
                let (refusing, seeing) = (refusing.clone(), seeing.clone());
                tokio::spawn(serve_origin(stream, peer.ip(), refusing, seeing));
            }
        });
        Self {
            addr,
            refused,
            seen,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Refuses requests from `ip` from now on.
    fn refuse(&self, ip: IpAddr) {
        self.refused.lock().expect("not poisoned").push(ip);
    }

    /// Refuses no one from now on.
    fn welcome_all(&self) {
        self.refused.lock().expect("not poisoned").clear();
    }

    /// Every (path, address) it saw, in order.
    fn seen(&self) -> Vec<(String, IpAddr)> {
        self.seen.lock().expect("not poisoned").clone()
    }

    /// The addresses requests for `path` came from, in order.
    fn peers_of(&self, path: &str) -> Vec<IpAddr> {
        self.seen
            .lock()
            .expect("not poisoned")
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, ip)| *ip)
            .collect()
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_origin(
    mut stream: TcpStream,
    peer: IpAddr,
    refused: Arc<Mutex<Vec<IpAddr>>>,
    seen: Arc<Mutex<Vec<(String, IpAddr)>>>,
) {
    // Keep-alive: Squid may send several requests on one connection.
    loop {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return,
            }
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let path = head.split_whitespace().nth(1).unwrap_or("?").to_owned();
        if path != "/health" {
            seen.lock().expect("not poisoned").push((path.clone(), peer));
        }
        if path.starts_with("/delayed/") {
            // Long enough for the test to see the request in flight inside a Squid.
            tokio::time::sleep(DELAY).await;
        }
        if path == "/slow" {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\nfirst bytes")
                .await;
            tokio::time::sleep(Duration::from_secs(60)).await;
            return;
        }
        let refuse = path != "/health" && refused.lock().expect("not poisoned").contains(&peer);
        let (status, header, body) = match (refuse, path.as_str()) {
            (true, p) if p.starts_with("/captcha") => ("200 OK", "", captcha_page(peer)),
            (true, p) if p.starts_with("/header") => {
                ("200 OK", "X-Blocked: yes\r\n", format!("quietly blocked {peer}"))
            }
            (true, _) => ("403 Forbidden", "", format!("no entry for {peer}")),
            (false, _) => ("200 OK", "", format!("hello {path} from {peer}")),
        };
        let response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n{header}Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// How long the origin's captcha page is: longer than the gateway reads ahead, so its end
/// streams after the verdict.
const CAPTCHA_PAGE_BYTES: usize = 200 * 1024;

/// The page the origin asks `peer` for a captcha with: the word after 1 KiB of markup.
fn captcha_page(peer: IpAddr) -> String {
    let mut page = format!(
        "<html>{}<p>{peer}: please solve this captcha</p>",
        " ".repeat(1024)
    );
    let tail = CAPTCHA_PAGE_BYTES - page.len() - "</html>".len();
    page.push_str(&"x".repeat(tail));
    page.push_str("</html>");
    page
}

/// The operator with three healthy Squids and the gateway. Fields drop in order: the operator
/// first, so its supervisor restarts no Squid that the host's Drop then kills.
struct Setup {
    operator: GroupChild,
    host: Host,
    origin: Origin,
    gateway: u16,
}

impl Setup {
    async fn start(extra: &[&str]) -> Self {
        Self::start_with(None, 1, extra).await
    }

    /// [`Setup::start`] with `slots` concurrent leases per proxy and the gateway's rules from
    /// `rules` (YAML) when given.
    async fn start_with(rules: Option<&str>, slots: u32, extra: &[&str]) -> Self {
        Self::start_with_files(rules, slots, &[], extra).await
    }

    /// [`Setup::start_with`], writing each (name, text) of `files` into the operator's folder
    /// first.
    async fn start_with_files(
        rules: Option<&str>,
        slots: u32,
        files: &[(&str, &str)],
        extra: &[&str],
    ) -> Self {
        let origin = Origin::start().await;
        let host = Host::new();
        for (name, text) in files {
            std::fs::write(host.path().join(name), text).expect("a file for the operator");
        }
        if let Some(rules) = rules {
            std::fs::write(host.path().join("rules.yaml"), rules).expect("rules file");
        }
        for (name, outgoing) in SQUIDS {
            let manifest = standalone::manifest(
                name,
                free_port(),
                &origin.url("/health"),
                // `attr.squid=NAME` pins a request to one Squid.
                &[("pool", "gw"), ("squid", name)],
                &[("maxConcurrent", slots)],
            )
            .replace(
                "    address: 127.0.0.1\n",
                &format!("    address: 127.0.0.1\n    outgoingAddress: {outgoing}\n"),
            );
            host.add_manifest(name, &manifest);
        }
        let gateway = free_port();
        let listen = format!("127.0.0.1:{gateway}");
        let mut args = vec!["--gateway-listen", listen.as_str()];
        if rules.is_some() {
            args.extend_from_slice(&["--gateway-rules", "rules.yaml"]);
        }
        args.extend_from_slice(extra);
        let operator = start_operator_with(&host, "operator.log", &args);
        wait_status(&host, "three healthy proxies", |t| healthy_rows(t) == 3).await;
        Self {
            operator,
            host,
            origin,
            gateway,
        }
    }

    /// `curl` through the gateway as `user` with the discovery token as the password, plus
    /// `args`; returns (status code, body, the response headers).
    async fn curl(&self, user: &str, url: &str, args: &[&str]) -> (u16, String, String) {
        self.curl_with(&format!("{user}:{}", self.host.token()), url, args)
            .await
    }

    async fn curl_with(&self, credentials: &str, url: &str, args: &[&str]) -> (u16, String, String) {
        curl_through(self.host.path(), self.gateway, credentials, url, args).await
    }

    /// A discovery API GET.
    async fn api_get(&self, path: &str) -> Value {
        match try_api(
            self.host.api_port,
            &self.host.token(),
            "GET",
            path,
            "",
            Duration::from_secs(10),
        )
        .await
        {
            Answer::Got(status, body) if status.is_success() => body,
            other => panic!("GET {path}: {other:?}"),
        }
    }

    /// Active leases, as `GET /v1/leases` lists them.
    async fn leases(&self) -> Vec<Value> {
        self.api_get("/v1/leases")
            .await
            .get("leases")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    }

    /// Polls until no lease is active (within `within`).
    async fn no_leases_within(&self, within: Duration, what: &str) {
        let deadline = Instant::now() + within;
        loop {
            let leases = self.leases().await;
            if leases.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: leases still active after {within:?}: {leases:?}\n{}",
                self.operator.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Squid's access log of the proxy whose outgoing address is `ip`.
    fn access_log_of(&self, ip: IpAddr) -> String {
        let name = SQUIDS
            .iter()
            .find(|(_, out)| out.parse::<IpAddr>().ok() == Some(ip))
            .map(|(name, _)| *name)
            .expect("one of ours");
        let port = self.port_of(name);
        let (_, log) = self
            .host
            .access_logs()
            .into_iter()
            .find(|(listen, _)| listen.ends_with(&format!(":{port}")))
            .expect("the proxy's access log");
        std::fs::read_to_string(log).unwrap_or_default()
    }

    /// The port proxy `name` listens on, from its manifest.
    fn port_of(&self, name: &str) -> u16 {
        let manifest = std::fs::read_to_string(self.host.path().join(format!("manifests/{name}.yaml")))
            .expect("manifest");
        manifest
            .lines()
            .find_map(|l| l.trim().strip_prefix("port: "))
            .and_then(|p| p.parse().ok())
            .expect("a port")
    }

    /// Waits until the access log of `ip`'s Squid mentions `needle` (Squid writes it after
    /// the answer).
    async fn access_log_shows(&self, ip: IpAddr, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.access_log_of(ip);
            if log.contains(needle) {
                return log;
            }
            assert!(
                Instant::now() < deadline,
                "the access log of the Squid on {ip} never showed {needle}:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `curl` through the gateway on `gateway` with `credentials` (`user:password`), plus `args`;
/// returns (status code, body, the response headers). Scratch files go to `dir`.
async fn curl_through(
    dir: &std::path::Path,
    gateway: u16,
    credentials: &str,
    url: &str,
    args: &[&str],
) -> (u16, String, String) {
    let headers = dir.join(format!("headers-{}", fastrand_suffix()));
    let proxy = format!("http://127.0.0.1:{gateway}");
    let output = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "20", "-x", &proxy, "-U", credentials])
        .args([
            "-D",
            headers.to_str().expect("utf-8 path"),
            "-w",
            "\n%{http_code}",
        ])
        .args(args)
        .arg(url)
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("no_proxy")
        .env_remove("NO_PROXY")
        .output()
        .await
        .expect("curl runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let (body, code) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
    let code = code.trim().parse().unwrap_or_else(|_| {
        panic!(
            "curl gave no status: {stdout:?} {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    let head = std::fs::read_to_string(&headers).unwrap_or_default();
    (code, body.to_owned(), head)
}

/// Basic credentials, base64-encoded.
fn basic_credentials(pair: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(pair)
}

/// A unique file-name suffix.
fn fastrand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// The address the origin saw in a body `hello PATH from IP`.
/// Starts the operator on `host` with `args`, which must stop it at start with `expected` in
/// its log.
async fn refused_at_start(host: &Host, args: &[&str], expected: &str) {
    let mut operator = start_operator_with(host, "operator.log", args);
    let status = operator
        .exit_within(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("still running:\n{}", operator.log()));
    assert!(!status.success());
    let log = operator.log();
    assert!(log.contains(expected), "{log}");
}

/// The whole seconds of the `Retry-After` header in an answer's `head`.
fn retry_after_in(head: &str) -> u64 {
    head.lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("retry-after:")
                .map(|v| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no Retry-After: {head}"))
}

/// Reads from `stream` until what came so far, as text, is `done` (each read within 20 s);
/// returns it.
async fn read_until(stream: &mut TcpStream, done: impl Fn(&str) -> bool) -> String {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if done(&text) {
            return text;
        }
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("nothing more within 20 s after {text:?}"))
            .expect("read");
        assert!(n > 0, "closed early: {text}");
        got.extend_from_slice(&buf[..n]);
    }
}

fn from_ip(body: &str) -> IpAddr {
    body.rsplit(' ')
        .next()
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("not an origin answer: {body:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_fetches_through_a_leased_squid_and_leaves_no_lease() {
    let setup = Setup::start(&[]).await;
    let url = setup.origin.url("/plain");
    let (code, body, head) = setup.curl("crawler-1", &url, &[]).await;
    assert_eq!(code, 200, "{body}\n{head}");
    let ip = from_ip(&body);
    assert!(
        SQUIDS
            .iter()
            .any(|(_, out)| out.parse::<IpAddr>().ok() == Some(ip)),
        "the origin saw one of the Squids' outgoing addresses: {body}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("via: 1.1 egress-proxies-gateway"),
        "the gateway adds its Via: {head}"
    );
    // Squid logs the request once it is done ("text/plain" is in health-check lines too).
    setup.access_log_shows(ip, &format!("GET {url} ")).await;
    // A request without a session holds its lease only while it runs.
    setup
        .no_leases_within(Duration::from_secs(5), "after a plain fetch")
        .await;
}

/// Lease operations committed to the journal, from the metrics text.
fn journal_records(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("epo_lease_journal_records_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no journal record count in the metrics:\n{metrics}"))
}

/// A lease the gateway takes is held by this process's gateway alone: after a crash no client
/// could present it, and the gateway's own state (its sessions) is gone with the process, so
/// journalling it buys nothing (it only left a lease to expire after a crash) and cost two
/// fsync waits a request without a session: the gateway served a third of what it does without
/// durability. Gateway requests, with and without a session, commit no journal record; an API
/// acquire does (so the count this reads moves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_leases_are_not_journalled() {
    let setup = Setup::start(&[]).await;
    let url = setup.origin.url("/plain");
    let before = journal_records(
        &standalone::metrics_when(&setup.host, "the journal's record count", |t| {
            t.contains("epo_lease_journal_records_total ")
        })
        .await,
    );
    for user in [
        "crawler-j",
        "crawler-j",
        "crawler-j;session=j1",
        "crawler-j;session=j1",
    ] {
        let (code, body, head) = setup.curl(user, &url, &[]).await;
        assert_eq!(code, 200, "{user}: {body}\n{head}");
    }
    // A grant is committed before its request goes on, and a release without a session before
    // the answer's last bytes: whatever the gateway journalled is counted by now.
    let metrics = standalone::metrics_when(&setup.host, "the metrics", |_| true).await;
    assert_eq!(
        journal_records(&metrics),
        before,
        "gateway requests were journalled\n{}",
        setup.operator.log()
    );
    let (status, lease) = api_call(
        &setup,
        "POST",
        "/v1/leases",
        r#"{"holder":"api-client","ttlSeconds":60}"#,
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    standalone::metrics_when(&setup.host, "the API's acquire journalled", |t| {
        journal_records(t) > before
    })
    .await;

    // A clean stop gives the session's lease back before the last checkpoint: after a restart
    // the API's lease is still active and the gateway's is not.
    let holders = |leases: Vec<Value>| -> Vec<String> {
        (leases.iter())
            .filter_map(|l| l["holder"].as_str().map(str::to_owned))
            .collect()
    };
    let held = holders(setup.leases().await);
    assert!(
        held.iter().any(|h| h == "crawler-j"),
        "the session holds a lease: {held:?}"
    );
    let Setup {
        operator,
        host,
        origin,
        gateway,
    } = setup;
    standalone::stop(operator);
    let listen = format!("127.0.0.1:{gateway}");
    let operator = start_operator_with(&host, "operator-2.log", &["--gateway-listen", listen.as_str()]);
    let setup = Setup {
        operator,
        host,
        origin,
        gateway,
    };
    let leases = support::wait_until(
        Duration::from_secs(30),
        "the restarted API",
        async || match try_api(
            setup.host.api_port,
            &setup.host.token(),
            "GET",
            "/v1/leases",
            "",
            Duration::from_secs(2),
        )
        .await
        {
            Answer::Got(status, body) if status.is_success() => body["leases"].as_array().cloned(),
            _ => None,
        },
    )
    .await;
    assert_eq!(
        holders(leases),
        ["api-client"],
        "after a clean restart\n{}",
        setup.operator.log()
    );
}

/// A client that takes a lease and never gives it back still held it: when the lease expires,
/// its time (grant to expiry) counts in its holder's `leaseSeconds`. No token released it, so
/// no token's count moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_expires_unreleased_counts_for_its_holder() {
    let setup = Setup::start(&[]).await;
    let (status, lease) = api_call(
        &setup,
        "POST",
        "/v1/leases",
        r#"{"holder":"forgetful","ttlSeconds":1}"#,
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    let usage = support::wait_until(Duration::from_secs(15), "the expired lease counted", async || {
        let usage = setup.api_get("/v1/usage").await;
        let seconds =
            (usage["holders"].as_array()?.iter()).find(|h| h["holder"] == "forgetful")?["leaseSeconds"]
                .as_f64()?;
        (seconds > 0.0).then_some(usage)
    })
    .await;
    let holder = (usage["holders"].as_array().expect("holders").iter())
        .find(|h| h["holder"] == "forgetful")
        .expect("listed");
    assert_eq!(holder["leaseSeconds"].as_f64(), Some(1.0), "{usage}");
    assert_eq!(
        usage["tokens"][0]["leaseSeconds"].as_f64(),
        Some(0.0),
        "no token released it: {usage}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_one_squid_until_a_403_bans_it_for_the_domain() {
    let setup = Setup::start(&[]).await;
    let user = "crawler-2;session=s1";
    let url = setup.origin.url("/sticky");
    for _ in 0..5 {
        let (code, body, _) = setup.curl(user, &url, &[]).await;
        assert_eq!(code, 200, "{body}");
    }
    let peers = setup.origin.peers_of("/sticky");
    let first = peers[0];
    assert!(
        peers.iter().all(|ip| *ip == first),
        "one session, one Squid: {peers:?}"
    );
    // The session holds its lease between requests, and GET /v1/leases shows it.
    let leases = setup.leases().await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0]["sessionKey"], "s1", "{leases:?}");
    assert_eq!(leases[0]["holder"], "crawler-2", "{leases:?}");
    let banned_proxy = leases[0]["proxy"].as_str().expect("proxy").to_owned();

    // The target turns that Squid away: the answer reaches the client, the proxy is banned
    // for the domain, and the session's next request goes through another Squid.
    setup.origin.refuse(first);
    let (code, body, _) = setup.curl(user, &url, &[]).await;
    assert_eq!(code, 403, "{body}");
    let proxies = setup.api_get("/v1/proxies?targetDomain=127.0.0.1").await;
    let banned: Vec<&Value> = proxies["proxies"]
        .as_array()
        .expect("proxies")
        .iter()
        .filter(|p| p["availability"] == "banned")
        .collect();
    assert_eq!(banned.len(), 1, "{proxies}");
    assert_eq!(banned[0]["key"], banned_proxy.as_str(), "{proxies}");
    assert_eq!(banned[0]["bans"][0]["domain"], "127.0.0.1", "{proxies}");
    for _ in 0..3 {
        let (code, body, _) = setup.curl(user, &url, &[]).await;
        assert_eq!(code, 200, "{body}");
    }
    let after: Vec<IpAddr> = setup.origin.peers_of("/sticky")[6..].to_vec();
    assert!(
        after.iter().all(|ip| *ip == after[0] && *ip != first),
        "the session moved to one other Squid and stays there: {after:?} (banned: {first})"
    );
    let leases = setup.leases().await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_ne!(leases[0]["proxy"], banned_proxy.as_str(), "{leases:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_opens_a_tunnel_through_a_squid() {
    let setup = Setup::start(&[]).await;
    let url = setup.origin.url("/tunnelled");
    // --proxytunnel: curl sends CONNECT 127.0.0.1:PORT, then its request inside the tunnel.
    let (code, body, head) = setup.curl("crawler-3", &url, &["--proxytunnel"]).await;
    assert_eq!(code, 200, "{body}\n{head}");
    assert!(head.contains("200"), "the CONNECT was answered 200 first: {head}");
    let ip = from_ip(&body);
    // Squid logs a tunnel once it closes.
    setup
        .access_log_shows(ip, &format!("CONNECT {}", setup.origin.addr))
        .await;
    setup
        .no_leases_within(Duration::from_secs(5), "after the tunnel closed")
        .await;
}

/// What a client sends right behind its `CONNECT` (as a TLS client sends its hello) reaches
/// the target through the tunnel, and the tunnel's bytes are counted both ways, those included:
/// the relay hands the sockets to `splice(2)` and must first write what hyper already read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnels_first_bytes_sent_with_the_connect_arrive_and_are_counted() {
    let setup = Setup::start(&[]).await;
    let basic = basic_credentials(format!("crawler-3:{}", setup.host.token()).as_bytes());
    let target = setup.origin.addr;
    let inner = format!("GET /early HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let mut stream = TcpStream::connect(("127.0.0.1", setup.gateway))
        .await
        .expect("connect");
    stream
        .write_all(
            format!(
                "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {basic}\r\n\r\n{inner}"
            )
            .as_bytes(),
        )
        .await
        .expect("send the CONNECT and the request inside it in one write");
    let text = read_until(&mut stream, |text| {
        text.split_once("\r\n\r\n").is_some_and(|(_, tunnelled)| {
            tunnelled.contains("hello /early from ") && tunnelled.ends_with(|c: char| c.is_ascii_digit())
        })
    })
    .await;
    let (connect_head, tunnelled) = text.split_once("\r\n\r\n").expect("checked above");
    assert!(connect_head.starts_with("HTTP/1.1 200"), "{connect_head}");
    let (_, body) = tunnelled.split_once("\r\n\r\n").expect("the origin's head");
    let ip = from_ip(body);
    drop(stream);
    setup
        .no_leases_within(Duration::from_secs(5), "after the tunnel closed")
        .await;
    setup.access_log_shows(ip, &format!("CONNECT {target}")).await;

    let proxies = setup.api_get("/v1/proxies?targetDomain=127.0.0.1").await;
    let counted: Vec<&Value> = proxies["proxies"]
        .as_array()
        .expect("proxies")
        .iter()
        .flat_map(|p| p["outcomes"]["domains"].as_array().into_iter().flatten())
        .filter(|d| d["domain"] == "127.0.0.1")
        .map(|d| &d["stats"])
        .collect();
    assert_eq!(counted.len(), 1, "one proxy carried the tunnel: {proxies}");
    assert_eq!(counted[0]["successes"], 1, "{proxies}");
    assert_eq!(counted[0]["bytesSent"], inner.len(), "{proxies}");
    assert_eq!(counted[0]["bytesReceived"], tunnelled.len(), "{proxies}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_get_answers_that_say_what_to_fix() {
    let setup = Setup::start(&[]).await;
    let url = setup.origin.url("/refused");
    let token = setup.host.token();

    // No credentials: 407 with the challenge.
    let proxy = format!("http://127.0.0.1:{}", setup.gateway);
    let output = tokio::process::Command::new("curl")
        .args(["-sS", "-i", "--max-time", "20", "-x", &proxy, &url])
        .env_remove("http_proxy")
        .output()
        .await
        .expect("curl runs");
    let answer = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(answer.starts_with("HTTP/1.1 407"), "{answer}");
    assert!(
        answer.contains("proxy-authenticate: Basic realm=\"egress-proxies\""),
        "{answer}"
    );
    assert!(answer.contains("the password a discovery API token"), "{answer}");

    // A wrong token: 407.
    let (code, body, head) = setup.curl_with("crawler-4:not-a-token", &url, &[]).await;
    assert_eq!(code, 407, "{body}");
    assert!(body.contains("invalid token"), "{body}");
    assert!(head.contains("Basic realm=\"egress-proxies\""), "{head}");

    // A user name the gateway can't read: 400 naming the fix.
    let (code, body, _) = setup
        .curl_with(&format!("crawler-4;colour=red:{token}"), &url, &[])
        .await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("bad_user_name"), "{body}");
    assert!(
        body.contains("the options are session=KEY and attr.NAME=VALUE"),
        "{body}"
    );
    let (code, body, _) = setup.curl_with(&format!(":{token}"), &url, &[]).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("give the holder"), "{body}");

    // An origin-form request is no proxy request.
    let basic = basic_credentials(format!("crawler-4:{token}").as_bytes());
    let raw = exchange(
        setup.gateway,
        &format!(
            "GET /x HTTP/1.1\r\nHost: a\r\nProxy-Authorization: Basic {basic}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    assert!(raw.contains("absolute form"), "{raw}");
    // Also without proxy credentials (a browser pointed at the gateway's address): the hint,
    // not a login prompt that no password would get past.
    let raw = exchange(
        setup.gateway,
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    assert!(raw.contains("absolute form"), "{raw}");

    // Nothing reached the origin, and nothing is leased.
    assert!(setup.origin.peers_of("/refused").is_empty());
    assert!(setup.leases().await.is_empty());
}

/// Sends `request` (whole, ending the connection) to the gateway on `port` and reads the answer.
async fn exchange(port: u16, request: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.expect("read");
    raw
}

/// Sends `GET url` as `user` (password `token`) on a kept-alive connection and reads the answer
/// (its status and body, by its Content-Length).
async fn get_kept_alive(stream: &mut TcpStream, url: &str, user: &str, token: &str) -> (u16, String) {
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    let basic = basic_credentials(format!("{user}:{token}").as_bytes());
    stream
        .write_all(
            format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Basic {basic}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .expect("send");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut byte))
            .await
            .expect("the answer comes")
            .expect("read");
        assert_eq!(
            n,
            1,
            "the gateway closed the connection: {}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("a Content-Length");
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).await.expect("the body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A connection's credentials are checked once and remembered while the token file is
/// unchanged: a token the reloaded file no longer holds is refused on the connection that kept
/// sending it, and another user name on it is read anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connections_remembered_token_is_refused_once_the_file_drops_it() {
    let setup = Setup::start(&[]).await;
    let old = setup.host.token();
    let url = setup.origin.url("/kept");
    let mut kept = TcpStream::connect(("127.0.0.1", setup.gateway))
        .await
        .expect("connect");
    for _ in 0..3 {
        let (status, body) = get_kept_alive(&mut kept, &url, "crawler-9", &old).await;
        assert_eq!(status, 200, "{body}");
    }
    // Another user name on the same connection: parsed, not the remembered one.
    let (status, body) = get_kept_alive(&mut kept, &url, "crawler-9;colour=red", &old).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("bad_user_name"), "{body}");

    let file = setup.host.token_file();
    let staged = file.with_extension("new");
    std::fs::write(&staged, "a-new-token-for-this-test\n").expect("write the new tokens");
    std::fs::rename(&staged, &file).expect("replace the token file");
    // A new connection tells when the reload is in force; the kept one must agree from then on.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut fresh = TcpStream::connect(("127.0.0.1", setup.gateway))
            .await
            .expect("connect");
        if get_kept_alive(&mut fresh, &url, "crawler-9", &old).await.0 == 407 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the token file was not reloaded"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = get_kept_alive(&mut kept, &url, "crawler-9", &old).await;
    assert_eq!(status, 407, "{body}");
    assert!(body.contains("invalid token"), "{body}");
    let (status, body) = get_kept_alive(&mut kept, &url, "crawler-9", "a-new-token-for-this-test").await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_lease_outlives_its_client() {
    let setup = Setup::start(&["--gateway-session-idle-seconds", "1"]).await;
    let token = setup.host.token();

    // A client that reads the head of a long answer and goes away.
    let mut stream = TcpStream::connect(("127.0.0.1", setup.gateway))
        .await
        .expect("connect");
    let basic = basic_credentials(format!("crawler-5:{token}").as_bytes());
    let url = setup.origin.url("/slow");
    stream
        .write_all(
            format!(
                "GET {url} HTTP/1.1\r\nHost: {}\r\nProxy-Authorization: Basic {basic}\r\n\r\n",
                setup.origin.addr
            )
            .as_bytes(),
        )
        .await
        .expect("send");
    read_until(&mut stream, |text| text.contains("first bytes")).await;
    assert_eq!(setup.leases().await.len(), 1, "the slow answer holds its lease");
    drop(stream);
    setup
        .no_leases_within(Duration::from_secs(5), "after the client went away mid-answer")
        .await;

    // A session's lease outlives its requests by the idle bound (1 s), not more.
    let (code, body, _) = setup
        .curl("crawler-5;session=idle", &setup.origin.url("/once"), &[])
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(setup.leases().await.len(), 1, "the session keeps its lease");
    setup
        .no_leases_within(Duration::from_secs(5), "after the session went idle")
        .await;
}

/// Connects to the in-process gateway and sends `method url` as `user` (the token `tok`), with
/// no body and `Connection: close`; the answer is the caller's to read.
async fn send_request(gateway: SocketAddr, method: &str, url: &str, user: &str) -> TcpStream {
    let mut stream = TcpStream::connect(gateway).await.expect("connect");
    let basic = basic_credentials(format!("{user}:tok").as_bytes());
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    stream
        .write_all(
            format!(
                "{method} {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Basic {basic}\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("send");
    stream
}

/// One exchange with the gateway at `gateway` on a fresh connection: `method url` with
/// `user:tok` credentials; returns the raw answer.
async fn raw_request(gateway: SocketAddr, method: &str, url: &str, user: &str) -> String {
    let mut stream = send_request(gateway, method, url, user).await;
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_string(&mut raw))
        .await
        .expect("answered within 20 s")
        .expect("read");
    raw
}

mod in_process {
    //! The gateway in this process over a store of one strict-LRU shard (proxies chosen in
    //! the order given, first), the token `tok`.

    use std::{net::SocketAddr, sync::Arc};

    use egress_proxies_operator::{
        api::{LeasePolicy, ProxyKey},
        discovery::StaticTokens,
        gateway::{self, Gateway, GatewayConfig, GatewayDeps},
        lease::{Admission, LeaseStore, LeaseStoreConfig, LeaseTarget},
        outcomes::Outcomes,
        politeness::Politeness,
        provider::Endpoint,
        telemetry::admin::Readiness,
    };
    use tokio::net::TcpListener;

    /// The running gateway; stops when dropped.
    pub struct InProcess {
        pub store: LeaseStore,
        pub outcomes: Outcomes,
        pub addr: SocketAddr,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    /// The gateway over open proxies `crawl/NAME` on 127.0.0.1:PORT, one slot each.
    pub async fn start(proxies: &[(&str, u16)]) -> InProcess {
        start_with(proxies, GatewayConfig::default()).await
    }

    /// [`start`] with `config`.
    pub async fn start_with(proxies: &[(&str, u16)], config: GatewayConfig) -> InProcess {
        let store = LeaseStore::new(LeaseStoreConfig {
            shards: 1,
            ..LeaseStoreConfig::default()
        });
        for (name, port) in proxies {
            let key = ProxyKey::new("crawl", name);
            store.upsert_proxy(LeaseTarget {
                key: key.clone(),
                endpoint: Endpoint {
                    host: "127.0.0.1".into(),
                    port: *port,
                },
                attributes: Default::default(),
                policy: LeasePolicy {
                    max_concurrent: 1,
                    cooldown_seconds: 0,
                    max_ttl_seconds: 600,
                },
                credentials: None,
            });
            store.set_admission(&key, Admission::Open).expect("known proxy");
        }
        let (_ready, readiness) = tokio::sync::watch::channel(Readiness {
            caches_synced: true,
            leader: true,
            checkpoint_failing: false,
        });
        let outcomes = Outcomes::default();
        let deps = GatewayDeps {
            store: store.clone(),
            auth: Arc::new(StaticTokens::parse("tok\n")),
            readiness,
            health: None,
            recycle: None,
            outcomes: outcomes.clone(),
            usage: Default::default(),
            politeness: Politeness::new(config.rules.politeness.clone()),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(gateway::serve(listener, Gateway::new(deps, config), async move {
            let _ = stopped.await;
        }));
        InProcess {
            store,
            outcomes,
            addr,
            _stop: stop,
        }
    }
}

/// A session's lease on a proxy that starts draining (its deletion or replacement waits for
/// it) is given back by the next upkeep while no request uses it, not when the session goes
/// idle or the lease expires (here both an hour away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unused_sessions_lease_on_a_draining_proxy_is_given_back() {
    use egress_proxies_operator::{gateway::GatewayConfig, lease::DrainStatus};
    let origin = support::Origin::start().await;
    let squid = support::Squid::start().await;
    let config = GatewayConfig {
        session_idle: Duration::from_secs(3600),
        lease_ttl: Duration::from_secs(3600),
        ..GatewayConfig::default()
    };
    let gateway = in_process::start_with(&[("a", squid.port)], config).await;
    let answer = raw_request(
        gateway.addr,
        "GET",
        &origin.http_url("/ip"),
        "crawler-1;session=s1",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let key = ProxyKey::new("crawl", "a");
    assert_eq!(gateway.store.drain(&key), DrainStatus::Pending { active: 1 });
    support::wait_until(
        Duration::from_secs(10),
        "the session's lease given back",
        async || (gateway.store.drain(&key) == DrainStatus::Drained).then_some(()),
    )
    .await;
}

/// A dead upstream (its port refuses connections): a GET is retried once on another proxy, a
/// POST is not and gets a 502 naming the proxy and the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_is_retried_once_on_another_proxy_when_the_first_is_dead() {
    let origin = Origin::start().await;
    let squid = support::Squid::start().await;
    let gateway = in_process::start(&[("dead", free_port()), ("live", squid.port)]).await;
    let (store, addr) = (&gateway.store, gateway.addr);

    // Whichever proxy the first GET takes, the dead one is the least recently used one for
    // the other: without the retry one of the two would fail.
    for _ in 0..2 {
        // The last answer's lease is back before the answer's last bytes are sent: the live
        // proxy is free again at once.
        assert_eq!(store.active_total(), 0);
        let answer = raw_request(addr, "GET", &origin.url("/retried"), "crawler-6").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("hello /retried from 127.0.0.1"), "{answer}");
    }
    assert_eq!(origin.peers_of("/retried").len(), 2);
    let log = squid.dir().join("access.log");
    support::eventually(Duration::from_secs(10), "the live Squid logs both GETs", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("/retried")
            .count()
            == 2
    })
    .await;

    // The dead proxy is the least recently used again: a POST goes there and is not retried.
    assert_eq!(store.active_total(), 0);
    let answer = raw_request(addr, "POST", &origin.url("/posted"), "crawler-6").await;
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(answer.contains("upstream_failed"), "{answer}");
    assert!(
        answer.contains("crawl/dead") && answer.contains("Connection refused"),
        "the answer names the proxy and the cause: {answer}"
    );
    assert!(origin.peers_of("/posted").is_empty());
    assert_eq!(store.active_total(), 0);

    // The statistics: connection failures on the dead proxy (the POST's, and the first try of
    // one GET or both), two answers through the live one, each with its latency and bytes.
    let domain = "127.0.0.1";
    let dead = (gateway.outcomes)
        .pair(&ProxyKey::new("crawl", "dead"), domain)
        .expect("the dead proxy's failures are recorded");
    assert!((2..=3).contains(&dead.failures.connect), "{dead:?}");
    assert_eq!(
        (dead.requests, dead.successes),
        (dead.failures.connect, 0),
        "{dead:?}"
    );
    let live = (gateway.outcomes)
        .pair(&ProxyKey::new("crawl", "live"), domain)
        .expect("the live proxy's answers are recorded");
    assert_eq!((live.requests, live.successes), (2, 2), "{live:?}");
    assert_eq!(live.latency.map(|l| l.samples), Some(2), "{live:?}");
    assert_eq!(
        live.bytes_received,
        2 * "hello /retried from 127.0.0.1".len() as u64
    );

    // A CONNECT the dead proxy refuses is sent again through the live one too: two tunnels,
    // whichever proxy each is offered first, both reach the origin.
    let scratch = tempfile::tempdir().expect("scratch folder");
    for n in 0..2 {
        let url = origin.url(&format!("/tunnelled-{n}"));
        let credentials = "crawler-6:tok";
        let (code, body, head) =
            curl_through(scratch.path(), addr.port(), credentials, &url, &["--proxytunnel"]).await;
        assert_eq!(code, 200, "{body}\n{head}");
        assert!(body.starts_with(&format!("hello /tunnelled-{n} from")), "{body}");
    }
    support::wait_until(Duration::from_secs(10), "both tunnels counted", async || {
        let live = (gateway.outcomes).pair(&ProxyKey::new("crawl", "live"), domain)?;
        (live.successes == 4).then_some(())
    })
    .await;
    assert_eq!(store.active_total(), 0);
}

/// One request a crawler of [`killing_an_upstream_squid_mid_crawl`] made.
#[derive(Clone, Debug)]
struct Fetch {
    tunnel: bool,
    path: String,
    code: u16,
    body: String,
    started: Instant,
    took: Duration,
}

/// Reliability: plain GETs and CONNECT tunnels run through the gateway concurrently while one
/// upstream Squid is SIGKILLed with a GET inside it. No client waits past a bound; every GET
/// succeeds (the one inside the dead Squid through another, sent again by the gateway); only
/// tunnels that were open through the dead Squid may fail; the statistics hold the failures
/// against the killed proxy and none against the others; and once the clients stop, no lease
/// is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_an_upstream_squid_mid_crawl() {
    const GETTERS: usize = 4;
    const TUNNELLERS: usize = 2;
    // curl gives up after 20 s (`curl_through`); an answer takes DELAY, a retry twice that.
    const BOUND: Duration = Duration::from_secs(10);
    let setup = Setup::start_with(None, 4, &["--gateway-session-idle-seconds", "1"]).await;
    let killed_ip: IpAddr = "127.0.0.2".parse().expect("an address");

    let done: Arc<Mutex<Vec<Fetch>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut crawlers = Vec::new();
    for worker in 0..GETTERS + TUNNELLERS {
        let tunnel = worker >= GETTERS;
        let (done, stop) = (done.clone(), stop.clone());
        let dir = setup.host.path().to_owned();
        let (gateway, origin) = (setup.gateway, setup.origin.addr);
        let credentials = format!("crawler-{worker}:{}", setup.host.token());
        crawlers.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                let kind = if tunnel { "tunnel" } else { "get" };
                let path = format!("/delayed/{kind}-{worker}-{n}");
                let url = format!("http://{origin}{path}");
                let args: &[&str] = if tunnel { &["--proxytunnel"] } else { &[] };
                let started = Instant::now();
                let (code, body, _) = curl_through(&dir, gateway, &credentials, &url, args).await;
                let took = started.elapsed();
                done.lock().expect("not poisoned").push(Fetch {
                    tunnel,
                    path,
                    code,
                    body,
                    started,
                    took,
                });
                n += 1;
            }
        }));
    }
    let finished = |done: &Arc<Mutex<Vec<Fetch>>>| done.lock().expect("not poisoned").clone();

    // Kill Squid `a` while a GET is inside it: the origin saw the GET come from `a` and no
    // client has its answer yet.
    let in_flight = support::wait_until(Duration::from_secs(30), "a GET in flight through a", async || {
        let answered: Vec<String> = finished(&done).into_iter().map(|f| f.path).collect();
        (setup.origin.seen().into_iter())
            .find(|(path, ip)| *ip == killed_ip && path.contains("/get-") && !answered.contains(path))
            .map(|(path, _)| path)
    })
    .await;
    let port = setup.port_of("a");
    let (_, log) = (setup.host.access_logs().into_iter())
        .find(|(listen, _)| listen.ends_with(&format!(":{port}")))
        .expect("a's instance folder");
    let instance = log
        .parent()
        .and_then(|run| run.parent())
        .expect("the instance folder");
    let pids = standalone::squids(instance);
    assert!(!pids.is_empty(), "a's Squid runs");
    for pid in &pids {
        let killed = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(killed.success(), "SIGKILL to {pid}");
    }
    let killed_at = Instant::now();

    // The crawl goes on until every crawler made four more requests after the kill.
    support::wait_until(
        Duration::from_secs(60),
        "four requests per crawler after the kill",
        async || {
            let after = finished(&done);
            // Paths are /delayed/KIND-WORKER-N.
            let per_worker = |w: usize| {
                (after.iter())
                    .filter(|f| f.started > killed_at && f.path.split('-').nth(1) == Some(&w.to_string()))
                    .count()
            };
            (0..GETTERS + TUNNELLERS)
                .all(|w| per_worker(w) >= 4)
                .then_some(())
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Release);
    for crawler in crawlers {
        tokio::time::timeout(2 * BOUND, crawler)
            .await
            .expect("every crawler stops: no request hangs")
            .expect("the crawler did not panic");
    }
    let fetches = finished(&done);

    // No client waited past the bound.
    for fetch in &fetches {
        assert!(
            fetch.took < BOUND,
            "{fetch:?} took too long
{}",
            setup.operator.log()
        );
    }
    // Every GET succeeded, the one inside the dead Squid through another.
    for fetch in fetches.iter().filter(|f| !f.tunnel) {
        assert_eq!(
            fetch.code,
            200,
            "{fetch:?}
{}",
            setup.operator.log()
        );
        assert!(
            fetch.body.starts_with(&format!("hello {} from ", fetch.path)),
            "{fetch:?}"
        );
    }
    let rescued = (fetches.iter())
        .find(|f| f.path == in_flight)
        .expect("the GET in flight finished");
    assert_ne!(
        from_ip(&rescued.body),
        killed_ip,
        "sent again through another Squid: {rescued:?}"
    );
    // Only tunnels open through `a` when it died may have failed.
    let broken: Vec<&Fetch> = (fetches.iter())
        .filter(|f| f.tunnel && (f.code != 200 || !f.body.starts_with(&format!("hello {} from ", f.path))))
        .collect();
    assert!(broken.len() <= TUNNELLERS, "{broken:?}");
    assert!(broken.iter().all(|f| f.started < killed_at), "{broken:?}");

    // The statistics: failures against `a` only; every successful request counted once (a
    // tunnel the dead Squid closed may count as a success: the gateway sees no more of it).
    let succeeded = (fetches.len() - broken.len()) as u64;
    let by_name = support::wait_until(Duration::from_secs(10), "every request counted", async || {
        let listed = setup.api_get("/v1/proxies").await;
        let by_name: HashMap<String, Value> = (listed["proxies"].as_array().into_iter().flatten())
            .map(|p| {
                (
                    p["name"].as_str().unwrap_or_default().to_owned(),
                    p["outcomes"]["total"].clone(),
                )
            })
            .collect();
        let successes: u64 = by_name.values().filter_map(|t| t["successes"].as_u64()).sum();
        (successes >= succeeded).then_some(by_name)
    })
    .await;
    let failures = |name: &str| -> u64 {
        let failures = &by_name[name]["failures"];
        [
            "connect",
            "timeout",
            "reset",
            "proxyError",
            "clientError",
            "serverError",
        ]
        .iter()
        .filter_map(|kind| failures[kind].as_u64())
        .sum()
    };
    assert!(failures("a") >= 1, "{by_name:?}");
    assert_eq!((failures("b"), failures("c")), (0, 0), "{by_name:?}");
    let successes: u64 = by_name.values().filter_map(|t| t["successes"].as_u64()).sum();
    assert!(
        successes <= succeeded + TUNNELLERS as u64,
        "{successes} {by_name:?}"
    );
    let key = (setup.api_get("/v1/proxies").await["proxies"]
        .as_array()
        .into_iter()
        .flatten())
    .find(|p| p["name"] == "a")
    .and_then(|p| p["key"].as_str().map(str::to_owned))
    .expect("a is listed");
    let prefix = format!("epo_outcomes_requests_total{{proxy=\"{key}\",result=\"");
    standalone::metrics_when(&setup.host, "a's failures", |text| {
        (text.lines())
            .filter(|l| l.starts_with(&prefix) && !l.contains("result=\"success\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
            >= 1.0
    })
    .await;

    // No lease outlives the crawl.
    setup
        .no_leases_within(Duration::from_secs(10), "after the crawl")
        .await;
}

/// Python's `requests` and Scrapy's own `HttpProxyMiddleware` use the gateway unchanged: the
/// proxy URL with `HOLDER;session=KEY` as the user and the token as the password. Debian's
/// `python3-scrapy` and `python3-requests` (scripts/lib/install.sh), as tests/python_client.rs
/// uses them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_and_scrapy_use_it_unchanged() {
    let setup = Setup::start(&[]).await;
    let proxy = |session: &str| {
        format!(
            "http://crawler-7;session={session}:{}@127.0.0.1:{}",
            setup.host.token(),
            setup.gateway
        )
    };
    let script = setup.host.path().join("clients.py");
    std::fs::write(
        &script,
        r#"
import sys
import requests
import scrapy
from scrapy.crawler import CrawlerProcess

requests_proxy, scrapy_proxy, origin = sys.argv[1:4]
for _ in range(3):
    answer = requests.get(origin + "/py-requests", proxies={"http": requests_proxy}, timeout=20)
    print("requests", answer.status_code, answer.text)

class Through(scrapy.Spider):
    name = "through"

    def start_requests(self):
        for _ in range(3):
            yield scrapy.Request(origin + "/py-scrapy", meta={"proxy": scrapy_proxy}, dont_filter=True)

    def parse(self, response):
        print("scrapy", response.status, response.text, flush=True)

process = CrawlerProcess({"LOG_LEVEL": "ERROR", "CONCURRENT_REQUESTS": 1, "TELNETCONSOLE_ENABLED": False})
process.crawl(Through)
process.start()
"#,
    )
    .expect("script");
    let python = std::env::var("EPO_PYTHON").unwrap_or_else(|_| "/usr/bin/python3".to_owned());
    let output = tokio::process::Command::new(python)
        .arg(&script)
        .args([proxy("r1"), proxy("s1"), setup.origin.url("")])
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .output()
        .await
        .expect("python runs (apt-get install python3-scrapy python3-requests)");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for client in ["requests", "scrapy"] {
        let answers: Vec<&str> = stdout.lines().filter(|l| l.starts_with(client)).collect();
        assert_eq!(answers.len(), 3, "{stdout}\n{stderr}");
        assert!(
            answers
                .iter()
                .all(|a| a.starts_with(&format!("{client} 200 hello"))),
            "{stdout}"
        );
        let peers = setup.origin.peers_of(&format!("/py-{client}"));
        assert_eq!(peers.len(), 3, "{peers:?}");
        assert!(
            peers.iter().all(|ip| *ip == peers[0]),
            "{client}: one session, one Squid: {peers:?}"
        );
    }
    let holders: Vec<Value> = setup.leases().await.iter().map(|l| l["holder"].clone()).collect();
    assert_eq!(
        holders,
        ["crawler-7", "crawler-7"],
        "two sessions hold a lease each"
    );
}

/// Our Scrapy middleware in its gateway form (`egress_proxies.scrapy_gateway`, no lease calls):
/// every request goes through the gateway with the holder and the selector in the proxy user
/// name; a target that refuses one Squid gets that Squid banned by the gateway, and the
/// middleware sends the refused page again, which the gateway routes through another Squid:
/// every page arrives, one retry, no lease left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrapy_gateway_middleware_sends_a_banned_page_again_through_another_squid() {
    let setup = Setup::start(&[]).await;
    let refused: IpAddr = SQUIDS[0].1.parse().expect("address");
    setup.origin.refuse(refused);
    let script = setup.host.path().join("gateway_crawl.py");
    std::fs::write(
        &script,
        r#"
import sys
import scrapy
from scrapy.crawler import CrawlerProcess

gateway, token, origin = sys.argv[1:4]

class Pages(scrapy.Spider):
    name = "pages"

    def start_requests(self):
        for n in range(6):
            yield scrapy.Request(f"{origin}/mw-{n}")

    def parse(self, response):
        print("page", response.status, response.text, flush=True)

    def closed(self, reason):
        stats = self.crawler.stats.get_stats()
        for key in ("egress_gateway/routed", "egress_gateway/ban_retries"):
            print("stat", key, stats.get(key, 0), flush=True)

process = CrawlerProcess({
    "LOG_LEVEL": "ERROR",
    "CONCURRENT_REQUESTS": 1,
    "TELNETCONSOLE_ENABLED": False,
    "DOWNLOADER_MIDDLEWARES": {"egress_proxies.scrapy_gateway.EgressGatewayMiddleware": 740},
    "EGRESS_PROXIES_GATEWAY": gateway,
    "EGRESS_PROXIES_TOKEN": token,
    "EGRESS_PROXIES_SELECTOR": {"pool": "gw"},
})
process.crawl(Pages)
process.start()
"#,
    )
    .expect("script");
    let python = std::env::var("EPO_PYTHON").unwrap_or_else(|_| "/usr/bin/python3".to_owned());
    let package = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/python/src");
    let output = tokio::process::Command::new(python)
        .arg(&script)
        .args([
            format!("http://127.0.0.1:{}", setup.gateway),
            setup.host.token(),
            setup.origin.url(""),
        ])
        .env("PYTHONPATH", package)
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .output()
        .await
        .expect("python runs (apt-get install python3-scrapy)");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let pages: Vec<&str> = stdout.lines().filter(|l| l.starts_with("page ")).collect();
    assert_eq!(pages.len(), 6, "{stdout}\n{stderr}");
    for page in &pages {
        assert!(page.starts_with("page 200 hello /mw-"), "{stdout}");
        assert_ne!(from_ip(page), refused, "{stdout}");
    }
    assert!(stdout.contains("stat egress_gateway/ban_retries 1\n"), "{stdout}");
    assert!(stdout.contains("stat egress_gateway/routed 7\n"), "{stdout}");
    let through_refused: usize = (0..6)
        .map(|n| {
            setup
                .origin
                .peers_of(&format!("/mw-{n}"))
                .iter()
                .filter(|ip| **ip == refused)
                .count()
        })
        .sum();
    assert_eq!(
        through_refused, 1,
        "the banned Squid got one request, and no more"
    );
    setup
        .no_leases_within(Duration::from_secs(10), "after the crawl")
        .await;
}

mod cluster {
    //! Cluster mode with the gateway: a real kube-apiserver, one Proxy `crawl/squid-1` of the
    //! `local` provider, the whole mode in this process.

    use std::time::Duration;

    use egress_proxies_operator::{api::Proxy, gateway::rules::Rules};
    use kube::{Api, Client, api::PostParams};

    use super::{Origin, free_port};
    use crate::support::{
        cluster_app::{ClusterApp, local_cluster, local_proxy},
        control_plane::ControlPlane,
        process::KillSquidsUnder,
    };

    /// The running mode; fields drop in order (the operator before the Squids it supervises).
    pub struct ClusterGateway {
        pub operator: ClusterApp,
        pub proxies: Api<Proxy>,
        pub dir: tempfile::TempDir,
        pub gateway: u16,
        pub discovery: u16,
        pub token: &'static str,
        _squids: KillSquidsUnder,
        _plane: ControlPlane,
    }

    /// Starts it with the gateway's `rules`; `squid-1` is probed through `origin`'s `/health`.
    pub async fn start(origin: &Origin, rules: Rules) -> ClusterGateway {
        let plane = ControlPlane::start().await;
        let operator_client = plane.install_default().await;
        plane.create_namespace("crawl").await;
        let client: Client = plane.client().await;
        let dir = tempfile::tempdir().expect("temp dir");
        let squids = KillSquidsUnder(dir.path().to_owned());
        let token = "gateway-token-0123456789abcdef";
        let (admin, discovery, gateway, proxy_port) = (free_port(), free_port(), free_port(), free_port());
        let mut options = local_cluster(
            dir.path(),
            &dir.path().join("local"),
            token,
            ([127, 0, 0, 1], admin).into(),
            ([127, 0, 0, 1], discovery).into(),
        );
        options.gateway.listen = Some(([127, 0, 0, 1], gateway).into());
        options.gateway.rules = rules;
        let operator = ClusterApp::start(operator_client, options);
        let proxies: Api<Proxy> = Api::namespaced(client, "crawl");
        let proxy = local_proxy(
            "squid-1",
            proxy_port,
            &origin.url("/health"),
            2,
            serde_json::json!({}),
        );
        proxies
            .create(&PostParams::default(), &proxy)
            .await
            .expect("created");
        ClusterGateway {
            operator,
            proxies,
            dir,
            gateway,
            discovery,
            token,
            _squids: squids,
            _plane: plane,
        }
    }

    impl ClusterGateway {
        /// `curl` through the gateway as `holder`.
        pub async fn curl(&self, holder: &str, url: &str) -> (u16, String, String) {
            let credentials = format!("{holder}:{}", self.token);
            super::curl_through(self.dir.path(), self.gateway, &credentials, url, &[]).await
        }

        /// Waits (90 s at most) until the gateway forwards a request for `url` with a 2xx-4xx
        /// answer of the target's (503 `not_ready` until the replica leads and the Proxy is
        /// open for leases, which may be before its status says healthy); returns it.
        pub async fn first_answer(&self, holder: &str, url: &str) -> (u16, String) {
            crate::support::wait_until(Duration::from_secs(90), "the gateway forwards", async || {
                let (code, body, _) = self.curl(holder, url).await;
                (code != 503).then_some((code, body))
            })
            .await
        }
    }
}

/// Cluster mode serves the gateway too (the same core): against a real kube-apiserver, with a
/// Proxy object of the `local` provider, `curl -x` through the gateway reaches the origin
/// through that Squid once the replica leads, and leaves no lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_mode_serves_the_gateway_too() {
    use support::wait_until;

    let origin = Origin::start().await;
    let running = cluster::start(&origin, Default::default()).await;
    let (code, body) = running.first_answer("crawler-8", &origin.url("/cluster")).await;
    assert_eq!((code, body.as_str()), (200, "hello /cluster from 127.0.0.1"));
    let leases = wait_until(Duration::from_secs(10), "no lease left", async || match try_api(
        running.discovery,
        running.token,
        "GET",
        "/v1/leases",
        "",
        Duration::from_secs(10),
    )
    .await
    {
        Answer::Got(status, body) if status.is_success() && body["leases"] == serde_json::json!([]) => {
            Some(body)
        }
        _ => None,
    })
    .await;
    assert_eq!(leases["leases"], serde_json::json!([]));
    running.operator.stop().await;
}

/// In cluster mode a rule's recycle is a merge patch of the Proxy's recycle annotation: the
/// controller sees it, the lifecycle replaces the instance, `status.lastRecycle` keeps the
/// request (it names the rule) and the `Recycled` Event says who asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_mode_recycles_through_the_proxys_annotation() {
    use egress_proxies_operator::{api::RECYCLE_ANNOTATION, gateway::rules::Rules};
    use kube::Api;
    use support::wait_until;

    let origin = Origin::start().await;
    let rules = Rules::parse(
        "rules:\n  - name: burnt\n    retry: false\n    match: {status: [403]}\n    escalation: [{after: 1, action: recycle}]\n",
        "rules.yaml",
    )
    .expect("valid rules");
    let running = cluster::start(&origin, rules).await;
    let (code, body) = running.first_answer("crawler-8", &origin.url("/before")).await;
    assert_eq!((code, body.as_str()), (200, "hello /before from 127.0.0.1"));
    // The gateway may forward before the status says healthy (leases open in the round that
    // writes it), so the recycle below can race that status write: the replacement follows
    // either way (tests/controller.rs a_recycle_asked_as_leases_open_...).
    origin.refuse("127.0.0.1".parse().expect("an address"));
    let (code, body, _) = running.curl("crawler-8", &origin.url("/refused")).await;
    assert_eq!((code, body.as_str()), (403, "no entry for 127.0.0.1"));

    let proxy = wait_until(Duration::from_secs(60), "the recycle acted on", async || {
        let proxy = running.proxies.get("squid-1").await.ok()?;
        let status = proxy.status.as_ref()?;
        (status.last_recycle.is_some() && status.phase.as_deref() == Some("healthy")).then_some(proxy)
    })
    .await;
    let request = proxy
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RECYCLE_ANNOTATION))
        .cloned()
        .expect("the gateway set the annotation");
    assert!(request.starts_with("gateway rule burnt "), "{request}");
    let status = proxy.status.expect("status");
    assert_eq!(status.last_recycle.as_deref(), Some(request.as_str()));
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(running.proxies.clone().into_client(), "crawl");
    let notes: Vec<String> = events
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Recycled"))
        .filter_map(|e| e.note)
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains(&format!("recycle requested: {request}"))),
        "{notes:?}"
    );
    origin.welcome_all();
    let (code, _, _) = running.curl("crawler-8", &origin.url("/after")).await;
    assert_eq!(code, 200);
    running.operator.stop().await;
}

/// A 403 the upstream Squid made itself (its access rules deny the path; it marks the page
/// with `X-Squid-Error`) is the proxy's answer and bans nothing; a 403 from the target bans
/// the proxy for the target's domain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_targets_403_bans() {
    let origin = Origin::start().await;
    let squid = support::Squid::start().await;
    let gateway = in_process::start(&[("only", squid.port)]).await;
    let banned = || {
        let store = &gateway.store;
        let all = store.compile(&Default::default());
        store
            .list_for(&all, Some("127.0.0.1"), store.now_ms())
            .iter()
            .any(|view| !view.bans.is_empty())
    };

    // support::Squid denies paths starting with /forbidden.
    let answer = raw_request(gateway.addr, "GET", &origin.url("/forbidden"), "crawler-9").await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("x-squid-error"), "{answer}");
    assert!(!banned(), "Squid's own refusal banned the proxy");
    assert!(origin.peers_of("/forbidden").is_empty());

    origin.refuse("127.0.0.1".parse().expect("an address"));
    let answer = raw_request(gateway.addr, "GET", &origin.url("/refused"), "crawler-9").await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("no entry for 127.0.0.1"), "{answer}");
    assert!(banned(), "the target's refusal bans the proxy for 127.0.0.1");
    assert_eq!(gateway.store.active_total(), 0);

    // The statistics tell the two apart: the proxy's own answer, and the target's 4xx with a
    // ban.
    let stats = (gateway.outcomes)
        .pair(&ProxyKey::new("crawl", "only"), "127.0.0.1")
        .expect("recorded");
    assert_eq!(
        (
            stats.requests,
            stats.failures.proxy_error,
            stats.failures.client_error,
            stats.bans
        ),
        (2, 1, 1, 1),
        "{stats:?}"
    );
}

/// A proxy that dies mid-answer: the client's answer breaks off, and the statistics count a
/// `reset` with the bytes passed on before it. The proxy dies only once the client has those
/// bytes: had it closed at once, the head, the bytes and the close could reach the gateway
/// together, and the answer end before any of it was sent (an empty answer; seen under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_broken_off_counts_as_a_reset() {
    // An upstream "proxy" that answers a head promising 100 bytes, sends 7, and closes when
    // told to.
    let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = upstream.local_addr().expect("address").port();
    let (die, dies) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(async move {
        let (mut stream, _) = upstream.accept().await.expect("the gateway connects");
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).await.is_ok_and(|n| n == 1) {
            head.push(byte[0]);
        }
        let _ = stream
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            .await;
        let _ = dies.await;
    });
    let gateway = in_process::start(&[("dying", port)]).await;
    let mut client = send_request(gateway.addr, "GET", "http://shop.example/page", "crawler-10").await;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 1024];
    while !answer.ends_with(b"partial") {
        let n = tokio::time::timeout(Duration::from_secs(20), client.read(&mut chunk))
            .await
            .expect("the first bytes within 20 s")
            .expect("read");
        assert!(
            n > 0,
            "the answer ended early: {}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&chunk[..n]);
    }
    let _ = die.send(());
    tokio::time::timeout(Duration::from_secs(20), client.read_to_end(&mut answer))
        .await
        .expect("the answer ends within 20 s")
        .ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.ends_with("\r\n\r\npartial"),
        "the answer breaks off: {answer}"
    );
    let stats = support::wait_until(Duration::from_secs(10), "the broken answer counted", async || {
        (gateway.outcomes).pair(&ProxyKey::new("crawl", "dying"), "shop.example")
    })
    .await;
    assert_eq!(
        (
            stats.requests,
            stats.failures.reset,
            stats.successes,
            stats.bytes_received
        ),
        (1, 1, 0, 7),
        "{stats:?}"
    );
    // A broken body is dropped, and its lease goes back from the drop, after the statistics.
    support::wait_until(Duration::from_secs(10), "the lease given back", async || {
        (gateway.store.active_total() == 0).then_some(())
    })
    .await;
    serving.abort();
}

/// A first fetch of `url` as `user` (whose session key is `session`): the Squid's outgoing
/// address the origin saw, and the session's proxy.
async fn session_on(setup: &Setup, user: &str, session: &str, url: &str) -> (IpAddr, String) {
    let (code, body, _) = setup.curl(user, url, &[]).await;
    assert_eq!(code, 200, "{body}");
    (from_ip(&body), session_proxy(setup, session).await)
}

/// The session's proxy, as `GET /v1/leases` lists its lease.
async fn session_proxy(setup: &Setup, session: &str) -> String {
    let leases = setup.leases().await;
    leases
        .iter()
        .find(|l| l["sessionKey"] == session)
        .and_then(|l| l["proxy"].as_str())
        .unwrap_or_else(|| panic!("no lease of session {session}: {leases:?}"))
        .to_owned()
}

/// The proxies banned for 127.0.0.1, as `GET /v1/proxies?targetDomain=127.0.0.1` shows them.
async fn banned_for_the_origin(setup: &Setup) -> Vec<String> {
    let proxies = setup.api_get("/v1/proxies?targetDomain=127.0.0.1").await;
    proxies["proxies"]
        .as_array()
        .expect("proxies")
        .iter()
        .filter(|p| p["availability"] == "banned")
        .filter_map(|p| p["key"].as_str().map(str::to_owned))
        .collect()
}

/// A rules file (`--gateway-rules`): a body pattern and a header rule each ban the proxy for
/// the domain and move the sticky session. The captcha page (the word after 1 KiB) is passed
/// on byte for byte, 200 KiB of it, though the gateway read its start before answering; the
/// header rule retries (the rules file's default), so its client gets another Squid's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_or_header_rule_bans_for_the_domain_and_moves_the_session() {
    let rules = r#"
rules:
  - name: captcha
    match: {status: [200], body: "please solve this captcha", bodyBytes: 4096}
    retry: false
    escalation: [{after: 1, action: ban}]
  - name: quietly-blocked
    match: {header: {name: x-blocked, value: "^yes$"}}
    escalation: [{after: 1, action: ban}]
"#;
    // Idle sessions let go of their proxy within a second.
    let setup = Setup::start_with(Some(rules), 1, &["--gateway-session-idle-seconds", "1"]).await;

    let user = "crawler-3;session=s-body";
    let url = setup.origin.url("/captcha-1");
    let (first, first_proxy) = session_on(&setup, user, "s-body", &url).await;
    setup.origin.refuse(first);
    let (code, body, _) = setup.curl(user, &url, &[]).await;
    assert_eq!(code, 200);
    assert!(
        body == captcha_page(first),
        "the page is passed on unchanged ({} bytes)",
        body.len()
    );
    assert_eq!(
        banned_for_the_origin(&setup).await,
        std::slice::from_ref(&first_proxy)
    );
    let (code, body, _) = setup.curl(user, &url, &[]).await;
    assert_eq!(code, 200, "{body}");
    let second = from_ip(&body);
    assert_ne!(second, first, "the session moved off the banned Squid");
    assert_ne!(session_proxy(&setup, "s-body").await, first_proxy);
    setup.origin.welcome_all();
    // The first session's proxy is free again for the second's retry.
    setup
        .no_leases_within(Duration::from_secs(10), "the first session idle")
        .await;

    let user = "crawler-3;session=s-header";
    let url = setup.origin.url("/header-1");
    let (blocked, blocked_proxy) = session_on(&setup, user, "s-header", &url).await;
    setup.origin.refuse(blocked);
    let (code, body, head) = setup.curl(user, &url, &[]).await;
    assert_eq!(code, 200, "{body}");
    assert!(
        !head.to_ascii_lowercase().contains("x-blocked"),
        "the blocked answer was replaced: {head}"
    );
    let other = from_ip(&body);
    assert!(
        other != blocked && other != first,
        "sent once more through the one Squid left: {body}"
    );
    let mut banned = banned_for_the_origin(&setup).await;
    banned.sort();
    let mut expected = vec![first_proxy, blocked_proxy.clone()];
    expected.sort();
    assert_eq!(banned, expected);
    let (code, body, _) = setup.curl(user, &url, &[]).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(from_ip(&body), other, "the session moved to the Squid left");
    assert_ne!(session_proxy(&setup, "s-header").await, blocked_proxy);
}

/// Each recycle of the Proxy `name` from its audit: (when it began, when it was healthy
/// again, the request's cause), in ms since the epoch.
fn recycles(setup: &Setup, name: &str) -> Vec<(i64, Option<i64>, String)> {
    let at = |line: &Value| {
        line["at"]
            .as_str()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .map(|t| t.as_millisecond())
            .expect("a timestamp")
    };
    let lines = audit_lines(&setup.host, name);
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line["reason"] != "Recycled" {
            continue;
        }
        let healthy = lines[i + 1..].iter().find(|l| l["to"] == "healthy").map(at);
        found.push((
            at(line),
            healthy,
            line["cause"].as_str().unwrap_or_default().to_owned(),
        ));
    }
    found
}

/// Escalation: the target keeps refusing one Squid (requests pinned to it with
/// `attr.squid=a`). Its matches climb the rules file's ladder: retry (no other Squid matches
/// the selector, so the 403 is passed on), a cooldown and a ban for the domain (503 while they
/// last), out of rotation (its health held failing: degraded, closed, back after the hold), and
/// a recycle: the lifecycle replaces its instance (a new Squid process), and its audit says
/// the gateway rule asked, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_squid_the_target_keeps_refusing_climbs_the_ladder_to_a_fresh_instance() {
    let rules = r#"
rules:
  - name: blocked
    match: {status: [403]}
    escalation:
      - {after: 1, action: retry}
      - {after: 2, action: cooldown, seconds: 1}
      - {after: 3, action: ban, seconds: 2}
      - {after: 4, action: outOfRotation, seconds: 3}
      - {after: 5, action: recycle}
"#;
    let setup = Setup::start_with(Some(rules), 1, &[]).await;
    let refused: IpAddr = "127.0.0.2".parse().expect("a's outgoing address");
    let squids_before = standalone::squids(setup.host.path());
    setup.origin.refuse(refused);
    let user = "crawler-4;attr.squid=a";
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut codes = Vec::new();
    let mut n = 0;
    while recycles(&setup, "a").is_empty() {
        assert!(
            Instant::now() < deadline,
            "a was never recycled; answers {codes:?}\n{}",
            setup.operator.log()
        );
        n += 1;
        let (code, body, _) = setup
            .curl(user, &setup.origin.url(&format!("/esc-{n}")), &[])
            .await;
        match code {
            403 => assert_eq!(body, format!("no entry for {refused}")),
            503 => assert!(body.contains("no_proxy_available"), "{body}"),
            other => panic!("{other}: {body}"),
        }
        if codes.last() != Some(&code) {
            codes.push(code);
        }
        // Paced: the cooldown, the ban and the hold last seconds.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = setup.operator.log();
    for step in ["retry", "cooldown", "ban", "outOfRotation", "recycle"] {
        assert!(
            log.lines()
                .any(|l| l.contains("a gateway rule matched") && l.contains(&format!("step=\"{step}\""))),
            "no {step} step in the log:\n{log}"
        );
    }
    assert!(
        codes.contains(&503),
        "the cooldown and ban refused leases: {codes:?}"
    );
    let audit = audit_lines(&setup.host, "a");
    assert!(
        audit
            .iter()
            .any(|l| l["from"] == "healthy" && l["to"] == "degraded"),
        "out of rotation went through the lifecycle: {audit:?}"
    );
    setup.origin.welcome_all();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body, _) = setup.curl(user, &setup.origin.url("/after"), &[]).await;
        if code == 200 {
            assert_eq!(from_ip(&body), refused);
            break;
        }
        assert!(Instant::now() < deadline, "a never served again: {code} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let recycled = recycles(&setup, "a");
    assert_eq!(recycled.len(), 1, "one request, one recycle: {recycled:?}");
    assert!(
        recycled[0]
            .2
            .starts_with("recycle requested: gateway rule blocked "),
        "the audit says who asked: {recycled:?}"
    );
    let squids_after = standalone::squids(setup.host.path());
    let replaced: Vec<&i32> = squids_before
        .iter()
        .filter(|p| !squids_after.contains(p))
        .collect();
    assert_eq!(
        replaced.len(),
        1,
        "a's Squid was replaced by a new process: {squids_before:?} -> {squids_after:?}"
    );
    assert_eq!(squids_after.len(), 3);
}

/// The pool's budget holds: the target refuses all three Squids, each climbs to a recycle at
/// about the same time, and with `--max-unavailable` at its default (25 % of 3: one) the
/// lifecycle replaces them one after the other, never two at once (the audit's times), each
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recycles_the_rules_ask_for_stay_within_the_pools_budget() {
    let rules = r#"
rules:
  - name: burnt
    match: {status: [403]}
    retry: false
    escalation:
      - {after: 1, action: ban, seconds: 1}
      - {after: 2, action: recycle}
"#;
    let setup = Setup::start_with(Some(rules), 1, &[]).await;
    for (_, outgoing) in SQUIDS {
        setup.origin.refuse(outgoing.parse().expect("an address"));
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut n = 0;
    loop {
        let done = SQUIDS
            .iter()
            .filter(|(name, _)| recycles(&setup, name).iter().any(|r| r.1.is_some()))
            .count();
        if done == SQUIDS.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not all recycled:\n{}",
            setup.operator.log()
        );
        for (name, _) in SQUIDS {
            n += 1;
            let user = format!("crawler-5;attr.squid={name}");
            let (code, body, _) = setup
                .curl(&user, &setup.origin.url(&format!("/burnt-{n}")), &[])
                .await;
            assert!(matches!(code, 403 | 503), "{code}: {body}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut spans: Vec<(i64, i64, &str)> = Vec::new();
    for (name, _) in SQUIDS {
        let recycled = recycles(&setup, name);
        assert_eq!(recycled.len(), 1, "{name} was recycled once: {recycled:?}");
        let (began, healthy, cause) = &recycled[0];
        assert!(cause.contains("gateway rule burnt"), "{cause}");
        spans.push((*began, healthy.expect("healthy again"), name));
    }
    spans.sort();
    for pair in spans.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "{} began replacing before {} was healthy again: {spans:?}",
            pair[1].2,
            pair[0].2
        );
    }
}

/// A rules file with a mistake is refused at start, the message naming the rule and the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_rules_file_is_refused_at_start_naming_the_field() {
    let host = Host::new();
    std::fs::write(
        host.path().join("rules.yaml"),
        "rules:\n  - name: captcha\n    match: {body: \"(unclosed\"}\n",
    )
    .expect("rules file");
    let gateway = format!("127.0.0.1:{}", free_port());
    refused_at_start(
        &host,
        &["--gateway-listen", &gateway, "--gateway-rules", "rules.yaml"],
        "the gateway rules rules.yaml: rule \"captcha\" (rules[0]), match.body: not a valid pattern",
    )
    .await;
}

/// Politeness (the rules file's `politeness:`): requests through one Squid to one domain start
/// at least the interval apart, each waiting its turn within the bound; one that would wait
/// longer gets 429 `politeness_limit` with `Retry-After` and never reaches the target; a lease
/// acquired for that proxy and domain is told when its first request may start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn politeness_spaces_requests_and_refuses_a_long_wait() {
    let rules = r#"
politeness:
  - {domains: ["127.0.0.1"], proxies: {squid: a}, minIntervalMs: 1000, maxWaitMs: 1500}
  - {domains: ["127.0.0.1"], proxies: {squid: b}, minIntervalMs: 10000, maxWaitMs: 500}
"#;
    let setup = Setup::start_with(Some(rules), 1, &[]).await;
    let started = Instant::now();
    for n in 0..3 {
        let url = setup.origin.url(&format!("/polite-a-{n}"));
        let (code, body, _) = setup.curl("crawler-6;attr.squid=a", &url, &[]).await;
        assert_eq!(code, 200, "{body}");
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(2_000),
        "three starts a second apart took {took:?}"
    );

    let url = setup.origin.url("/polite-b");
    let (code, body, _) = setup.curl("crawler-6;attr.squid=b", &url, &[]).await;
    assert_eq!(code, 200, "{body}");
    let before = Instant::now();
    let (code, body, head) = setup.curl("crawler-6;attr.squid=b", &url, &[]).await;
    assert_eq!(code, 429, "{body}");
    assert!(
        before.elapsed() < Duration::from_secs(5),
        "refused without the long wait"
    );
    assert!(
        body.contains("politeness_limit") && body.contains("at most one request every 10000 ms"),
        "{body}"
    );
    let retry_after = retry_after_in(&head);
    assert!((9..=10).contains(&retry_after), "{head}");
    assert_eq!(
        setup.origin.peers_of("/polite-b").len(),
        1,
        "the refused request never reached the target"
    );

    // The lease API shares the state: a holder of Squid b for the domain is told that its first
    // request may start only once the interval since the gateway's last start there is over.
    let (status, lease) = api_call(
        &setup,
        "POST",
        "/v1/leases",
        r#"{"holder":"lease-api","selector":{"squid":"b"},"targetDomain":"127.0.0.1"}"#,
    )
    .await;
    assert_eq!(status, 201, "{lease}");
    let millis = |field: &str| {
        let stamp = lease[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field}: {lease}"));
        stamp
            .parse::<jiff::Timestamp>()
            .expect("RFC 3339")
            .as_millisecond()
    };
    let wait = millis("notBefore") - millis("acquiredAt");
    assert!((6_000..=10_100).contains(&wait), "{wait} ms: {lease}");
    let release = format!(r#"{{"fencingToken":{},"outcome":"ok"}}"#, lease["fencingToken"]);
    let path = format!("/v1/leases/{}/release", lease["leaseId"].as_str().expect("id"));
    assert_eq!(api_call(&setup, "POST", &path, &release).await.0, 200);
    setup
        .no_leases_within(Duration::from_secs(5), "after a refusal")
        .await;
}

/// A body pattern reads the body's start before the gateway answers, bounded in time: a body
/// that stalls after its first bytes (the origin's `/slow`) is judged on what came within 5 s
/// and passed on as it comes, head and first bytes first, not held for the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_ahead_for_a_body_pattern_is_bounded_in_time() {
    use egress_proxies_operator::gateway::{GatewayConfig, rules::Rules};

    let origin = Origin::start().await;
    let squid = support::Squid::start().await;
    let rules = Rules::parse(
        "rules:\n  - name: robot\n    match: {body: robot}\n",
        "rules.yaml",
    )
    .expect("valid");
    let gateway = in_process::start_with(
        &[("only", squid.port)],
        GatewayConfig {
            rules,
            ..GatewayConfig::default()
        },
    )
    .await;
    let mut stream = TcpStream::connect(gateway.addr).await.expect("connect");
    let basic = basic_credentials(b"crawler-10:tok");
    let url = origin.url("/slow");
    stream
        .write_all(
            format!(
                "GET {url} HTTP/1.1\r\nHost: {}\r\nProxy-Authorization: Basic {basic}\r\n\r\n",
                origin.addr
            )
            .as_bytes(),
        )
        .await
        .expect("send");
    let sent = Instant::now();
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("first bytes") {
        let read = tokio::time::timeout(Duration::from_secs(15), stream.read(&mut buffer))
            .await
            .expect("the head and the first bytes within 15 s")
            .expect("read");
        assert!(read > 0, "closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buffer[..read]);
    }
    let waited = sent.elapsed();
    let answer = String::from_utf8_lossy(&seen);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        (Duration::from_millis(4_500)..Duration::from_secs(10)).contains(&waited),
        "judged after the 5 s bound, not before, not at the body's end: {waited:?}"
    );
    // No match in what came: no ban.
    let store = &gateway.store;
    let all = store.compile(&Default::default());
    assert!(
        store
            .list_for(&all, Some("127.0.0.1"), store.now_ms())
            .iter()
            .all(|view| view.bans.is_empty())
    );
}

/// A discovery API call that must be answered; returns (status, JSON body).
async fn api_call(setup: &Setup, method: &str, path: &str, body: &str) -> (u16, Value) {
    let token = setup.host.token();
    match try_api(
        setup.host.api_port,
        &token,
        method,
        path,
        body,
        Duration::from_secs(10),
    )
    .await
    {
        Answer::Got(status, body) => (status.as_u16(), body),
        other => panic!("{method} {path}: {other:?}\n{}", setup.operator.log()),
    }
}

/// Quotas (`--quotas`): the token's 4 requests per hour are one acquire and three gateway
/// requests (one of them banned by the target); the next gateway request and the next acquire
/// get 429 `quota_exceeded` naming the quota, with `Retry-After`, while the release of the
/// lease taken before still works. `GET /v1/usage` and `/metrics` show what was used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_over_its_quota_gets_429_and_usage_shows_what_it_used() {
    // The operator's own token file names its one token `token-1`.
    let quotas = "quotas:\n  - {token: token-1, requests: 4, period: 1h}\n";
    let setup =
        Setup::start_with_files(None, 1, &[("quotas.yaml", quotas)], &["--quotas", "quotas.yaml"]).await;

    let (status, lease) = api_call(
        &setup,
        "POST",
        "/v1/leases",
        r#"{"holder": "api-crawler", "selector": {"squid": "c"}}"#,
    )
    .await;
    assert_eq!(status, 201, "{lease}");

    // The target refuses Squid a: a 403 that bans it for the domain.
    setup.origin.refuse("127.0.0.2".parse().expect("an address"));
    let (code, _, _) = setup
        .curl("crawler-1;attr.squid=a", &setup.origin.url("/refused"), &[])
        .await;
    assert_eq!(code, 403);
    // The second answer comes after DELAY: its lease is held that long.
    for path in ["/page", "/delayed/page"] {
        let (code, body, _) = setup.curl("crawler-1", &setup.origin.url(path), &[]).await;
        assert_eq!(code, 200, "{body}");
    }
    let (code, body, headers) = setup
        .curl("crawler-1", &setup.origin.url("/one-too-many"), &[])
        .await;
    assert_eq!(code, 429, "{body}");
    let refusal: Value = serde_json::from_str(&body).expect("a JSON error");
    assert_eq!(refusal["error"]["code"], "quota_exceeded", "{body}");
    let message = refusal["error"]["message"].as_str().expect("a message");
    assert!(
        message.starts_with("token token-1 used 4 of its 4 requests per 1h; it resets at "),
        "{message}"
    );
    assert!(
        message.ends_with(":00:00Z"),
        "the window ends on the hour: {message}"
    );
    let retry_after = retry_after_in(&headers);
    assert!((1..=3600).contains(&retry_after), "{retry_after}");
    assert!(
        setup.origin.peers_of("/one-too-many").is_empty(),
        "a refused request reached the target"
    );

    let (status, body) = api_call(&setup, "POST", "/v1/leases", r#"{"holder": "api-crawler"}"#).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (429, &Value::from("quota_exceeded")),
        "{body}"
    );
    // Releases are never refused: nothing leaks.
    let release = format!(
        r#"{{"fencingToken": {}, "outcome": "ok"}}"#,
        lease["fencingToken"]
    );
    let id = lease["leaseId"].as_str().expect("a lease ID");
    let (status, body) = api_call(&setup, "POST", &format!("/v1/leases/{id}/release"), &release).await;
    assert_eq!(status, 200, "{body}");

    // The gateway's leases are released as their answers end: usage settles at once.
    setup
        .no_leases_within(Duration::from_secs(10), "after the crawl")
        .await;
    let usage = setup.api_get("/v1/usage").await;
    let token = &usage["tokens"][0];
    assert_eq!(token["token"], "token-1", "{usage}");
    assert_eq!(
        (&token["requests"], &token["bans"]),
        (&Value::from(4), &Value::from(1)),
        "{usage}"
    );
    assert!(token["bytes"].as_u64().is_some_and(|b| b > 0), "{usage}");
    let held = DELAY.as_secs_f64();
    assert!(
        token["leaseSeconds"].as_f64().is_some_and(|s| s >= held),
        "{usage}"
    );
    let quota = &token["quotas"][0];
    assert_eq!(
        (
            &quota["period"],
            &quota["requests"]["used"],
            &quota["requests"]["limit"]
        ),
        (&Value::from("1h"), &Value::from(4), &Value::from(4)),
        "{usage}"
    );
    let holders = usage["holders"].as_array().expect("holders");
    let crawler = holders
        .iter()
        .find(|h| h["holder"] == "crawler-1")
        .expect("crawler-1 listed");
    assert_eq!(
        (&crawler["requests"], &crawler["bans"]),
        (&Value::from(3), &Value::from(1)),
        "{usage}"
    );
    assert!(crawler["bytes"].as_u64().is_some_and(|b| b > 0), "{usage}");
    assert!(
        crawler["leaseSeconds"].as_f64().is_some_and(|s| s >= held),
        "{usage}"
    );
    let api = holders
        .iter()
        .find(|h| h["holder"] == "api-crawler")
        .expect("api-crawler listed");
    assert_eq!(api["requests"], 1, "{usage}");
    assert!(api["leaseSeconds"].as_f64().is_some_and(|s| s >= held), "{usage}");

    let metrics = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--noproxy",
            "*",
            &format!("{}/metrics", setup.host.api_url()),
        ])
        .output()
        .await
        .expect("curl runs");
    let metrics = String::from_utf8_lossy(&metrics.stdout);
    for line in [
        "epo_usage_requests_total{token=\"token-1\"} 4",
        "epo_usage_bans_total{token=\"token-1\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    assert!(
        !metrics.contains(&setup.host.token()),
        "a token value in the metrics"
    );
    assert!(
        !usage.to_string().contains(&setup.host.token()),
        "a token value in GET /v1/usage"
    );
}

/// A quotas file with a mistake is refused at start, the message naming the entry and the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_quotas_file_is_refused_at_start_naming_the_field() {
    let host = Host::new();
    std::fs::write(
        host.path().join("quotas.yaml"),
        "quotas:\n  - {token: crawler-a, requests: 10, period: 1w}\n",
    )
    .expect("quotas file");
    refused_at_start(
        &host,
        &["--quotas", "quotas.yaml"],
        "the quotas quotas.yaml: quota for token \"crawler-a\" (quotas[0]), period: \"1w\" is no period",
    )
    .await;
}
