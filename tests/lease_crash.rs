//! Crash consistency of standalone leases (issue 18): the real binary with real Squids through
//! the local provider, concurrent clients acquiring, renewing and releasing over real HTTP, the
//! operator SIGKILLed at seeded random points and restarted. Afterwards each client's record of
//! *answered* operations is compared with the restarted operator's store: every answered release
//! stays released, every answered acquire (not released since) is active with the token its
//! holder was last told.
//!
//! `EPO_CRASH_SEED=N` replays a run's kill points and client choices (the seed is printed).
//! `EPO_CRASH_NO_DURABILITY=1` runs it against `--no-durable-leases` (the 1 s checkpoint of
//! before): then it is expected to fail, which shows what it catches.

#[path = "support/operations_doc.rs"]
mod operations_doc;
mod support;

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use hyper::StatusCode;
use support::{
    Origin, free_port,
    process::GroupChild,
    standalone::{self, Answer, Host, healthy_rows, start_operator_with, try_api, wait_status},
};

const PROXIES: [&str; 3] = ["a", "b", "c"];
const CLIENTS: usize = 4;
const KILLS: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(5);

/// A lease whose acquire was answered and whose release was not.
#[derive(Clone, Debug)]
struct Held {
    id: String,
    proxy: String,
    token: u64,
    /// A renewal was sent and not answered: the token may be this one or a newer one.
    token_in_doubt: bool,
}

/// One client's record of what it was told.
#[derive(Debug, Default)]
struct Record {
    /// Answered acquires, not released (as far as the client knows).
    held: Vec<Held>,
    /// Answered releases: (lease ID, token, proxy).
    released: Vec<(String, u64, String)>,
    /// Leases whose release was sent and not answered, by proxy: they may still be active.
    release_in_doubt: Vec<Held>,
    /// Acquires sent and not answered: a lease the client does not know may exist, anywhere.
    acquire_in_doubt: usize,
    /// Operations answered with a success.
    answered: usize,
    /// Answers no correct operator gives.
    violations: Vec<String>,
}

/// What an answer means for the client's record.
enum Told {
    /// Done, with this body.
    Done(serde_json::Value),
    /// It may or may not have happened: no answer, or a 5xx that is not "nothing available"
    /// (e.g. `journal_unavailable`: applied in memory, maybe not on disk).
    InDoubt,
    /// It did not happen (nothing listened, or no proxy available yet after a restart).
    Nothing,
    /// Anything else.
    Unexpected(String),
}

fn told(answer: Answer, success: StatusCode) -> Told {
    match answer {
        Answer::Got(status, body) if status == success => Told::Done(body),
        Answer::Refused => Told::Nothing,
        Answer::Got(StatusCode::SERVICE_UNAVAILABLE, body)
            if body["error"]["code"] == "no_proxy_available" =>
        {
            Told::Nothing
        }
        Answer::Lost => Told::InDoubt,
        Answer::Got(status, _) if status.is_server_error() => Told::InDoubt,
        Answer::Got(status, body) => Told::Unexpected(format!("{status}: {body}")),
    }
}

struct Operator {
    host: Host,
    token: String,
    extra: Vec<&'static str>,
    child: Option<GroupChild>,
    starts: usize,
}

impl Operator {
    fn start(&mut self) {
        self.starts += 1;
        self.child = Some(start_operator_with(
            &self.host,
            &format!("operator-{}.log", self.starts),
            &self.extra,
        ));
    }

    /// SIGKILL (the whole process group; the Squids run in sessions of their own).
    fn kill(&mut self) {
        drop(self.child.take());
    }

