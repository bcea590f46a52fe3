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
//! - a client that goes away mid-answer, and an idle session, leave no lease behind.

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
    standalone::{self, Answer, Host, healthy_rows, start_operator_with, try_api, wait_status},
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
/// body, then waits; `/delayed/...` answers after [`DELAY`]; every other path answers 200 naming the address it came from, or 403 when
/// that address is the one [`Origin::refuse`] named.
struct Origin {
    addr: SocketAddr,
    refused: Arc<Mutex<Option<IpAddr>>>,
    seen: Arc<Mutex<Vec<(String, IpAddr)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Origin {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind origin");
        let addr = listener.local_addr().expect("origin address");
        let refused: Arc<Mutex<Option<IpAddr>>> = Arc::default();
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

    /// Answers 403 to requests from `ip` from now on.
    fn refuse(&self, ip: IpAddr) {
        *self.refused.lock().expect("not poisoned") = Some(ip);
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
    refused: Arc<Mutex<Option<IpAddr>>>,
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
        let refuse = path != "/health" && *refused.lock().expect("not poisoned") == Some(peer);
        let (status, body) = if refuse {
            ("403 Forbidden", format!("no entry for {peer}"))
        } else {
            ("200 OK", format!("hello {path} from {peer}"))
        };
        let response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
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
        Self::start_with_slots(extra, 1).await
    }

    /// [`Setup::start`] with `slots` concurrent leases per proxy.
    async fn start_with_slots(extra: &[&str], slots: u32) -> Self {
        let origin = Origin::start().await;
        let host = Host::new();
        for (name, outgoing) in SQUIDS {
            let manifest = standalone::manifest(
                name,
                free_port(),
                &origin.url("/health"),
                &[("pool", "gw")],
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
        args.extend_from_slice(extra);
        let operator = start_operator_with(&host, "operator.log", &args);
        wait_status(&host, "three healthy proxies", |t| healthy_rows(t) == 3);
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
    let mut stream = TcpStream::connect(("127.0.0.1", setup.gateway))
        .await
        .expect("connect");
    let basic = basic_credentials(format!("crawler-4:{token}").as_bytes());
    stream
        .write_all(
            format!("GET /x HTTP/1.1\r\nHost: a\r\nProxy-Authorization: Basic {basic}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .expect("send");
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.expect("read");
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    assert!(raw.contains("absolute form"), "{raw}");

    // Nothing reached the origin, and nothing is leased.
    assert!(setup.origin.peers_of("/refused").is_empty());
    assert!(setup.leases().await.is_empty());
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
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("first bytes") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut buf))
            .await
            .expect("the head arrives")
            .expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
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

/// One exchange with the gateway at `gateway` on a fresh connection: `method url` with
/// `user:tok` credentials; returns the raw answer.
async fn raw_request(gateway: SocketAddr, method: &str, url: &str, user: &str) -> String {
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
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_string(&mut raw))
        .await
        .expect("answered within 20 s")
        .expect("read");
    raw
}

mod in_process {
    //! The gateway in this process over a store of one strict-LRU shard (proxies chosen in
    //! the order given, first), without a journal, the token `tok`.

    use std::{net::SocketAddr, sync::Arc};

    use egress_proxies_operator::{
        api::{LeasePolicy, ProxyKey},
        discovery::StaticTokens,
        gateway::{self, Gateway, GatewayConfig, GatewayDeps},
        lease::{Admission, LeaseStore, LeaseStoreConfig, LeaseTarget, token::LeaseSigner},
        outcomes::Outcomes,
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
            signer: LeaseSigner::new(&LeaseSigner::generate_secret()).expect("signer"),
            journal: None,
            auth: Arc::new(StaticTokens::parse("tok\n")),
            readiness,
            outcomes: outcomes.clone(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(gateway::serve(
            listener,
            Gateway::new(deps, GatewayConfig::default()),
            async move {
                let _ = stopped.await;
            },
        ));
        InProcess {
            store,
            outcomes,
            addr,
            _stop: stop,
        }
    }
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
    let setup = Setup::start_with_slots(&["--gateway-session-idle-seconds", "1"], 4).await;
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

/// Cluster mode serves the gateway too (the same core): against a real kube-apiserver, with a
/// Proxy object of the `local` provider, `curl -x` through the gateway reaches the origin
/// through that Squid once the replica leads, and leaves no lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_mode_serves_the_gateway_too() {
    use egress_proxies_operator::api::Proxy;
    use kube::{Api, api::PostParams};
    use support::{
        cluster_app::{ClusterApp, local_cluster, local_proxy},
        control_plane::ControlPlane,
        wait_until,
    };

    /// Kills the Squids the local provider started under the folder, whatever the outcome.
    struct Squids(std::path::PathBuf);
    impl Drop for Squids {
        fn drop(&mut self) {
            for pid in standalone::squids(&self.0) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }

    let origin = Origin::start().await;
    let plane = ControlPlane::start().await;
    let operator_client = plane.install_default().await;
    plane.create_namespace("crawl").await;
    let client = plane.client().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let _squids = Squids(dir.path().to_owned());
    let token = "gateway-token-0123456789abcdef";
    let (admin, discovery, gateway, proxy_port) = (free_port(), free_port(), free_port(), free_port());
    let mut options = local_cluster(
        dir.path(),
        &dir.path().join("local"),
        token,
        ([127, 0, 0, 1], admin).into(),
        ([127, 0, 0, 1], discovery).into(),
    );
    options.gateway_listen = Some(([127, 0, 0, 1], gateway).into());
    let operator = ClusterApp::start(operator_client, options);

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "crawl");
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
    let credentials = format!("crawler-8:{token}");
    // 503 `not_ready` until the replica leads and the Proxy is healthy and open.
    let body = wait_until(Duration::from_secs(90), "the gateway forwards", async || {
        let (code, body, _) =
            curl_through(dir.path(), gateway, &credentials, &origin.url("/cluster"), &[]).await;
        (code == 200).then_some(body)
    })
    .await;
    assert_eq!(body, "hello /cluster from 127.0.0.1");
    let leases = wait_until(Duration::from_secs(10), "no lease left", async || match try_api(
        discovery,
        token,
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
    operator.stop().await;
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
/// `reset` with the bytes passed on before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_broken_off_counts_as_a_reset() {
    // An upstream "proxy" that answers a head promising 100 bytes, sends 7 and closes.
    let upstream = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = upstream.local_addr().expect("address").port();
    let serving = tokio::spawn(async move {
        while let Ok((mut stream, _)) = upstream.accept().await {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).await.is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
                .await;
        }
    });
    let gateway = in_process::start(&[("dying", port)]).await;
    let answer = raw_request(gateway.addr, "GET", "http://shop.example/page", "crawler-10").await;
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
    assert_eq!(gateway.store.active_total(), 0);
    serving.abort();
}
