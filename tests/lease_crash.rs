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
//!
//! The chaos test (issue 18 part 4) adds Squid kills to operator kills, bounded (about a
//! minute) and seeded (`EPO_CHAOS_SEED=N` replays), and checks at the end: one Squid per
//! manifest, no answered operation lost, never more leases held by clients at once on a proxy
//! than its `maxConcurrent`, fencing tokens increasing across restarts, and every proxy healthy
//! and leasable again within [`CONVERGENCE`] of the last fault.

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
    /// A renewal was sent and not answered: the token may be this one or a newer one. The
    /// client asks again with this token before it uses the lease for anything else.
    token_in_doubt: bool,
}

/// What all clients were told, as it happened: leases held at each moment (for over-leasing)
/// and the tokens each operator process issued (for their order across restarts).
struct Ledger {
    /// Operator processes so far: bumped at each kill, before the restart.
    epoch: std::sync::atomic::AtomicUsize,
    max_concurrent: usize,
    inner: Mutex<LedgerInner>,
}

#[derive(Default)]
struct LedgerInner {
    /// Leases clients hold, by ID: proxy and an expiry no later than the operator's.
    held: BTreeMap<String, (String, Instant)>,
    /// Per (proxy, epoch): lowest and highest token answered to a request sent in that epoch.
    tokens: BTreeMap<(String, usize), (u64, u64)>,
    violations: Vec<String>,
}

impl Ledger {
    fn new(max_concurrent: usize) -> Self {
        Self {
            epoch: Default::default(),
            max_concurrent,
            inner: Default::default(),
        }
    }

    fn epoch(&self) -> usize {
        self.epoch.load(Ordering::SeqCst)
    }

    fn token(&self, inner: &mut LedgerInner, proxy: &str, token: u64, sent_in: usize) {
        // Answered by the process the request was sent to (a kill ends its connections).
        if sent_in == self.epoch() {
            let e = inner
                .tokens
                .entry((proxy.to_owned(), sent_in))
                .or_insert((token, token));
            e.0 = e.0.min(token);
            e.1 = e.1.max(token);
        }
    }

    fn acquired(&self, id: &str, proxy: &str, token: u64, sent_in: usize, until: Instant) {
        let mut inner = self.inner.lock().unwrap();
        self.token(&mut inner, proxy, token, sent_in);
        inner.held.insert(id.to_owned(), (proxy.to_owned(), until));
        let now = Instant::now();
        let holders = inner
            .held
            .values()
            .filter(|(p, u)| p == proxy && *u > now)
            .count();
        if holders > self.max_concurrent {
            inner.violations.push(format!(
                "over-lease: clients hold {holders} leases on {proxy} at once (maxConcurrent {})",
                self.max_concurrent
            ));
        }
    }

    fn renewed(&self, id: &str, proxy: &str, token: u64, sent_in: usize, until: Instant) {
        let mut inner = self.inner.lock().unwrap();
        self.token(&mut inner, proxy, token, sent_in);
        if let Some(held) = inner.held.get_mut(id) {
            held.1 = until;
        }
    }

    fn released(&self, id: &str) {
        self.inner.lock().unwrap().held.remove(id);
    }

    /// Over-leases seen, and any token of a process not above every token of the processes
    /// before it, per proxy.
    fn violations(&self) -> Vec<String> {
        let inner = self.inner.lock().unwrap();
        let mut out = inner.violations.clone();
        let mut highest_before: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
        for ((proxy, epoch), (low, high)) in &inner.tokens {
            if let Some((earlier, max)) = highest_before.get(proxy.as_str())
                && low <= max
            {
                out.push(format!(
                    "fencing tokens went back on {proxy}: process {epoch} issued {low}, process {earlier} had issued {max}"
                ));
            }
            let entry = highest_before.entry(proxy).or_insert((*epoch, *high));
            if *high > entry.1 {
                *entry = (*epoch, *high);
            }
        }
        out
    }