    async fn wait_serving(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Answer::Got(StatusCode::OK, _) =
                try_api(self.host.api_port, &self.token, "GET", "/healthz", "", TIMEOUT).await
            {
                return;
            }
            assert!(Instant::now() < deadline, "the operator did not come back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn client(port: u16, token: String, seed: u64, running: Arc<AtomicBool>, record: Arc<Mutex<Record>>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    while running.load(Ordering::Relaxed) {
        let choice = {
            let r = record.lock().unwrap();
            let usable: Vec<Held> = r.held.iter().filter(|h| !h.token_in_doubt).cloned().collect();
            if usable.is_empty() || (usable.len() < 3 && rng.bool()) {
                None
            } else {
                Some(usable[rng.usize(..usable.len())].clone())
            }
        };
        match choice {
            None => {
                let answer = try_api(
                    port,
                    &token,
                    "POST",
                    "/v1/leases",
                    r#"{"holder":"crash-test","selector":{"pool":"crash"},"ttlSeconds":300}"#,
                    TIMEOUT,
                )
                .await;
                let mut r = record.lock().unwrap();
                match told(answer, StatusCode::CREATED) {
                    Told::Done(body) => {
                        r.answered += 1;
                        r.held.push(Held {
                            id: body["leaseId"].as_str().expect("leaseId").to_owned(),
                            proxy: body["proxy"]["key"].as_str().expect("proxy key").to_owned(),
                            token: body["fencingToken"].as_u64().expect("token"),
                            token_in_doubt: false,
                        });
                    }
                    Told::InDoubt => r.acquire_in_doubt += 1,
                    Told::Nothing => {}
                    Told::Unexpected(what) => r.violations.push(format!("an acquire answered {what}")),
                }
            }
            Some(lease) if rng.bool() => {
                let answer = try_api(
                    port,
                    &token,
                    "POST",
                    &format!("/v1/leases/{}/renew", lease.id),
                    &format!(r#"{{"fencingToken":{}}}"#, lease.token),
                    TIMEOUT,
                )
                .await;
                let mut r = record.lock().unwrap();
                let held = r.held.iter_mut().find(|h| h.id == lease.id).expect("held");
                match told(answer, StatusCode::OK) {
                    Told::Done(body) => {
                        held.token = body["fencingToken"].as_u64().expect("token");
                        r.answered += 1;
                    }
                    Told::InDoubt => held.token_in_doubt = true,
                    Told::Nothing => {}
                    // A lost lease shows here first (404), or a lost renewal (409).
                    Told::Unexpected(what) => {
                        r.violations.push(format!("renewing {lease:?} answered {what}"))
                    }
                }
            }
            Some(lease) => {
                let answer = try_api(
                    port,
                    &token,
                    "POST",
                    &format!("/v1/leases/{}/release", lease.id),
                    &format!(r#"{{"fencingToken":{},"outcome":"ok"}}"#, lease.token),
                    TIMEOUT,
                )
                .await;
                let mut r = record.lock().unwrap();
                match told(answer, StatusCode::OK) {
                    Told::Done(_) => {
                        r.held.retain(|h| h.id != lease.id);
                        r.released.push((lease.id, lease.token, lease.proxy));
                        r.answered += 1;
                    }
                    Told::InDoubt => {
                        r.held.retain(|h| h.id != lease.id);
                        r.release_in_doubt.push(lease);
                    }
                    Told::Nothing => {}
                    Told::Unexpected(what) => {
                        // Counted as a violation; the record stops relying on this lease.
                        r.held.retain(|h| h.id != lease.id);
                        r.violations.push(format!("releasing {lease:?} answered {what}"));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(2..15))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answered_lease_operation_is_lost_across_sigkills() {
    let seed = std::env::var("EPO_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..1_000_000));
    let durable = std::env::var("EPO_CRASH_NO_DURABILITY").is_err();
    eprintln!("lease crash test: seed {seed} (EPO_CRASH_SEED={seed} replays it), durability {durable}");
    let mut rng = fastrand::Rng::with_seed(seed);

    let origin = Origin::start().await;
    let host = Host::new();
    let health_url = origin.http_url("/health");
    for name in PROXIES {
        host.add_manifest(
            name,
            &standalone::manifest(
                name,
                free_port(),
                &health_url,
                &[("pool", "crash")],
                &[("maxConcurrent", 40), ("cooldownSeconds", 0)],
            ),
        );
    }
    let mut operator = Operator {
        token: String::new(),
        host,
        extra: if durable {
            vec![]
        } else {
            vec!["--no-durable-leases"]
        },
        child: None,
        starts: 0,
    };
    operator.start();
    wait_status(&operator.host, "three healthy proxies", |t| healthy_rows(t) == 3);
    operator.token = operator.host.token();

    let running = Arc::new(AtomicBool::new(true));
    let records: Vec<Arc<Mutex<Record>>> = (0..CLIENTS).map(|_| Arc::default()).collect();
    let clients: Vec<_> = records
        .iter()
        .enumerate()
        .map(|(i, record)| {
            tokio::spawn(client(
                operator.host.api_port,
                operator.token.clone(),
                seed.wrapping_add(1 + i as u64),
                running.clone(),
                record.clone(),
            ))
        })
        .collect();
    let answered = || records.iter().map(|r| r.lock().unwrap().answered).sum::<usize>();

    for kill in 1..=KILLS {
        // Let the clients get leases (after a restart the proxies are verified again first),
        // then kill at a random point of their work.
        let before = answered();
        let deadline = Instant::now() + Duration::from_secs(30);
        while answered() < before + 20 {
            assert!(Instant::now() < deadline, "no lease operations succeed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(50..1_500))).await;
        eprintln!("kill {kill}: SIGKILL after {} answered operations", answered());
        operator.kill();
        tokio::time::sleep(Duration::from_millis(rng.u64(0..300))).await;
        operator.start();
        operator.wait_serving().await;
    }
    // Some work after the last restart too, then the clients stop.
    let before = answered();
    while answered() < before + 20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.store(false, Ordering::Relaxed);
    for c in clients {
        c.await.expect("a client panicked (see its message above)");
    }

    let records: Vec<Record> = records
        .into_iter()
        .map(|r| std::mem::take(&mut *r.lock().unwrap()))
        .collect();
    let violations = check(&operator, &records).await;
    let (port, token) = (operator.host.api_port, operator.token.clone());
    let held: usize = records.iter().map(|r| r.held.len()).sum();
    let released: usize = records.iter().map(|r| r.released.len()).sum();
    let in_doubt: usize = records
        .iter()
        .map(|r| {
            r.release_in_doubt.len() + r.acquire_in_doubt + r.held.iter().filter(|h| h.token_in_doubt).count()
        })
        .sum();
    eprintln!(
        "lease crash test: {KILLS} kills, {} answered operations, {held} leases held, {released} released, \
         {in_doubt} operations cut off by a kill",
        records.iter().map(|r| r.answered).sum::<usize>()
    );
    assert!(
        violations.is_empty(),
        "seed {seed}: answered lease operations were lost across SIGKILL:\n{}",
        violations.join("\n")
    );
    if durable {
        // The journal's metrics, as docs/operations.md lists them for standalone mode.
        let Answer::Got(StatusCode::OK, _) = try_api(port, &token, "GET", "/healthz", "", TIMEOUT).await
        else {
            panic!("the operator stopped answering");
        };
        let text = standalone::metrics_when(&operator.host, "journal commits", |t| {
            t.contains("epo_lease_journal_commit_batch_records_count")
        })
        .await;
        for name in operations_doc::standalone_only_metrics() {
            assert!(
                text.contains(&name),
                "{name} is documented but not exposed:\n{text}"
            );
        }
    }
    operator.kill();
}

/// Compares the records with the store: listing counts first (no state changes), then each
/// lease by an operation whose answer tells.
async fn check(operator: &Operator, records: &[Record]) -> Vec<String> {
    let port = operator.host.api_port;
    let token = &operator.token;
    let mut violations: Vec<String> = records.iter().flat_map(|r| r.violations.clone()).collect();
    // Per proxy: leases certainly active, and how many more may be.
    let mut certain: BTreeMap<String, usize> = BTreeMap::new();
    let mut maybe: BTreeMap<String, usize> = BTreeMap::new();
    let mut anywhere = 0;
    for r in records {
        for h in &r.held {
            *certain.entry(h.proxy.clone()).or_default() += 1;
        }
        for h in &r.release_in_doubt {
            *maybe.entry(h.proxy.clone()).or_default() += 1;
        }
        anywhere += r.acquire_in_doubt;
    }
    // Proxies are listed once the restarted controller configured them again.
    let deadline = Instant::now() + Duration::from_secs(30);
    let listing = loop {
        match try_api(
            port,
            token,
            "GET",
            "/v1/proxies?selector=pool%3Dcrash",
            "",
            TIMEOUT,
        )
        .await
        {
            Answer::Got(StatusCode::OK, body) if body["proxies"].as_array().map(Vec::len) == Some(3) => {
                break body;
            }
            _ => {
                assert!(Instant::now() < deadline, "the proxies are not listed again");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    for p in listing["proxies"].as_array().expect("proxies") {
        let key = p["key"].as_str().expect("key").to_owned();
        let active = p["activeLeases"].as_u64().expect("activeLeases") as usize;
        let low = certain.get(&key).copied().unwrap_or(0);
        let high = low + maybe.get(&key).copied().unwrap_or(0) + anywhere;
        if !(low..=high).contains(&active) {
            violations.push(format!(
                "{key}: {active} active leases, clients were told of {low} (and up to {} more are in doubt)",
                high - low
            ));
        }
    }
    for r in records {
        for h in &r.held {
            // Renewing with the last token told proves it is active with that token.
            match try_api(
                port,
                token,
                "POST",
                &format!("/v1/leases/{}/renew", h.id),
                &format!(r#"{{"fencingToken":{}}}"#, h.token),
                TIMEOUT,
            )
            .await
            {
                Answer::Got(StatusCode::OK, _) => {}
                Answer::Got(StatusCode::CONFLICT, body) if h.token_in_doubt => {
                    assert_eq!(body["error"]["code"], "stale_token", "{body}");
                }
                other => violations.push(format!(
                    "lease {} on {} (token {}) was acquired and not released, but renewing it answered {other:?}",
                    h.id, h.proxy, h.token
                )),
            }
        }
        for (id, last_token, proxy) in &r.released {
            // A release that came back would be released again (200).
            match try_api(
                port,
                token,
                "POST",
                &format!("/v1/leases/{id}/release"),
                &format!(r#"{{"fencingToken":{last_token},"outcome":"ok"}}"#),
                TIMEOUT,
            )
            .await
            {
                Answer::Got(StatusCode::NOT_FOUND, _) => {}
                other => violations.push(format!(
                    "lease {id} on {proxy} was released (answered 200) but is back: releasing it again answered {other:?}"
                )),
            }
        }
    }
    violations
}
