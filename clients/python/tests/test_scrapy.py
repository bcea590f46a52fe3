"""Real Scrapy crawls of a local site through proxies leased by the middleware, checked in
Squid's access logs and against the discovery API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

import pytest

from egress_proxies import DiscoveryClient, Lease, NoProxyAvailable
from conftest import BANNING_HOST, AccessLogs, Site, assert_no_active_lease

CRAWL = Path(__file__).with_name("crawl.py")


Crawl = Callable[..., Dict[str, Any]]


@pytest.fixture
def crawl(tmp_path: Path, api_url: str, token: str, selector: Dict[str, str], site: Site) -> Crawl:
    """Runs crawl.py on ``site`` with the middleware set up for the test's proxies; returns
    the crawl's pages and stats. Keyword arguments: ``settings`` (more Scrapy settings) and
    crawl.py's config (``start_urls``, default the site's root; ``allowed_domains``, ``session``,
    ``sessions``); ``errors_expected`` allows errors in Scrapy's log."""

    def run(settings: Optional[Dict[str, Any]] = None, errors_expected: bool = False, **config: Any) -> Dict[str, Any]:
        config["settings"] = {
            "EGRESS_PROXIES_URL": api_url,
            "EGRESS_PROXIES_TOKEN": token,
            "EGRESS_PROXIES_SELECTOR": selector,
            **(settings or {}),
        }
        config.setdefault("start_urls", [site.url("/")])
        config_path, result_path = tmp_path / "crawl.json", tmp_path / "result.json"
        config_path.write_text(json.dumps(config))
        done = subprocess.run(
            [sys.executable, str(CRAWL), str(config_path), str(result_path)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        print(done.stderr[-20000:])
        assert done.returncode == 0, done.stderr[-5000:]
        assert errors_expected or "ERROR" not in done.stderr, "the crawl logged errors"
        # No warning at all, from Scrapy about this package (ScrapyDeprecationWarning) or from
        # the package itself: Python's warnings reach Scrapy's log as "py.warnings".
        assert "py.warnings" not in done.stderr and "Warning:" not in done.stderr, done.stderr[-5000:]
        assert os.environ["EPO_PROXY_PASSWORD"] not in done.stderr, "the proxy password is in the crawl's log"
        result: Dict[str, Any] = json.loads(result_path.read_text())
        result["log"] = done.stderr
        return result

    return run


def assert_every_page_went_through_its_proxy(pages: List[Dict[str, Any]], site: Site, access_logs: AccessLogs) -> None:
    """Each response came through the Squid of its lease (that Squid logged the URL with the
    status, and the user of the proxy credentials Scrapy presented), and the site answered
    nothing that no Squid logged."""
    user = os.environ["EPO_PROXY_USER"]
    lines = access_logs.wait_for(len(site.served), f":{site.port}/")
    for page in pages:
        assert page["proxy"] in lines, f"{page['url']} was not fetched through a leased proxy: {page}"
        logged = [l for l in lines[page["proxy"]] if l[2] == page["url"]]
        assert len(logged) == 1, f"{page['url']} not in {page['proxy']}'s access log: {lines}"
        assert logged[0][0].endswith(f"/{page['status']}"), logged
        assert logged[0][3] == user, f"Squid saw no credentials: {logged}"
    assert sum(map(len, lines.values())) == len(site.served) == len(pages), (lines, site.served, pages)


def drain(client: DiscoveryClient, selector: Dict[str, str], domain: str) -> Set[str]:
    """Every proxy a crawler of ``domain`` can lease now (waiting out 1 s cooldowns), released."""
    held: List[Lease] = []
    try:
        while True:
            held.append(client.acquire(selector, target_domain=domain, max_wait=3))
    except NoProxyAvailable:
        pass
    finally:
        for lease in held:
            client.release(lease, "ok")
    return {lease.proxy.endpoint for lease in held}


def test_domain_mode_bans_the_proxy_for_the_banning_domain_only(
    crawl: Crawl, selector: Dict[str, str], client: DiscoveryClient, site: Site, access_logs: AccessLogs
) -> None:
    # TTL 2 s and a page that takes 2.5 s: the domain's lease lives on renewals alone. The
    # banning host bans every proxy: no ban retries, so one ban is all this crawl makes.
    result = crawl(settings={"EGRESS_PROXIES_TTL": 2, "EGRESS_PROXIES_BAN_RETRIES": 0})
    pages, stats = result["pages"], result["stats"]

    by_host: Dict[str, List[Dict[str, Any]]] = {}
    for page in pages:
        by_host.setdefault(page["url"].split("/")[2].split(":")[0], []).append(page)
    assert sorted(p["url"] for p in by_host["127.0.0.1"]) == sorted(site.url(p) for p in Site.PAGES)
    assert [p["status"] for p in by_host[BANNING_HOST]] == [403]
    assert_every_page_went_through_its_proxy(pages, site, access_logs)

    # One lease for the site's domain, held across the slow page; another for the banning one.
    assert len({p["lease"] for p in by_host["127.0.0.1"]}) == 1, by_host
    site_proxy = by_host["127.0.0.1"][0]["proxy"]
    banned_proxy = by_host[BANNING_HOST][0]["proxy"]
    assert banned_proxy != site_proxy, "the site's lease held its proxy's only slot"
    assert stats.get("egress_proxies/acquired") == 2, stats
    assert stats.get("egress_proxies/released/banned") == 1, stats
    assert stats.get("egress_proxies/released/ok") == 1, stats
    assert "egress_proxies/lost" not in stats, stats
    assert stats.get("egress_proxies/renewals", 0) >= 2, stats

    # No lease left behind.
    assert_no_active_lease(client, selector)

    # The ban holds for the banning domain only, and listings say so.
    listed = {p.proxy.endpoint: p for p in client.list_proxies(selector, target_domain=BANNING_HOST)}
    assert listed[banned_proxy].availability == "banned", listed
    assert set(listed[banned_proxy].bans) == {BANNING_HOST}, listed
    assert [p for e, p in listed.items() if e != banned_proxy and p.availability == "banned"] == [], listed
    all_proxies = {p.proxy.endpoint for p in client.list_proxies(selector)}
    assert drain(client, selector, BANNING_HOST) == all_proxies - {banned_proxy}
    assert drain(client, selector, "127.0.0.1") == all_proxies


def test_a_ban_mid_crawl_loses_no_page(crawl: Crawl, selector: Dict[str, str], client: DiscoveryClient, site: Site) -> None:
    # The banning host's /many and its 200 pages: the site bans the crawl's proxy at the 50th,
    # and that page is sent again through another proxy (at least two are left for the host:
    # the test above banned one of the three).
    def reported() -> Dict[str, int]:
        """Requests and client errors the operator's statistics hold for the banning host."""
        totals: Counter[str] = Counter()
        for proxy in client.list_proxies(selector, target_domain=BANNING_HOST):
            domain = proxy.domain_outcomes(BANNING_HOST) or {}
            totals["requests"] += int(domain.get("requests", 0))
            totals["clientError"] += int((domain.get("failures") or {}).get("clientError", 0))
        return dict(totals)

    before = reported()
    result = crawl(start_urls=[site.url("/many", host=BANNING_HOST)])
    pages, stats = result["pages"], result["stats"]
    # Every response was reported before its lease's release (the 403 as a client error),
    # but those still in flight through the banned proxy once its lease had ended (at most
    # Scrapy's CONCURRENT_REQUESTS, 16 by default).
    responses = len(pages) + 1
    ours = {k: v for k, v in stats.items() if k.startswith("egress_proxies/")}
    sent = stats.get("egress_proxies/outcomes_reported", 0)
    assert sent + stats.get("egress_proxies/outcomes_unreported", 0) == responses, ours
    assert responses - 16 <= sent, ours
    assert "egress_proxies/outcome_reports_failed" not in stats, ours
    after = reported()
    assert after.get("requests", 0) - before.get("requests", 0) == sent, (before, after)
    assert after.get("clientError", 0) - before.get("clientError", 0) == 1, (before, after)
    expected = [site.url("/many", host=BANNING_HOST)]
    expected += [site.url(f"/once/{n}", host=BANNING_HOST) for n in range(Site.ONCE_PAGES)]
    assert sorted(p["url"] for p in pages) == sorted(expected)
    assert len(pages) == 1 + Site.ONCE_PAGES
    assert [p for p in pages if p["status"] != 200] == [], "a banned page reached the spider"
    assert stats.get("egress_proxies/ban_retries") == 1, stats
    assert "egress_proxies/ban_retries_exhausted" not in stats, stats
    assert stats.get("egress_proxies/released/banned") == 1, stats
    # The page banned once was fetched again, through a proxy other than the banned one.
    served = Counter(path for host, path in site.served if host == BANNING_HOST)
    again = [path for path, count in served.items() if count == 2]
    assert len(again) == 1 and again[0].startswith("/once/"), served
    proxies = {p["proxy"] for p in pages if p["url"].endswith(again[0])}
    assert len(proxies) == 1, pages
    assert_no_active_lease(client, selector)


def test_ban_retries_are_bounded_counted_and_routed_afresh() -> None:
    # Without a crawl: every proxy left would be banned for the host for the rest of the suite.
    from types import SimpleNamespace

    from scrapy import Request, Spider
    from scrapy.utils.test import get_crawler

    from egress_proxies.scrapy_middleware import EgressProxiesMiddleware

    crawler = get_crawler(
        settings_dict={"EGRESS_PROXIES_URL": "http://127.0.0.1:9", "EGRESS_PROXIES_TOKEN": "t", "EGRESS_PROXIES_BAN_RETRIES": 2}
    )
    middleware = EgressProxiesMiddleware.from_crawler(crawler)
    spider = Spider(name="bans")
    lease: Any = SimpleNamespace(proxy=SimpleNamespace(key="crawl/a"))
    request = Request(
        "http://shop.example/p",
        meta={"egress_proxies_lease": lease, "proxy": "http://u:p@127.0.0.1:3128", "_egress_proxies_key": ("shop.example", None)},
    )
    sent = []
    current: Optional[Request] = request
    while current is not None:
        current = middleware._send_again(current, lease, 403, spider)
        if current is not None:
            sent.append(current)
    assert len(sent) == 2
    for n, again in enumerate(sent, start=1):
        assert again.dont_filter, "the scheduler's duplicate filter would drop it"
        assert again.meta["egress_proxies_ban_retries"] == n
        assert not {"proxy", "egress_proxies_lease", "_egress_proxies_key"} & set(again.meta), again.meta
    assert crawler.stats.get_value("egress_proxies/ban_retries") == 2
    assert crawler.stats.get_value("egress_proxies/ban_retries_exhausted") == 1
    middleware.client.close()


@pytest.mark.parametrize("session", [None, "login-1"], ids=["per-request", "sticky-session"])
def test_request_mode_leases_each_request_and_releases_it(
    crawl: Crawl,
    selector: Dict[str, str],
    client: DiscoveryClient,
    site: Site,
    access_logs: AccessLogs,
    session: Optional[str],
) -> None:
    result = crawl(
        # One request at a time in a session: a second one would find its proxy's only slot
        # taken and be bound to another proxy.
        settings={"EGRESS_PROXIES_MODE": "request", "CONCURRENT_REQUESTS": 1 if session else 2},
        allowed_domains=["127.0.0.1"],
        session=session,
    )
    pages, stats = result["pages"], result["stats"]
    assert sorted(p["url"] for p in pages) == sorted(site.url(p) for p in Site.PAGES)
    assert all(p["status"] == 200 for p in pages)
    assert_every_page_went_through_its_proxy(pages, site, access_logs)

    assert len({p["lease"] for p in pages}) == len(pages), "one lease per request"
    assert stats.get("egress_proxies/acquired") == len(pages), stats
    assert stats.get("egress_proxies/released/ok") == len(pages), stats
    if session:
        # A sticky session gets its proxy back, its own post-release cooldown aside.
        assert len({p["proxy"] for p in pages}) == 1, Counter(p["proxy"] for p in pages)
    assert_no_active_lease(client, selector)


def test_domain_mode_releases_idle_session_leases_and_errors(
    crawl: Crawl, selector: Dict[str, str], client: DiscoveryClient, site: Site
) -> None:
    # A session has a lease of its own, released once idle for half a second while /slow keeps
    # the crawl (and the domain's other lease) busy for 2.5 s.
    result = crawl(
        settings={"EGRESS_PROXIES_IDLE_RELEASE": 0.5},
        start_urls=[site.url("/c"), site.url("/slow")],
        sessions={site.url("/c"): "basket-1"},
    )
    pages, stats = result["pages"], result["stats"]
    # /slow's link to /c is a duplicate Scrapy filters out.
    assert sorted(p["url"] for p in pages) == [site.url("/c"), site.url("/slow")], pages
    assert pages[0]["lease"] != pages[1]["lease"], "the session has its own lease"
    assert stats.get("egress_proxies/acquired") == 2, stats
    assert stats.get("egress_proxies/idle_released") == 1, stats
    assert stats.get("egress_proxies/released/ok") == 2, stats
    assert_no_active_lease(client, selector)

    # A download error (here a timeout) releases the domain's lease as "error".
    result = crawl(
        settings={"DOWNLOAD_TIMEOUT": 1, "RETRY_ENABLED": False},
        start_urls=[site.url("/slow")],
        errors_expected=True,
    )
    assert result["pages"] == []
    assert result["stats"].get("egress_proxies/released/error") == 1, result["stats"]
    assert_no_active_lease(client, selector)


@pytest.mark.parametrize(
    "settings",
    [
        {"EGRESS_PROXIES_URL": "http://127.0.0.1:9"},
        {"EGRESS_PROXIES_URL": "http://127.0.0.1:9", "EGRESS_PROXIES_TOKEN": "t", "EGRESS_PROXIES_MODE": "page"},
    ],
    ids=["no-token", "unknown-mode"],
)
def test_misconfiguration_stops_the_crawl_instead_of_crawling_directly(settings: Dict[str, Any]) -> None:
    from scrapy.utils.test import get_crawler

    from egress_proxies.scrapy_middleware import EgressProxiesMiddleware

    with pytest.raises(ValueError):
        EgressProxiesMiddleware.from_crawler(get_crawler(settings_dict=settings))


def test_ban_codes_are_configurable(
    crawl: Crawl, selector: Dict[str, str], client: DiscoveryClient, site: Site, access_logs: AccessLogs
) -> None:
    # Last in this suite: it bans a proxy for 127.0.0.1 for the store's ban cooldown (30 min).
    result = crawl(
        settings={
            "EGRESS_PROXIES_MODE": "request",
            "EGRESS_PROXIES_BAN_CODES": [404],
            "EGRESS_PROXIES_BAN_RETRIES": 0,
            "CONCURRENT_REQUESTS": 1,
        },
        start_urls=[site.url("/missing"), site.url("/c", host=BANNING_HOST)],
    )
    pages, stats = result["pages"], result["stats"]
    statuses = {p["url"]: p["status"] for p in pages}
    assert statuses == {site.url("/missing"): 404, site.url("/c", host=BANNING_HOST): 403}
    assert_every_page_went_through_its_proxy(pages, site, access_logs)
    # 404 is a ban now; 403 is not.
    assert stats.get("egress_proxies/released/banned") == 1, stats
    assert stats.get("egress_proxies/released/ok") == 1, stats
    assert_no_active_lease(client, selector)

    banned_proxy = next(p["proxy"] for p in pages if p["status"] == 404)
    all_proxies = {p.proxy.endpoint for p in client.list_proxies(selector)}
    assert drain(client, selector, "127.0.0.1") == all_proxies - {banned_proxy}


def test_request_mode_waits_for_the_start_politeness_reserved(crawl: Crawl, site: Site) -> None:
    # The operator under test spaces the starts of requests through its pool=pytest-polite
    # proxy 0.5 s apart per domain; each acquire answers the start it reserved (notBefore).
    result = crawl(
        settings={"EGRESS_PROXIES_MODE": "request", "EGRESS_PROXIES_SELECTOR": {"pool": "pytest-polite"}},
        start_urls=[site.url("/a")],
        allowed_domains=["127.0.0.1"],
    )
    pages = result["pages"]
    assert len(pages) >= 4 and len(site.arrivals) == len(pages), (pages, site.served)
    assert len({page["proxy"] for page in pages}) == 1, "all through the polite proxy"
    gaps = [later - earlier for earlier, later in zip(site.arrivals, site.arrivals[1:])]
    # A request reaches the site a little after its start (through Squid), so a gap may come
    # out a few milliseconds short of the interval, never much.
    assert min(gaps) > 0.4, f"requests to one domain through one proxy {gaps} s apart"
    assert result["stats"].get("egress_proxies/politeness_waits", 0) >= 1, result["stats"]


def test_no_proxy_available_drops_the_request_with_one_line_and_no_traceback(crawl: Crawl, site: Site) -> None:
    # Nothing matches the selector: the request waits EGRESS_PROXIES_MAX_WAIT, then is dropped.
    result = crawl(
        settings={
            "EGRESS_PROXIES_SELECTOR": {"region": "nowhere"},
            "EGRESS_PROXIES_MAX_WAIT": 1,
            "EGRESS_PROXIES_GIVE_UP": 0,
        },
        start_urls=[site.url("/a")],
    )
    assert result["pages"] == []
    stats = result["stats"]
    assert stats.get("egress_proxies/no_proxy_available") == 1, stats
    assert stats.get("finish_reason") == "finished", stats
    log = result["log"]
    assert "Traceback" not in log, log[-3000:]
    assert [l for l in log.splitlines() if "no proxy available for 127.0.0.1" in l and "WARNING" in l], log[-3000:]


def test_a_crawl_that_finds_no_proxy_for_long_enough_closes_itself(crawl: Crawl, site: Site) -> None:
    # One request at a time, each waiting 1 s for a proxy that never comes: past
    # EGRESS_PROXIES_GIVE_UP (1.5 s) the spider closes with one line instead of going on.
    result = crawl(
        settings={
            "EGRESS_PROXIES_MODE": "request",
            "EGRESS_PROXIES_SELECTOR": {"region": "nowhere"},
            "EGRESS_PROXIES_MAX_WAIT": 1,
            "EGRESS_PROXIES_GIVE_UP": 1.5,
            "CONCURRENT_REQUESTS": 1,
        },
        start_urls=[site.url(p) for p in ("/a", "/b", "/c", "/slow", "/")],
    )
    stats = result["stats"]
    assert stats.get("finish_reason") == "egress_proxies_unavailable", stats
    assert 2 <= stats.get("egress_proxies/no_proxy_available", 0) < 5, stats
    log = result["log"]
    assert "Traceback" not in log, log[-3000:]
    closing = [l for l in log.splitlines() if "closing the spider (EGRESS_PROXIES_GIVE_UP)" in l]
    assert len(closing) == 1, log[-3000:]


BANNED_DOMAIN = "banned-everywhere.invalid"


def test_a_domain_every_proxy_is_banned_for_ends_the_crawl_with_one_line(
    crawl: Crawl, client: DiscoveryClient, selector: Dict[str, str], site: Site
) -> None:
    # Last in this suite: it bans every proxy for a domain of its own for the store's ban
    # cooldown (30 min), as that domain's crawls would have.
    count = len(client.list_proxies(selector))
    held = [client.acquire(selector, target_domain=BANNED_DOMAIN, max_wait=10) for _ in range(count)]
    for lease in held:
        assert client.release(lease, "banned")
    assert all(p.availability == "banned" for p in client.list_proxies(selector, target_domain=BANNED_DOMAIN))

    started = time.monotonic()
    result = crawl(
        start_urls=[f"http://{BANNED_DOMAIN}:{site.port}/{n}" for n in range(5)] + [site.url("/c")],
        settings={"EGRESS_PROXIES_BANNED_GIVE_UP": 60},
    )
    elapsed = time.monotonic() - started
    stats, log = result["stats"], result["log"]
    # The other domain is crawled; the banned one's five requests are dropped at once (no
    # waiting out EGRESS_PROXIES_MAX_WAIT for each).
    assert [p["url"] for p in result["pages"]] == [site.url("/c")]
    assert stats.get("finish_reason") == "finished", stats
    assert stats.get("egress_proxies/banned_everywhere") == 5, stats
    assert elapsed < 25, elapsed
    lines = [l for l in log.splitlines() if "banned for" in l and BANNED_DOMAIN in l and "WARNING" in l]
    assert len(lines) == 1, log[-5000:]
    assert "Traceback" not in log, log[-3000:]