    /// Processes that issued tokens, per proxy (to show the check had something to compare).
    fn epochs_with_tokens(&self) -> usize {
        let inner = self.inner.lock().unwrap();
        inner
            .tokens
            .keys()
            .map(|(_, e)| *e)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    }
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
    /// Acquires sent and not answered, by request ID: a lease the client does not know may
    /// exist, anywhere, until the acquire is sent again with its request ID (or its TTL ends).
    acquires_in_doubt: Vec<String>,
    /// Leases whose lost renewal turned out to have happened (asking again answered
    /// `stale_token`): active with a token the client never learnt, until their TTL ends.
    abandoned: Vec<Held>,
    /// The last answer that was neither a success nor in doubt (for a stalled run's message).
    last_refusal: Option<String>,
    /// Operations answered with a success.
    answered: usize,
    /// Operations whose answer left them in doubt (a kill cut them off), settled or not.
    cut_off: usize,
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
    /// It did not happen (nothing listened, or no proxy available yet after a restart): why.
    Nothing(String),
    /// 409 `stale_token`: the lease has a newer token than the one sent.
    Stale,
    /// 404 `lease_not_found`: the lease is not active.
    NotFound,
    /// Anything else.
    Unexpected(String),
}

impl Told {
    fn describe(self) -> String {
        match self {
            Told::Done(body) => format!("success: {body}"),
            Told::InDoubt => "no answer".to_owned(),
            Told::Nothing(why) => why,
            Told::Stale => "stale_token".to_owned(),
            Told::NotFound => "lease_not_found".to_owned(),
            Told::Unexpected(what) => what,
        }
    }
}

