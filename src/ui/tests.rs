use hyper::HeaderMap;

use super::*;
use crate::{
    health::Verdict,
    lease::Availability,
    machine::audit::AuditEntry,
    outcomes::{Ended, Failure, Seen},
};

/// A deletion asked for shows beside the phase until the phase says it (it read "deleting
/// (deleting)" on the page and in `status`).
#[test]
fn a_requested_deletion_shows_beside_the_phase_once() {
    assert_eq!(phase_label("healthy", false), "healthy");
    assert_eq!(phase_label("degraded", true), "degraded (deleting)");
    assert_eq!(phase_label("deleting", true), "deleting");
}

#[test]
fn ages_read_like_kubectl() {
    let t0 = Timestamp::UNIX_EPOCH;
    let at = |s: i64| Timestamp::from_second(s).unwrap();
    assert_eq!(age(at(42), t0), "42s");
    assert_eq!(age(at(600), t0), "10m");
    assert_eq!(age(at(3 * 3600), t0), "3h");
    assert_eq!(age(at(5 * 86_400), t0), "5d");
}

#[test]
fn a_token_comes_from_bearer_or_the_basic_password() {
    let with = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("header"),
        );
        presented_token(&headers)
    };
    assert_eq!(with("Bearer abc").as_deref(), Some("abc"));
    // "ui:tok:en" — the password may hold a colon; the user name is ignored.
    assert_eq!(with("Basic dWk6dG9rOmVu").as_deref(), Some("tok:en"));
    assert_eq!(with("Basic !!!"), None);
    assert_eq!(with("Digest x"), None);
    assert_eq!(presented_token(&HeaderMap::new()), None);
}

#[test]
fn the_audit_log_keeps_the_last_entries_per_proxy() {
    let log = AuditLog::default();
    let entry = |reason: &str| AuditEntry {
        at: Timestamp::UNIX_EPOCH,
        from: crate::machine::table::Phase::Healthy,
        event: crate::machine::table::Event::HealthFailed,
        to: crate::machine::table::Phase::Degraded,
        guard: Vec::new(),
        effects: Vec::new(),
        reason: reason.to_owned(),
        note: String::new(),
        cause: Some(format!("cause of {reason}")),
    };
    let entries: Vec<_> = (0..AUDIT_ENTRIES_SHOWN + 3)
        .map(|i| entry(&format!("R{i}")))
        .collect();
    log.record("crawl", "web-1", &entries);
    log.record("crawl", "web-2", &entries[..1]);
    let last = log.last("crawl", "web-1", 2);
    let reasons: Vec<_> = last.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            format!("R{}", AUDIT_ENTRIES_SHOWN + 1),
            format!("R{}", AUDIT_ENTRIES_SHOWN + 2)
        ]
    );
    assert_eq!(last[0].message, format!("cause of R{}", AUDIT_ENTRIES_SHOWN + 1));
    assert_eq!(log.last("crawl", "web-1", 100).len(), AUDIT_ENTRIES_SHOWN);
    log.forget("crawl", "web-1");
    assert!(log.last("crawl", "web-1", 100).is_empty());
    assert_eq!(log.last("crawl", "web-2", 100).len(), 1);
}

