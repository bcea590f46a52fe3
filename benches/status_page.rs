//! The status page (`GET /ui`) at 10,000 proxies: time to gather the view and render the HTML,
//! and the bytes sent, for the default page (50 proxies), a filtered page, a late page, and the
//! baseline measured in the same run: every proxy on one page, as the page was before paging.
//! The store holds 10,000 proxies with attributes, 2,000 active leases (their IDs kept) and 500
//! bans; the source gives each proxy three audit rows. Run: `cargo bench --bench status_page`;
//! `EPO_BENCH_PROXIES` changes the pool size, `EPO_BENCH_ROUNDS` the rounds per case (the
//! median is printed).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use egress_proxies_operator::{
    api::{LeasePolicy, ProxyKey},
    controller::ProviderAvailability,
    discovery::auth::NoAuthentication,
    health::{HealthConfig, HealthEngine},
    lease::{AcquireRequest, Admission, LeaseStore, LeaseStoreConfig, LeaseTarget, Outcome, Selector},
    provider::Endpoint,
    ui::{self, AuditRow, PageInputs, PageQuery, ProxySource, ProxyState, StatusPage, UiError},
};
use jiff::Timestamp;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Every proxy, with three audit rows each (what a mode's source gives).
struct Pool {
    proxies: Vec<ProxyState>,
    audit: Vec<AuditRow>,
}

impl ProxySource for Pool {
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError> {
        Ok(self.proxies.clone())
    }
    fn audit(&self, _: &str, _: &str, n: usize) -> Vec<AuditRow> {
        self.audit.iter().take(n).cloned().collect()
    }
    fn mode(&self) -> &'static str {
        "standalone"
    }
}

fn name(i: usize) -> String {
    format!("web-{i:05}")
}

fn page(n: usize) -> StatusPage {
    let leases = LeaseStore::new(LeaseStoreConfig::default());
    let mut proxies = Vec::with_capacity(n);
    let now = Timestamp::now();
    for i in 0..n {
        let key = ProxyKey::new("crawl", &name(i));
        let port = u16::try_from(10_000 + i % 50_000).expect("port");
        leases.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: "10.0.0.1".into(),
                port,
            },
            attributes: [
                ("pool".to_owned(), format!("p{}", i % 10)),
                ("region".to_owned(), format!("r{}", i % 4)),
                ("id".to_owned(), i.to_string()),
            ]
            .into_iter()
            .collect(),
            policy: LeasePolicy {
                max_concurrent: 2,
                cooldown_seconds: 0,
                max_ttl_seconds: 600,
            },
            credentials: None,
        });
        leases.set_admission(&key, Admission::Open).expect("open");
        proxies.push(ProxyState {
            namespace: "crawl".to_owned(),
            name: name(i),
            provider: "local".to_owned(),
            phase: if i % 100 == 0 { "degraded" } else { "healthy" }.to_owned(),
            endpoint: Some(format!("10.0.0.1:{port}")),
            ready: Some(("Healthy".to_owned(), "health checks pass".to_owned())),
            created: Some(now),
            ..ProxyState::default()
        });
    }
    // Leases on every fifth proxy, bans on every twentieth (a ban is a release `banned`).
    for i in (0..n).step_by(5) {
        let selector = leases.compile(&Selector::parse(&format!("id={i}")).expect("selector"));
        let acquire = |domain| {
            leases
                .acquire(&AcquireRequest {
                    selector: &selector,
                    holder: "crawler-bench",
                    ttl: Duration::from_secs(300),
                    target_domain: Some(domain),
                    session_key: None,
                    request_id: None,
                })
                .expect("acquire")
        };
        if i % 20 == 0 {
            let lease = acquire("banned.example");
            leases
                .release(&lease.id, lease.fencing_token, Outcome::Banned, None)
                .expect("release");
        }
        let lease = acquire("shop.example");
        leases.keep_issued_id(&lease.id, &format!("AQAC{i:0>60}"));
    }
    let audit = ["ProvisioningStarted", "InstanceCreated", "Healthy"]
        .iter()
        .map(|reason| AuditRow {
            at: now,
            arrow: "provisioning --health_passed--> healthy".to_owned(),
            reason: (*reason).to_owned(),
            message: String::new(),
        })
        .collect();
    let (health, _events) = HealthEngine::start(HealthConfig::default()).expect("health engine");
    StatusPage::new(PageInputs {
        source: Arc::new(Pool { proxies, audit }),
        leases,
        health,
        availability: ProviderAvailability::default(),
        providers: Vec::new(),
        auth: Arc::new(NoAuthentication),
        outcomes: Default::default(),
        usage: Default::default(),
    })
}

/// Median gather and render times and the page's size for `query`.
fn measure(page: &StatusPage, query: &PageQuery, rounds: usize) -> (Duration, Duration, usize, usize) {
    let mut gathers = Vec::with_capacity(rounds);
    let mut renders = Vec::with_capacity(rounds);
    let mut bytes = 0;
    let mut rows = 0;
    for _ in 0..rounds {
        let started = Instant::now();
        let view = page.view(query).expect("view");
        let gathered = Instant::now();
        let html = ui::render(&view);
        renders.push(gathered.elapsed());
        gathers.push(gathered - started);
        bytes = html.len();
        rows = view.proxies.len();
        std::hint::black_box(html);
    }
    gathers.sort();
    renders.sort();
    (gathers[rounds / 2], renders[rounds / 2], bytes, rows)
}

fn main() {
    let n = env("EPO_BENCH_PROXIES", 10_000);
    let rounds = env("EPO_BENCH_ROUNDS", 15).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = runtime.enter();
    let built = Instant::now();
    let page = page(n);
    println!(
        "status page over {n} proxies (store, leases and bans built in {:.1} s), median of {rounds} rounds:",
        built.elapsed().as_secs_f64()
    );
    let cases = [
        (
            "baseline: every proxy on one page",
            PageQuery {
                limit: n,
                ..PageQuery::default()
            },
        ),
        ("default page (?)", PageQuery::default()),
        (
            "?page=100",
            PageQuery {
                page: 100,
                ..PageQuery::default()
            },
        ),
        (
            "?phase=degraded",
            PageQuery {
                phase: Some("degraded".to_owned()),
                ..PageQuery::default()
            },
        ),
        (
            "?q=pool=p3&limit=500",
            PageQuery {
                q: Some("pool=p3".to_owned()),
                limit: 500,
                ..PageQuery::default()
            },
        ),
    ];
    println!(
        "{:<36} {:>6} {:>11} {:>11} {:>11} {:>12}",
        "case", "rows", "gather_ms", "render_ms", "total_ms", "bytes"
    );
    let mut baseline = None;
    for (label, query) in &cases {
        let (gather, render, bytes, rows) = measure(&page, query, rounds);
        let total = gather + render;
        let share = baseline.map_or_else(String::new, |(t, b): (Duration, usize)| {
            format!(
                "  ({:.1}% of baseline time, {:.2}% of its bytes)",
                100.0 * total.as_secs_f64() / t.as_secs_f64(),
                100.0 * bytes as f64 / b as f64
            )
        });
        println!(
            "{label:<36} {rows:>6} {:>11.2} {:>11.2} {:>11.2} {bytes:>12}{share}",
            gather.as_secs_f64() * 1e3,
            render.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e3,
        );
        if baseline.is_none() {
            baseline = Some((total, bytes));
        }
    }
}