fn told(answer: Answer, success: StatusCode) -> Told {
    match answer {
        Answer::Got(status, body) if status == success => Told::Done(body),
        Answer::Refused => Told::Nothing("connection refused".to_owned()),
        Answer::Got(StatusCode::SERVICE_UNAVAILABLE, body)
            if body["error"]["code"] == "no_proxy_available" =>
        {
            Told::Nothing(body.to_string())
        }
        Answer::Got(StatusCode::CONFLICT, body) if body["error"]["code"] == "stale_token" => Told::Stale,
        Answer::Got(StatusCode::NOT_FOUND, body) if body["error"]["code"] == "lease_not_found" => {
            Told::NotFound
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

/// TTL of the clients' leases: what bounds a lease a kill made the client lose track of (a
/// renewal that happened but whose answer was lost), as it does for a real crawler. Shorter
/// than the chaos test waits for progress after its last fault, so slots lost that way are
/// free again by then; far longer than a held lease goes untouched. (An acquire whose answer
/// was lost is settled by sending it again with its request ID.)
const TTL: Duration = Duration::from_secs(30);

/// What the client does next.
enum Step {
    /// An acquire with this request ID: a new one, or one whose answer was lost, sent again
    /// (the API then answers the lease it was granted, if it was).
    Acquire(String),
    Renew(Held),
    Release(Held),
    /// Asks again, with the token it knows, whether a renewal that got no answer happened.
    ResolveRenewal(Held),
    /// Releases again a lease whose release got no answer (404 then means the first did it).
    ResolveRelease(Held),
}

/// A crawler: acquires (holding at most `max_held` leases), renews and releases at random,
/// recording what it is told. An operation cut off by a kill is settled first, where the API
/// allows it, as a careful crawler would.
async fn client(
    port: u16,
    token: String,
    seed: u64,
    running: Arc<AtomicBool>,
    record: Arc<Mutex<Record>>,
    ledger: Arc<Ledger>,
    (pool, max_held): (&'static str, usize),
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut acquires = 0u64;
    // Once told to stop, a client still settles the acquires it has in doubt (bounded).
    let mut stopping_since: Option<Instant> = None;
    loop {
        if !running.load(Ordering::Relaxed) {
            let since = *stopping_since.get_or_insert_with(Instant::now);
            if record.lock().unwrap().acquires_in_doubt.is_empty() || since.elapsed() > TIMEOUT * 2 {
                break;
            }
        }
        let step = {
            let r = record.lock().unwrap();
            let usable: Vec<Held> = r.held.iter().filter(|h| !h.token_in_doubt).cloned().collect();
            if let Some(request_id) = r.acquires_in_doubt.first() {
                Step::Acquire(request_id.clone())
            } else if let Some(h) = r.held.iter().find(|h| h.token_in_doubt) {
                Step::ResolveRenewal(h.clone())
            } else if let Some(h) = r.release_in_doubt.first() {
                Step::ResolveRelease(h.clone())
            } else if usable.is_empty() || (usable.len() < max_held && rng.bool()) {
                acquires += 1;
                Step::Acquire(format!("{seed}-{acquires}"))
            } else if rng.bool() {
                Step::Renew(usable[rng.usize(..usable.len())].clone())
            } else {
                Step::Release(usable[rng.usize(..usable.len())].clone())
            }
        };
        let sent_in = ledger.epoch();
        let until = Instant::now() + TTL;
        match step {
            Step::Acquire(request_id) => {
                let body = format!(
                    r#"{{"holder":"crash-test","selector":{{"pool":"{pool}"}},"ttlSeconds":{},"requestId":"{request_id}"}}"#,
                    TTL.as_secs()
                );
                let answer = try_api(port, &token, "POST", "/v1/leases", &body, TIMEOUT).await;
                // Nothing listened: says nothing about an earlier attempt.
                let refused = matches!(answer, Answer::Refused);
                let mut r = record.lock().unwrap();
                let settled = |r: &mut Record| r.acquires_in_doubt.retain(|id| *id != request_id);
                match told(answer, StatusCode::CREATED) {
                    Told::Done(body) => {
                        settled(&mut r);
                        r.answered += 1;
                        let held = Held {
                            id: body["leaseId"].as_str().expect("leaseId").to_owned(),
                            proxy: body["proxy"]["key"].as_str().expect("proxy key").to_owned(),
                            token: body["fencingToken"].as_u64().expect("token"),
                            token_in_doubt: false,
                        };
                        ledger.acquired(&held.id, &held.proxy, held.token, sent_in, until);
                        r.held.push(held);
                    }
                    Told::InDoubt => {
                        if !r.acquires_in_doubt.contains(&request_id) {
                            r.acquires_in_doubt.push(request_id.clone());
                        }
                        r.cut_off += 1;
                    }
                    // Nothing was granted for this request ID (a lost first one would have
                    // been answered again): settled.
                    Told::Nothing(why) => {
                        if !refused {
                            settled(&mut r);
                        }
                        r.last_refusal = Some(format!("acquire: {why}"));
                    }
                    other => r
                        .violations
                        .push(format!("an acquire answered {}", other.describe())),
                }
            }
            Step::Renew(lease) | Step::ResolveRenewal(lease) => {
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
                let Some(at) = r.held.iter().position(|h| h.id == lease.id) else {
                    unreachable!("only this client's task changes its held leases");
                };
                match told(answer, StatusCode::OK) {
                    Told::Done(body) => {
                        let held = &mut r.held[at];
                        held.token = body["fencingToken"].as_u64().expect("token");
                        held.token_in_doubt = false;
                        ledger.renewed(&held.id, &held.proxy, held.token, sent_in, until);
                        r.answered += 1;
                    }
                    Told::InDoubt => {
                        r.held[at].token_in_doubt = true;
                        r.cut_off += 1;
                    }
                    Told::Nothing(why) => r.last_refusal = Some(format!("renew: {why}")),
                    // The renewal cut off earlier did happen: the lease's token is one the
                    // client never learnt, so it can only let the lease run out.
                    Told::Stale if lease.token_in_doubt => {
                        let held = r.held.remove(at);
                        ledger.released(&held.id);
                        r.abandoned.push(held);
                    }
                    // A lost lease shows here first (404), or a lost renewal (409).
                    other => r
                        .violations
                        .push(format!("renewing {lease:?} answered {}", other.describe())),
                }
            }
            Step::Release(lease) | Step::ResolveRelease(lease) => {
                // The client stops using the lease when it asks to end it; the store frees
                // the slot only after that (not counted again if nothing happened: an undercount).
                ledger.released(&lease.id);
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
                let retry = r.release_in_doubt.iter().any(|h| h.id == lease.id);
                let gone = match told(answer, StatusCode::OK) {
                    Told::Done(_) => {
                        r.answered += 1;
                        true
                    }
                    // Asked again: the release cut off earlier did happen.
                    Told::NotFound if retry => true,
                    Told::InDoubt => {
                        r.cut_off += 1;
                        if !retry {
                            r.held.retain(|h| h.id != lease.id);
                            r.release_in_doubt.push(lease.clone());
                        }
                        false
                    }
                    Told::Nothing(why) => {
                        r.last_refusal = Some(format!("release: {why}"));
                        false
                    }
                    other => {
                        // Counted as a violation; the record stops relying on this lease.
                        let what = other.describe();
                        r.held.retain(|h| h.id != lease.id);
                        r.release_in_doubt.retain(|h| h.id != lease.id);
                        r.violations.push(format!("releasing {lease:?} answered {what}"));
                        false
                    }
                };
                if gone {
                    r.held.retain(|h| h.id != lease.id);
                    r.release_in_doubt.retain(|h| h.id != lease.id);
                    r.released.push((lease.id, lease.token, lease.proxy));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(2..15))).await;
    }
}

/// The operator with proxies in one pool and the clients leasing from them.
struct Scenario {
    operator: Operator,
    pool: &'static str,
    _origin: Origin,
    running: Arc<AtomicBool>,
    records: Vec<Arc<Mutex<Record>>>,
    clients: Vec<tokio::task::JoinHandle<()>>,
    ledger: Arc<Ledger>,
    rng: fastrand::Rng,
}

impl Scenario {
    /// `PROXIES` in pool `pool` with `max_concurrent` slots each, the operator with `extra`
    /// arguments, and `CLIENTS` clients holding at most `max_held` leases each.
    async fn start(
        seed: u64,
        pool: &'static str,
        max_concurrent: usize,
        max_held: usize,
        extra: Vec<&'static str>,
    ) -> Self {
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
                    &[("pool", pool), ("name", name)],
                    &[("maxConcurrent", max_concurrent as u32), ("cooldownSeconds", 0)],
                ),
            );
        }
        let mut operator = Operator {
            token: String::new(),
            host,
            extra,
            child: None,
            starts: 0,
        };
        operator.start();
        wait_status(&operator.host, "every proxy healthy", |t| {
            healthy_rows(t) == PROXIES.len()
        })
        .await;
        operator.token = operator.host.token();
        let running = Arc::new(AtomicBool::new(true));
        let ledger = Arc::new(Ledger::new(max_concurrent));
        let records: Vec<Arc<Mutex<Record>>> = (0..CLIENTS).map(|_| Arc::default()).collect();
        let clients = records
            .iter()
            .enumerate()
            .map(|(i, record)| {
                tokio::spawn(client(
                    operator.host.api_port,
                    operator.token.clone(),
                    seed.wrapping_add(1 + i as u64),
                    running.clone(),
                    record.clone(),
                    ledger.clone(),
                    (pool, max_held),
                ))
            })
            .collect();
        Scenario {
            operator,
            pool,
            _origin: origin,
            running,
            records,
            clients,
            ledger,
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    fn answered(&self) -> usize {
        self.records.iter().map(|r| r.lock().unwrap().answered).sum()
    }

    /// Waits until the clients got `n` more answers (bounded).
    async fn progress(&self, n: usize) {
        let before = self.answered();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.answered() < before + n {
            assert!(
                Instant::now() < deadline,
                "no lease operations succeed; what the clients hold and were last refused:\n{}",
                self.records
                    .iter()
                    .map(|r| {
                        let r = r.lock().unwrap();
                        format!(
                            "{} held ({} with a renewal in doubt), {} releases and {} acquires in doubt, {} abandoned; last refusal: {:?}",
                            r.held.len(),
                            r.held.iter().filter(|h| h.token_in_doubt).count(),
                            r.release_in_doubt.len(),
                            r.acquires_in_doubt.len(),
                            r.abandoned.len(),
                            r.last_refusal
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, a random pause, a restart; returns once the API answers again.
    async fn kill_operator(&mut self) {
        self.ledger.epoch.fetch_add(1, Ordering::SeqCst);
        self.operator.kill();
        tokio::time::sleep(Duration::from_millis(self.rng.u64(0..300))).await;
        self.operator.start();
        self.operator.wait_serving().await;
    }

    /// Stops the clients and checks their records against the store and the ledger.
    async fn stop_and_check(&mut self) -> (Vec<Record>, Vec<String>) {
        self.running.store(false, Ordering::Relaxed);
        for c in self.clients.drain(..) {
            c.await.expect("a client panicked (see its message above)");
        }
        let records: Vec<Record> = self
            .records
            .iter()
            .map(|r| std::mem::take(&mut *r.lock().unwrap()))
            .collect();
        let mut violations = check(&self.operator, self.pool, &records).await;
        violations.extend(self.ledger.violations());
        // With a request ID an acquire whose answer was lost is settled by sending it again.
        let unsettled: Vec<&String> = records.iter().flat_map(|r| &r.acquires_in_doubt).collect();
        if !unsettled.is_empty() {
            violations.push(format!(
                "acquires cut off by a kill and never settled by sending them again: {unsettled:?}"
            ));
        }
        let held: usize = records.iter().map(|r| r.held.len()).sum();
        let released: usize = records.iter().map(|r| r.released.len()).sum();
        let cut_off: usize = records.iter().map(|r| r.cut_off).sum();
        let unsettled: usize = records
            .iter()
            .map(|r| {
                r.release_in_doubt.len()
                    + r.acquires_in_doubt.len()
                    + r.abandoned.len()
                    + r.held.iter().filter(|h| h.token_in_doubt).count()
            })
            .sum();
        eprintln!(
            "{} answered operations, {held} leases held at the end, {released} released, {cut_off} operations \
             cut off by a kill ({unsettled} left to their TTL); tokens compared across {} operator processes",
            records.iter().map(|r| r.answered).sum::<usize>(),
            self.ledger.epochs_with_tokens()
        );
        (records, violations)
    }
}

fn seed_from(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..1_000_000))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_answered_lease_operation_is_lost_across_sigkills() {
    let seed = seed_from("EPO_CRASH_SEED");
    let durable = std::env::var("EPO_CRASH_NO_DURABILITY").is_err();
    eprintln!("lease crash test: seed {seed} (EPO_CRASH_SEED={seed} replays it), durability {durable}");
    let extra = if durable {
        vec![]
    } else {
        vec!["--no-durable-leases"]
    };
    let mut run = Scenario::start(seed, "crash", 40, 3, extra).await;
    for kill in 1..=KILLS {
        // Let the clients get leases (after a restart the proxies are verified again first),
        // then kill at a random point of their work.
        run.progress(20).await;
        let pause = run.rng.u64(50..1_500);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        eprintln!(
            "kill {kill}: SIGKILL after {} answered operations",
            run.answered()
        );
        run.kill_operator().await;
    }
    // Some work after the last restart too, then the clients stop.
    run.progress(20).await;
    let (_, violations) = run.stop_and_check().await;
    assert!(
        violations.is_empty(),
        "seed {seed}: answered lease operations were lost across SIGKILL:\n{}",
        violations.join("\n")
    );
    if durable {
        // The journal's metrics, as docs/operations.md lists them for standalone mode.
        let text = standalone::metrics_when(&run.operator.host, "journal commits", |t| {
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
    run.operator.kill();
}

/// How long after the last fault every proxy must be healthy and leasable again: the local
/// provider's supervisor restarts a dead Squid within its pass (2 s, longer with its backoff
/// after repeated deaths), and health checks every 2 s need one pass to call it healthy.
const CONVERGENCE: Duration = Duration::from_secs(30);
/// How long convergence must hold to count.
const STABLE: Duration = Duration::from_secs(6);
/// How long faults are injected.
const CHAOS: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_operator_and_squid_kills_under_leasing() {
    let seed = seed_from("EPO_CHAOS_SEED");
    eprintln!("chaos test: seed {seed} (EPO_CHAOS_SEED={seed} replays it)");
    // Three slots per proxy and clients wanting up to two leases each: slots run out, so
    // over-leasing would show.
    // A journal window other than the default: group commit waits longer for its batch, and
    // nothing answered may be lost either way.
    let mut run = Scenario::start(seed, "chaos", 3, 2, vec!["--lease-journal-window-ms", "3"]).await;
    let root = run.operator.host.path().to_owned();
    let started = Instant::now();
    let (mut operator_kills, mut squid_kills) = (0, 0);
    while started.elapsed() < CHAOS {
        tokio::time::sleep(Duration::from_millis(run.rng.u64(300..2_500))).await;
        if run.rng.u8(..10) < 4 {
            operator_kills += 1;
            eprintln!(
                "chaos {:>5.1} s: SIGKILL the operator",
                started.elapsed().as_secs_f64()
            );
            run.kill_operator().await;
        } else {
            let pids = standalone::squids(&root);
            if pids.is_empty() {
                continue;
            }
            let pid = pids[run.rng.usize(..pids.len())];
            squid_kills += 1;
            eprintln!(
                "chaos {:>5.1} s: SIGKILL Squid {pid}",
                started.elapsed().as_secs_f64()
            );
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid).expect("pid"),
                rustix::process::Signal::KILL,
            );
        }
    }
    let last_fault = Instant::now();
    eprintln!(
        "chaos: {operator_kills} operator kills, {squid_kills} Squid kills in {:.0} s",
        CHAOS.as_secs_f64()
    );

    // Convergence: every proxy healthy and open for leases again, and staying so for longer
    // than a dead Squid takes to be noticed (two failed probes 2 s apart).
    let port = run.operator.host.api_port;
    let token = run.operator.token.clone();
    let mut good_since: Option<Instant> = None;
    loop {
        let healthy =
            healthy_rows(&standalone::try_status(&run.operator.host).unwrap_or_default()) == PROXIES.len();
        let open = match try_api(
            port,
            &token,
            "GET",
            "/v1/proxies?selector=pool%3Dchaos",
            "",
            TIMEOUT,
        )
        .await
        {
            Answer::Got(StatusCode::OK, body) => body["proxies"].as_array().is_some_and(|ps| {
                ps.len() == PROXIES.len()
                    && ps
                        .iter()
                        .all(|p| matches!(p["availability"].as_str(), Some("available" | "busy")))
            }),
            _ => false,
        };
        if healthy && open {
            let since = *good_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= STABLE {
                break;
            }
        } else {
            good_since = None;
        }
        assert!(
            last_fault.elapsed() < CONVERGENCE + STABLE,
            "seed {seed}: not converged within {CONVERGENCE:?} of the last fault:\n{}",
            standalone::try_status(&run.operator.host).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let converged = good_since.expect("converged") - last_fault;
    eprintln!(
        "chaos: every proxy healthy and leasable {:.1} s after the last fault, and still {} s later (bound {} s)",
        converged.as_secs_f64(),
        STABLE.as_secs(),
        CONVERGENCE.as_secs()
    );
    assert!(
        converged <= CONVERGENCE,
        "seed {seed}: converged only after {converged:?}"
    );
    run.progress(20).await;

    let (_, mut violations) = run.stop_and_check().await;
    // One Squid per manifest: none leaked, none doubled.
    let pids = standalone::squids(&root);
    for name in PROXIES {
        let mine = pids
            .iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&format!("epo-default-{name}-")))
            })
            .count();
        if mine != 1 {
            violations.push(format!("{mine} Squids run for manifest {name}"));
        }
    }
    if pids.len() != PROXIES.len() {
        violations.push(format!(
            "{} Squids run for {} manifests: {pids:?}",
            pids.len(),
            PROXIES.len()
        ));
    }
    assert!(
        violations.is_empty(),
        "seed {seed}: chaos broke invariants:\n{}",
        violations.join("\n")
    );
    run.operator.kill();
}

/// Compares the records with the store: listing counts first (no state changes), then each
/// lease by an operation whose answer tells.
async fn check(operator: &Operator, pool: &str, records: &[Record]) -> Vec<String> {
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
        for h in r.release_in_doubt.iter().chain(&r.abandoned) {
            *maybe.entry(h.proxy.clone()).or_default() += 1;
        }
        anywhere += r.acquires_in_doubt.len();
    }
    // Proxies are listed once the restarted controller configured them again.
    let deadline = Instant::now() + Duration::from_secs(30);
    let listing = loop {
        match try_api(
            port,
            token,
            "GET",
            &format!("/v1/proxies?selector=pool%3D{pool}"),
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