#[test]
fn user_input_on_the_page_is_escaped_and_every_section_renders() {
    let hostile = "<script>alert(1)</script>";
    let view = StatusView {
        mode: "standalone",
        now: Timestamp::from_second(1_000).expect("time"),
        providers: vec![ProviderRow {
            name: "kvm".to_owned(),
            down_reason: Some(format!("probe failed: {hostile}")),
            proxies: 1,
        }],
        proxies: vec![ProxyRow {
            state: ProxyState {
                namespace: "crawl".to_owned(),
                name: "web-\"1\"".to_owned(),
                provider: "kvm".to_owned(),
                phase: "degraded".to_owned(),
                deleting: true,
                endpoint: Some("10.0.0.7:3128".to_owned()),
                ready: Some(("HealthCheckFailed".to_owned(), hostile.to_owned())),
                created: Some(Timestamp::from_second(400).expect("time")),
                provider_id: None,
            },
            attributes: vec![("pool".to_owned(), hostile.to_owned())],
            leases: Some(LeaseRow {
                availability: Availability::Available,
                active: 1,
                max_concurrent: 2,
                cooldown_until: None,
                bans: vec![(hostile.to_owned(), Timestamp::from_second(1_600).expect("time"))],
                holders: vec![HolderRow {
                    holder: hostile.to_owned(),
                    id_tail: Some("abcd1234".to_owned()),
                    acquired: Timestamp::from_second(940).expect("time"),
                    expires: Timestamp::from_second(1_300).expect("time"),
                    target_domain: Some(hostile.to_owned()),
                }],
            }),
            process: Some(ProcessRow {
                restarts: 2,
                last_restart: Some(Timestamp::from_second(880).expect("time")),
                last_error: Some(hostile.to_owned()),
            }),
            traffic: None,
            health: None,
            health_history: vec![HealthChange {
                at: Timestamp::from_second(900).expect("time"),
                verdict: Verdict::Failing,
                error: Some(hostile.to_owned()),
            }],
            audit: vec![AuditRow {
                at: Timestamp::from_second(900).expect("time"),
                arrow: "healthy --health_failed--> degraded".to_owned(),
                reason: "HealthCheckFailed".to_owned(),
                message: hostile.to_owned(),
            }],
        }],
        total: 1,
        matched: 1,
        phases: BTreeMap::from([("deleting".to_owned(), 1)]),
        active_leases: 1,
        query: PageQuery::default(),
        usage: {
            // A holder is whatever a crawler calls itself.
            let usage = crate::usage::Usage::default();
            let quotas = "quotas:\n  - {token: token-1, requests: 5, period: 1h}\n";
            usage.set_quotas(crate::usage::Quotas::parse(quotas, "q.yaml").expect("quotas"));
            usage
                .admit("token-1", hostile, 1_000_000)
                .expect("within the quota");
            usage.lease_ended("token-1", hostile, 2_500, true);
            UsageView::of(&usage, 1_000_000)
        },
    };
    let html = render::page(&view);
    assert!(!html.contains("<script"), "{html}");
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{html}");
    assert!(html.contains("data-proxy=\"crawl/web-&quot;1&quot;\""), "{html}");
    for shown in [
        "degraded (deleting)",
        "10.0.0.7:3128",
        "unavailable",
        "pool=&lt;script&gt;",
        "1</b> / 2</span> slots",
        "…abcd1234",
        "until 00:26:40 (10m left)",
        "process restarts: <b class=\"restarts\">2</b>, last 00:14:40 (2m ago)",
        "not measured",
        "<meta http-equiv=\"refresh\" content=\"10\">",
        "not probed",
        "healthy --health_failed--&gt; degraded",
        "10m",
        "<code>token-1</code></td><td>1</td><td>0</td><td>2.5</td><td>1</td><td>1 / 5 requests per 1h, resets 1970-01-01T01:00:00Z</td>",
        "the busiest of 1 tokens and 1 holders (at most 5 each)",
    ] {
        assert!(html.contains(shown), "{shown} missing: {html}");
    }
}

