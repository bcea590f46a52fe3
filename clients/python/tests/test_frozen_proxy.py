"""A leased Squid that freezes mid-crawl (SIGSTOP): the crawl finishes soon, by itself,
without losing pages or spamming errors.

The operator's health checks here run every 2 s with a 1 s timeout and a failure threshold
of 2 (tests/support/standalone.rs): a frozen proxy is out of rotation within about 5 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from egress_proxies import DiscoveryClient
from conftest import Site
from test_scrapy import CRAWL

# The operator's detection time in this suite (2 s interval x 2 failures + 1 s timeout, plus
# a probe's phase), the middleware's renew interval in these crawls, and slack for the rest of
# the crawl (about 3 s of pages) and a loaded machine. Scrapy's DOWNLOAD_TIMEOUT in the frozen
# crawl is far above the sum: a crawl that waited for it would fail the bound.
DETECTION_SECONDS = 7.0
RENEW_INTERVAL = 1.0
SLACK_SECONDS = 10.0
DOWNLOAD_TIMEOUT = 120


def squid_pids(endpoint: str) -> List[int]:
    """The Squid processes listening on ``endpoint`` (found by their configuration file)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"squid") or b"-f" not in argv:
            continue
        config = argv[argv.index(b"-f") + 1].decode()
        try:
            if f"http_port {endpoint}\n" in Path(config).read_text():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_until_all_available(client: DiscoveryClient, selector: Dict[str, str], within: float = 60) -> None:
    deadline = time.monotonic() + within
    while True:
        listing = client.list_proxies(selector)
        if all(p.availability not in ("closed", "draining") for p in listing):
            return
        assert time.monotonic() < deadline, [(p.proxy.key, p.availability) for p in listing]
        time.sleep(0.2)


@pytest.fixture
def frozen() -> Iterator[List[int]]:
    """Processes the test stops; continued after it, whatever happens."""
    stopped: List[int] = []
    yield stopped
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_proxy_frozen_mid_crawl_loses_no_page_and_costs_no_download_timeout(
    tmp_path: Path,
    api_url: str,
    token: str,
    selector: Dict[str, str],
    client: DiscoveryClient,
    site: Site,
    frozen: List[int],
) -> None:
    config: Dict[str, Any] = {
        "start_urls": [site.url("/paced")],
        "settings": {
            "EGRESS_PROXIES_URL": api_url,
            "EGRESS_PROXIES_TOKEN": token,
            "EGRESS_PROXIES_SELECTOR": selector,
            "EGRESS_PROXIES_RENEW_INTERVAL": RENEW_INTERVAL,
            "CONCURRENT_REQUESTS": 2,
            # Were the frozen downloads left to time out, the crawl would take this long.
            "DOWNLOAD_TIMEOUT": DOWNLOAD_TIMEOUT,
        },
    }
    config_path, result_path = tmp_path / "crawl.json", tmp_path / "result.json"
    config_path.write_text(json.dumps(config))
    log_path = tmp_path / "crawl.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        crawl = subprocess.Popen([sys.executable, str(CRAWL), str(config_path), str(result_path)], stderr=log)
    try:
        # Freeze the proxy of the crawl's lease once a few pages came through it.
        deadline = time.monotonic() + 30
        while True:
            _, body, _ = client._call("GET", "/v1/leases?holder=scrapy/site")
            paced = sum(1 for _, path in site.served if path.startswith("/paced/"))
            if body["leases"] and paced >= 5:
                break
            assert time.monotonic() < deadline, (body, site.served)
            time.sleep(0.05)
        key = body["leases"][0]["proxy"]
        endpoint = next(p.proxy.endpoint for p in client.list_proxies(selector) if p.proxy.key == key)
        pids = squid_pids(endpoint)
        assert pids, f"no Squid found for {endpoint}"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
        frozen_at = time.monotonic()
        crawl.wait(timeout=DOWNLOAD_TIMEOUT)
    finally:
        if crawl.poll() is None:
            crawl.kill()
            crawl.wait()
    elapsed = time.monotonic() - frozen_at
    log_text = log_path.read_text()
    print(log_text[-20000:])
    assert crawl.returncode == 0, log_text[-5000:]
    result = json.loads(result_path.read_text())
    pages, stats = result["pages"], result["stats"]

    # Every page, none twice; after the freeze, through another proxy.
    expected = [site.url("/paced")] + [site.url(f"/paced/{n}") for n in range(Site.PACED_PAGES)]
    assert sorted(p["url"] for p in pages) == sorted(expected)
    assert all(p["status"] == 200 for p in pages)
    assert {p["proxy"] for p in pages} - {endpoint}, "nothing went through another proxy"
    # Within the operator's detection time plus the renew interval and a retry, not Scrapy's
    # download timeout.
    assert elapsed < DETECTION_SECONDS + RENEW_INTERVAL + SLACK_SECONDS, (elapsed, stats)
    assert stats.get("egress_proxies/out_of_rotation") == 1, stats
    assert stats.get("egress_proxies/released/error") == 1, stats
    assert stats.get("egress_proxies/unhealthy_retries", 0) >= 1, stats
    assert "egress_proxies/unhealthy_retries_exhausted" not in stats, stats
    assert "Traceback" not in log_text and "ERROR" not in log_text, log_text[-5000:]
    assert "py.warnings" not in log_text and "Warning:" not in log_text, log_text[-5000:]
    assert len([l for l in log_text.splitlines() if "is out of rotation" in l]) == 1, log_text[-5000:]
    print(f"{len(pages)} pages; the crawl ended {elapsed:.1f} s after the freeze; {stats}")

    # The Squid thaws, passes its checks and is leasable again for the tests that follow.
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    frozen.clear()
    wait_until_all_available(client, selector)
