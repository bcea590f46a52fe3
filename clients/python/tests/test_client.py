"""The client against a live discovery API: acquire, list, background renewal, release,
503 + Retry-After within a bounded wait, and error answers."""

from __future__ import annotations

import os
import time
from typing import Dict, List

import pytest

from egress_proxies import DiscoveryClient, DiscoveryError, Lease, NoProxyAvailable, StaleToken
from conftest import AccessLogs, LosingRelay, Site


def hold_all(client: DiscoveryClient, selector: Dict[str, str]) -> List[Lease]:
    """A lease on every test proxy (each takes one: maxConcurrent 1)."""
    count = len(client.list_proxies(selector))
    return [client.acquire(selector, max_wait=10) for _ in range(count)]


def test_acquire_list_release(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    lease = client.acquire(selector, ttl_seconds=30, target_domain="shop.example", session_key="s-1")
    assert lease.proxy.attributes.items() >= selector.items()
    assert lease.proxy_url.startswith("http://") and lease.proxy_url.endswith("@" + lease.proxy.endpoint)
    assert os.environ["EPO_PROXY_PASSWORD"] in lease.proxy_url
    assert os.environ["EPO_PROXY_PASSWORD"] not in repr(lease), "the credentials stay out of the lease's repr"
    assert lease.ttl_seconds == 30
    assert lease.expires_at > lease.acquired_at
    listed = {p.proxy.key: p for p in client.list_proxies(selector)}
    assert listed[lease.proxy.key].active_leases == 1
    assert listed[lease.proxy.key].availability == "busy"

    assert client.release(lease, "ok") is True
    assert lease.released and not lease.active
    assert client.release(lease, "ok") is False, "a second release has nothing to release"
    assert all(p.active_leases == 0 for p in client.list_proxies(selector))


def test_reported_outcomes_show_in_the_listing(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    domain = "reports.example"
    lease = client.acquire(selector, target_domain=domain)
    client.report(lease, status=200, latency_ms=12, bytes_received=345)
    client.report(lease, error="timeout", latency_ms=3000)
    without_domain = client.acquire(selector, max_wait=10)
    with pytest.raises(ValueError):
        client.report(without_domain, status=200)  # no domain to report for
    client.release(without_domain, "ok")
    listed = {p.proxy.key: p for p in client.list_proxies(selector, target_domain=domain)}
    stats = listed[lease.proxy.key].domain_outcomes(domain)
    assert stats is not None, listed[lease.proxy.key].outcomes
    assert (stats["requests"], stats["successes"], stats["failures"]["timeout"]) == (2, 1, 1)
    assert stats["bytesReceived"] == 345
    client.release(lease, "ok")
    with pytest.raises(DiscoveryError) as released:
        client.report(lease, status=200)
    assert released.value.status == 404, "a report is fenced like a renewal"


def test_politeness_says_when_the_next_request_may_start(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    # The operator under test spaces requests to polite.example one second apart per proxy.
    lease = client.acquire(selector, target_domain="polite.example")
    try:
        assert lease.not_before is not None, "an acquire for a covered domain says when"
        first = lease.not_before
        assert abs((first - lease.acquired_at).total_seconds()) < 0.5, "the first may go at once"
        second = client.report(lease, status=200)
        assert second is not None and lease.not_before == second
        third = client.report(lease, status=200)
        assert third is not None
        assert 0.9 < (second - first).total_seconds() < 1.1, (first, second)
        assert 0.9 < (third - second).total_seconds() < 1.1, (second, third)
        assert client.report(lease, "other.example", status=200) is None, "no limit for that domain"
        assert lease.not_before is None
    finally:
        client.release(lease, "ok")
    uncovered = client.acquire(selector, target_domain="shop.example", max_wait=10)
    assert uncovered.not_before is None
    client.release(uncovered, "ok")


def test_a_release_whose_answer_is_lost_is_sent_again_and_settled(
    client: DiscoveryClient, token: str, selector: Dict[str, str], losing_relay: LosingRelay
) -> None:
    with DiscoveryClient(losing_relay.url, token, holder="pytest", renew=False) as through_relay:
        lease = through_relay.acquire(selector, ttl_seconds=60)
        losing_relay.lose_answers("/release", times=1)
        # The first release reaches the API and its answer is lost; the second finds the lease
        # gone (404): the first one released it.
        assert through_relay.release(lease, "ok") is True
        assert losing_relay.lost == [f"POST /v1/leases/{lease.lease_id}/release HTTP/1.1"]
        assert lease.released and lease.lost is None
    listed = {p.proxy.key: p for p in client.list_proxies(selector)}
    assert listed[lease.proxy.key].active_leases == 0, "released, not left to its TTL"


def test_an_acquire_whose_answer_is_lost_is_sent_again_and_gets_the_same_lease(
    client: DiscoveryClient, token: str, selector: Dict[str, str], losing_relay: LosingRelay
) -> None:
    with DiscoveryClient(losing_relay.url, token, holder="pytest", renew=False) as through_relay:
        losing_relay.lose_answers("POST /v1/leases ", times=1)
        lease = through_relay.acquire(selector, ttl_seconds=60)
        assert losing_relay.lost == ["POST /v1/leases HTTP/1.1"], "the first answer was lost"
        # The lost acquire was granted; sent again with its requestId it got that lease, not
        # a second one.
        active = sum(p.active_leases for p in client.list_proxies(selector))
        assert active == 1, f"{active} leases for one acquire"
        assert through_relay.release(lease, "ok") is True


def test_a_renewal_whose_answer_is_lost_loses_the_lease_truthfully(
    client: DiscoveryClient, token: str, selector: Dict[str, str], losing_relay: LosingRelay
) -> None:
    with DiscoveryClient(losing_relay.url, token, holder="pytest", renew=False) as through_relay:
        lease = through_relay.acquire(selector, ttl_seconds=2)
        token_before = lease.fencing_token
        losing_relay.lose_answers("/renew", times=1)
        with pytest.raises(DiscoveryError) as lost:
            through_relay.renew(lease)
        assert (lost.value.status, lost.value.code) == (0, "no_answer")
        assert lease.fencing_token == token_before, "no answer: the client knows no new token"
        # The renewal happened: the token the client holds is stale now, and it says so.
        with pytest.raises(StaleToken):
            through_relay.renew(lease)
    # Active with a token nobody was told, it ends at its expiry (2 s after the lost renewal).
    listed = {p.proxy.key: p for p in client.list_proxies(selector)}
    assert listed[lease.proxy.key].active_leases == 1
    deadline = time.monotonic() + 10.0
    while any(p.active_leases for p in client.list_proxies(selector)):
        assert time.monotonic() < deadline, "the lease outlived its TTL"
        time.sleep(0.1)


def test_leases_are_renewed_in_the_background(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    lease = client.acquire(selector, ttl_seconds=2)
    first_token, first_expiry = lease.fencing_token, lease.expires_at
    # Renewed at a third of the TTL: well past the first expiry, the lease is still alive.
    time.sleep(3.0)
    assert lease.renewals >= 2, lease
    assert lease.fencing_token > first_token
    assert lease.expires_at > first_expiry
    assert lease.lost is None
    assert client.release(lease, "ok") is True, "the renewed lease was still known"


def test_503_waits_as_retry_after_says_within_the_bound(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    held = hold_all(client, selector)
    try:
        # No wait allowed: the 503 at once, with the server's hint.
        started = time.monotonic()
        with pytest.raises(NoProxyAvailable) as refused:
            client.acquire(selector, max_wait=0)
        assert time.monotonic() - started < 1.0
        assert refused.value.status == 503 and refused.value.code == "no_proxy_available"
        assert refused.value.retry_after is not None and refused.value.retry_after >= 1

        # A bounded wait ends when its bound does, not when Retry-After would.
        started = time.monotonic()
        with pytest.raises(NoProxyAvailable):
            client.acquire(selector, max_wait=1.5)
        assert 1.4 <= time.monotonic() - started < 4.0

        # A released proxy rests for its cooldown (1 s); Retry-After says so and the client
        # waits for it.
        freed = held.pop()
        client.release(freed, "ok")
        started = time.monotonic()
        lease = client.acquire(selector, max_wait=10)
        waited = time.monotonic() - started
        held.append(lease)
        assert lease.proxy.key == freed.proxy.key
        assert 0.3 <= waited < 5.0, waited
    finally:
        for lease in held:
            client.release(lease, "ok")


def test_context_manager_releases_with_the_outcome(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    with client.lease(selector) as lease:
        assert lease.active
    assert lease.released

    with pytest.raises(RuntimeError):
        with client.lease(selector) as failed:
            raise RuntimeError("the crawl failed")
    assert failed.released


def test_error_answers(client: DiscoveryClient, api_url: str, selector: Dict[str, str]) -> None:
    with DiscoveryClient(api_url, "not-a-token") as stranger:
        with pytest.raises(DiscoveryError) as denied:
            stranger.list_proxies()
        assert (denied.value.status, denied.value.code) == (401, "unauthorized")

    with pytest.raises(NoProxyAvailable):
        client.acquire({"region": "mars"}, max_wait=0)

    lease = client.acquire(selector)
    try:
        with pytest.raises(DiscoveryError) as no_domain:
            client.release(lease, "banned")
        assert (no_domain.value.status, no_domain.value.code) == (400, "target_domain_required")
    finally:
        assert client.release(lease, "ok") is True

    with DiscoveryClient("http://127.0.0.1:9", "t", timeout=2) as nowhere:
        with pytest.raises(DiscoveryError) as unreachable:
            nowhere.list_proxies()
        assert unreachable.value.code == "unreachable"


def test_fetch_through_a_leased_proxy_reaches_its_squid(
    client: DiscoveryClient, selector: Dict[str, str], site: Site, access_logs: AccessLogs, proxy_user: str
) -> None:
    import urllib.request

    with client.lease(selector, target_domain="127.0.0.1") as lease:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": lease.proxy_url}))
        with opener.open(site.url("/c"), timeout=10) as page:
            assert page.status == 200
    lines = access_logs.wait_for(1, f":{site.port}/c")
    # proxy_url carries the credentials; urllib presented them.
    assert [(l[2], l[3]) for l in lines[lease.proxy.endpoint]] == [(site.url("/c"), proxy_user)], lines