#[test]
fn the_query_string_pages_filters_and_says_what_is_wrong() {
    assert_eq!(PageQuery::parse(None).expect("empty"), PageQuery::default());
    let q = PageQuery::parse(Some("page=3&limit=20&phase=healthy&q=pool%3Dui&refresh=0")).expect("valid");
    assert_eq!(
        (q.page, q.limit, q.phase.as_deref(), q.q.as_deref(), q.refresh),
        (3, 20, Some("healthy"), Some("pool=ui"), 0)
    );
    // Links keep the filters and change the page only.
    assert_eq!(
        q.with_page(4),
        "?page=4&limit=20&phase=healthy&q=pool%3Dui&refresh=0"
    );
    assert_eq!(PageQuery::default().with_page(1), "?");
    for (bad, says) in [
        ("page=x", "page must be a whole number"),
        ("limit=0", "limit must be 1-500"),
        ("limit=501", "limit must be a whole number up to 500"),
        ("refresh=1", "refresh must be 0 (off) or 2-3600"),
        ("sort=name", "unknown query parameter \"sort\""),
    ] {
        let err = PageQuery::parse(Some(bad)).expect_err(bad).to_string();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

/// A source of `n` healthy proxies `web-0000`.. (half in pool `a`, half in `b`) and one
/// provisioning one.
struct Fixed(Vec<ProxyState>);

impl ProxySource for Fixed {
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError> {
        Ok(self.0.clone())
    }
    fn audit(&self, _: &str, _: &str, _: usize) -> Vec<AuditRow> {
        Vec::new()
    }
    fn mode(&self) -> &'static str {
        "standalone"
    }
}

#[tokio::test]
async fn the_view_reads_holders_bans_and_attributes_from_the_store_for_one_page() {
    use crate::{
        api::LeasePolicy,
        lease::{AcquireRequest, Admission, LeaseStoreConfig, LeaseTarget, Outcome},
        provider::Endpoint,
    };
    let leases = LeaseStore::new(LeaseStoreConfig::default());
    let mut states = Vec::new();
    for i in 0..120 {
        let name = format!("web-{i:04}");
        let key = ProxyKey::new("crawl", &name);
        leases.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 3000 + i,
            },
            attributes: [("pool".to_owned(), if i % 2 == 0 { "a" } else { "b" }.to_owned())]
                .into_iter()
                .chain((i == 0).then(|| ("tier".to_owned(), "gold".to_owned())))
                .collect(),
            policy: LeasePolicy {
                max_concurrent: 2,
                cooldown_seconds: 0,
                max_ttl_seconds: 600,
            },
            credentials: None,
        });
        leases.set_admission(&key, Admission::Open).expect("open");
        states.push(ProxyState {
            namespace: "crawl".to_owned(),
            name,
            provider: "local".to_owned(),
            phase: if i == 7 { "provisioning" } else { "healthy" }.to_owned(),
            endpoint: Some(format!("127.0.0.1:{}", 3000 + i)),
            ..ProxyState::default()
        });
    }
    // Two leases on web-0000: one released banned for shop.example, one held (its ID kept).
    let only = leases.compile(&Selector::parse("tier=gold").expect("selector"));
    let acquire = |holder: &str, domain: Option<&str>| {
        leases
            .acquire(&AcquireRequest {
                selector: &only,
                holder,
                ttl: std::time::Duration::from_secs(300),
                target_domain: domain,
                session_key: None,
                request_id: None,
            })
            .expect("acquire")
    };
    let banned = acquire("crawler-a", Some("shop.example"));
    assert_eq!(banned.id.key.name(), "web-0000");
    leases
        .release(&banned.id, banned.fencing_token, Outcome::Banned, None)
        .expect("release");
    let held = acquire("crawler-b", Some("news.example"));
    let whole_id = "AAAAwhole-lease-id-never-shown-0123456789abcdef";
    leases.keep_issued_id(&held.id, whole_id);

    let (health, _events) =
        crate::health::HealthEngine::start(crate::health::HealthConfig::default()).expect("health engine");
    // The first proxy carried two requests, one to a domain that is markup.
    let outcomes = Outcomes::default();
    let seen = |ended, ms| Seen {
        ended,
        latency: Some(std::time::Duration::from_millis(ms)),
        bytes_received: 10,
        bytes_sent: 0,
        banned: false,
    };
    let web0 = crate::api::ProxyKey::new("crawl", "web-0000");
    outcomes.record(&web0, "<b>x", &seen(Ended::Status(200), 30), 0);
    outcomes.record(&web0, "<b>x", &seen(Ended::Failed(Failure::Reset), 90), 0);
    let page = StatusPage::new(PageInputs {
        source: Arc::new(Fixed(states)),
        leases,
        health,
        availability: ProviderAvailability::default(),
        providers: Vec::new(),
        auth: Arc::new(crate::discovery::auth::NoAuthentication),
        outcomes,
        usage: Default::default(),
    });
    let view = page.view(&PageQuery::default()).expect("view");
    assert_eq!((view.total, view.matched, view.proxies.len()), (120, 120, 50));
    assert_eq!(view.phases.get("healthy"), Some(&119));
    assert_eq!(view.active_leases, 1);
    let first = &view.proxies[0];
    assert_eq!(
        first.attributes,
        [
            ("pool".to_owned(), "a".to_owned()),
            ("tier".to_owned(), "gold".to_owned())
        ]
    );
    let l = first.leases.as_ref().expect("in rotation");
    assert_eq!(l.bans.len(), 1);
    assert_eq!(l.bans[0].0, "shop.example");
    assert!(l.bans[0].1 > view.now, "the ban ends later");
    assert_eq!(l.holders.len(), 1);
    assert_eq!(l.holders[0].holder, "crawler-b");
    assert_eq!(l.holders[0].id_tail.as_deref(), Some("89abcdef"));
    let html = render::page(&view);
    assert!(!html.contains(whole_id), "the whole lease ID is on the page");
    assert!(html.contains("…89abcdef"), "{html}");
    let token = format!(">{}<", held.fencing_token);
    assert!(!html.contains(&token), "a fencing token on the page");
    // Traffic from the outcome statistics; the domain escaped; unmeasured proxies say so.
    let traffic = first.traffic.as_ref().expect("measured");
    assert_eq!((traffic.requests, traffic.errors, traffic.bans), (2, 1, 0));
    for shown in [
        "2 requests<br>1 error, 0 bans",
        "p50 30 ms, p95 90 ms",
        "1 domain; most: &lt;b&gt;x (2)",
    ] {
        assert!(html.contains(shown), "{shown} missing: {html}");
    }
    assert!(!html.contains("<b>x"), "{html}");
    assert!(view.proxies[1].traffic.is_none());
    assert!(html.contains("not measured"));

    // The last page; a filter by phase; a filter by attribute text.
    let last = page
        .view(&PageQuery {
            page: 9,
            ..PageQuery::default()
        })
        .expect("view");
    assert_eq!((last.query.page, last.proxies.len()), (3, 20));
    assert_eq!(last.proxies[0].state.name, "web-0100");
    let html = render::page(&last);
    assert!(html.contains("rel=\"prev\" href=\"?page=2\""), "{html}");
    assert!(!html.contains("rel=\"next\""), "{html}");
    let provisioning = page
        .view(&PageQuery {
            phase: Some("provisioning".to_owned()),
            ..PageQuery::default()
        })
        .expect("view");
    assert_eq!(provisioning.matched, 1);
    assert_eq!(provisioning.proxies[0].state.name, "web-0007");
    let pool_b = page
        .view(&PageQuery {
            q: Some("POOL=b".to_owned()),
            limit: 500,
            ..PageQuery::default()
        })
        .expect("view");
    assert_eq!(pool_b.matched, 60);
    assert!(pool_b.proxies.iter().all(|p| p.attributes[0].1 == "b"));
}

/// A source that reads slowly, as a state folder of 10,000 records does (~190 ms): it waits
/// for a message another task sends, and says whether it came.
struct Slow {
    go: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    came: std::sync::atomic::AtomicBool,
}

impl ProxySource for Slow {
    fn proxies(&self) -> Result<Vec<ProxyState>, UiError> {
        let go = self.go.lock().expect("one reader");
        let came = go.recv_timeout(std::time::Duration::from_secs(5)).is_ok();
        self.came.store(came, std::sync::atomic::Ordering::SeqCst);
        Ok(Vec::new())
    }
    fn audit(&self, _: &str, _: &str, _: usize) -> Vec<AuditRow> {
        Vec::new()
    }
    fn mode(&self) -> &'static str {
        "standalone"
    }
}

/// Standalone mode reads every record file for a page; on the runtime's thread that stalled
/// every lease request while it read. On a one-thread runtime another task must run meanwhile.
#[tokio::test(flavor = "current_thread")]
async fn the_page_is_gathered_off_the_runtime() {
    let (tx, rx) = std::sync::mpsc::channel();
    let source = Arc::new(Slow {
        go: std::sync::Mutex::new(rx),
        came: std::sync::atomic::AtomicBool::new(false),
    });
    let (health, _events) =
        crate::health::HealthEngine::start(crate::health::HealthConfig::default()).expect("health engine");
    let page = StatusPage::new(PageInputs {
        source: source.clone(),
        leases: LeaseStore::new(crate::lease::LeaseStoreConfig::default()),
        health,
        availability: ProviderAvailability::default(),
        providers: Vec::new(),
        auth: Arc::new(crate::discovery::auth::NoAuthentication),
        outcomes: Outcomes::default(),
        usage: Default::default(),
    });
    let other = tokio::spawn(async move { tx.send(()).expect("the source waits") });
    let response = page.respond(&HeaderMap::new(), None).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        source.came.load(std::sync::atomic::Ordering::SeqCst),
        "the page was gathered on the runtime's thread: no other task ran meanwhile"
    );
    other.await.expect("the other task ends");
}
