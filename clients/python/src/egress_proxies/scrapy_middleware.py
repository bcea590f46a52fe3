"""A Scrapy downloader middleware that sends requests through proxies leased from the
egress-proxies-operator discovery API.

It owns the leases of one crawl: which request uses which lease, when a lease is acquired and
released, and what each release reports (``banned`` for a ban status code, ``error`` for a
download error, ``ok`` otherwise). Enable it before Scrapy's ``HttpProxyMiddleware`` (750),
which turns the lease's proxy URL into the request's proxy and its credentials:

    DOWNLOADER_MIDDLEWARES = {"egress_proxies.scrapy_middleware.EgressProxiesMiddleware": 740}
    EGRESS_PROXIES_URL = "http://127.0.0.1:8080"
    EGRESS_PROXIES_TOKEN = "..."            # or EGRESS_PROXIES_TOKEN_FILE = "/path/to/token"

Settings (all optional but the URL and token; without them, or with an unknown mode, the crawl
does not start, rather than crawl from this host's own address):

``EGRESS_PROXIES_MODE``
    ``"domain"`` (default): one lease per target domain (and per session, see below), shared
    by that domain's requests and kept until the crawl ends, a ban, a download error, or
    ``EGRESS_PROXIES_IDLE_RELEASE`` seconds without requests. ``"request"``: one lease per
    request, released with its response; under the operator's politeness for the request's
    domain (docs/gateway.md), the request is held until the start the acquire reserved for it
    (``notBefore``; stat ``egress_proxies/politeness_waits``). In ``domain`` mode many requests
    share one lease, so one reserved start cannot space them: use Scrapy's ``DOWNLOAD_DELAY``.
``EGRESS_PROXIES_SELECTOR``
    attributes the proxies must have, e.g. ``{"region": "eu"}``.
``EGRESS_PROXIES_BAN_CODES``
    response statuses reported as a ban of the proxy for the request's domain (default
    ``[403, 429]``).
``EGRESS_PROXIES_BAN_RETRIES``
    how many times a request answered with a ban code is sent again, each time through
    another proxy (default 2; 0 hands the ban response to the spider at once). The proxy
    that was banned is skipped for that domain, so the page is not lost with it; past the
    bound the last ban response goes on to the spider. This runs before Scrapy's own
    ``RetryMiddleware``, so a ban code that is also in ``RETRY_HTTP_CODES`` (429 is) is not
    retried twice.
``EGRESS_PROXIES_TTL``
    lease TTL in seconds (default: the server's, 60); leases are renewed in the background.
``EGRESS_PROXIES_MAX_WAIT``
    how long an acquire waits while no proxy is available (default 30 s); after that the
    request is dropped (``IgnoreRequest``, counted in ``egress_proxies/no_proxy_available``,
    logged once per domain as a warning, no traceback).
``EGRESS_PROXIES_GIVE_UP``
    when no request of the crawl has found a proxy for this many seconds (default 300; 0 never),
    close the spider (reason ``egress_proxies_unavailable``) with one warning line, rather than
    let it wait and drop requests for ever.
``EGRESS_PROXIES_BANNED_GIVE_UP``
    when an acquire for a domain finds no proxy and every proxy matching the selector is
    banned for that domain until at least this many seconds from now (default 60), the
    domain's requests are dropped until the first ban ends, with one warning line for the
    domain and no traceback (stat ``egress_proxies/banned_everywhere``: requests dropped). The
    crawl goes on with its other domains and ends by itself. The ban ends come from the
    listing (``GET /v1/proxies?targetDomain=``), which, unlike the 503's ``Retry-After``
    (capped at 60 s), says exactly when a proxy frees up for the domain.
``EGRESS_PROXIES_RENEW_INTERVAL``
    renew each lease at least this often (default 5 s; leases are renewed at a third of
    their TTL otherwise). A renewal is how the crawl hears that a leased proxy went out of
    rotation (its health checks fail: a dead or frozen Squid); see below.
``EGRESS_PROXIES_UNHEALTHY_RETRIES``
    how many times a request whose proxy went out of rotation under it is sent again through
    another proxy (default 2).
``EGRESS_PROXIES_HOLDER``
    the lease holder (default: ``scrapy/<spider name>``).
``EGRESS_PROXIES_REPORT_OUTCOMES``
    report each response's status, latency and size, and each download error's kind, to the
    operator's statistics of the proxy for the request's domain (default True; one small API
    call per request, in the middleware's threads, always before its lease's release; stats
    ``egress_proxies/outcomes_reported`` and ``egress_proxies/outcome_reports_failed``). A
    response that arrives after its lease ended (requests in flight through a proxy banned on
    another request) cannot be reported: ``egress_proxies/outcomes_unreported``.
``EGRESS_PROXIES_IDLE_RELEASE``
    in ``domain`` mode, release a domain's lease after this many seconds without requests
    (default 30; 0 keeps it until the crawl ends).
``EGRESS_PROXIES_THREADS``
    threads for the blocking API calls (default 4), apart from Twisted's DNS thread pool.

Per request (``request.meta``): ``egress_proxies_session`` names a sticky session (its own
lease, acquired with that ``sessionKey``); ``egress_proxies_skip`` sends the request without
a leased proxy, as does a ``proxy`` set by someone else. The middleware sets
``egress_proxies_lease`` (a :class:`~egress_proxies.client.Lease`) on every request it routes.

A proxy out of rotation: when a renewal says the operator took a leased proxy out of
rotation, the middleware releases that lease (``error``), routes the next requests through a
new lease, and aborts the connections it has open to that proxy, so the requests in flight
through it fail at once and are sent again through another proxy (bounded by
``EGRESS_PROXIES_UNHEALTHY_RETRIES``). Why abort rather than a short download timeout: a frozen
Squid accepts connections and never answers, and only Scrapy's ``DOWNLOAD_TIMEOUT`` (180 s by
default) would end its downloads; a timeout short enough to matter would also cut legitimately
slow pages through healthy proxies, while the operator's verdict only ever touches the proxy
that failed. A crawl therefore recovers within the operator's detection time (health interval
times failure threshold, plus the probe timeout) plus ``EGRESS_PROXIES_RENEW_INTERVAL``.

Stats: ``egress_proxies/acquired``, ``egress_proxies/released/<outcome>``,
``egress_proxies/idle_released`` (of those, domain leases released for being idle),
``egress_proxies/renewals``, ``egress_proxies/lost`` (leases the server dropped before release),
``egress_proxies/no_proxy_available`` (requests dropped for want of a proxy),
``egress_proxies/ban_retries`` (requests sent again after a ban),
``egress_proxies/ban_retries_exhausted`` (ban responses passed on past the bound),
``egress_proxies/banned_everywhere`` (requests dropped: every proxy banned for their domain),
``egress_proxies/out_of_rotation`` (leases left because their proxy went out of rotation),
``egress_proxies/aborted_connections`` (connections to such proxies aborted),
``egress_proxies/unhealthy_retries`` and ``egress_proxies/unhealthy_retries_exhausted``
(requests sent again after their proxy went out of rotation, or failed past the bound).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Set, Tuple, Union, cast

from scrapy import Request, Spider, signals
from scrapy.crawler import Crawler
from scrapy.exceptions import IgnoreRequest
from scrapy.http import Response
from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import defer, task, threads
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from ._scrapy_settings import endpoint_and_token, holder
from .client import DiscoveryClient, Lease, NoProxyAvailable, Outcome


class _BannedEverywhere(NoProxyAvailable):
    """Every proxy matching the selector is banned for the domain until ``until`` at least."""

    def __init__(self, domain: str, until: datetime) -> None:
        super().__init__(503, "no_proxy_available", f"every proxy is banned for {domain}")
        self.domain = domain
        self.until = until

__all__ = ["EgressProxiesMiddleware"]

LEASE_META = "egress_proxies_lease"
SESSION_META = "egress_proxies_session"
SKIP_META = "egress_proxies_skip"
BAN_RETRIES_META = "egress_proxies_ban_retries"
UNHEALTHY_RETRIES_META = "egress_proxies_unhealthy_retries"
# What routing put on a request; a copy sent again must be routed afresh.
_ROUTING_META = (LEASE_META, "proxy", "_egress_proxies_key", "_egress_proxies_pending")

# Domain mode's leases are keyed by (domain, session).
_Key = Tuple[str, Optional[str]]


class _Held:
    """A lease held for many requests: how many use it now, and since when none has."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.in_flight = 0
        self.idle_since = time.monotonic()


class EgressProxiesMiddleware:
    """Leases a proxy per request or per domain/session; see the module documentation."""

    def __init__(
        self,
        crawler: Crawler,
        client: DiscoveryClient,
        *,
        mode: str = "domain",
        selector: Optional[Dict[str, str]] = None,
        ban_codes: Optional[Set[int]] = None,
        ttl_seconds: Optional[int] = None,
        idle_release: float = 30.0,
        threads_max: int = 4,
        give_up: float = 300.0,
        ban_retries: int = 2,
        banned_give_up: float = 60.0,
        unhealthy_retries: int = 2,
        report_outcomes: bool = True,
    ) -> None:
        if mode not in ("domain", "request"):
            raise ValueError(f"EGRESS_PROXIES_MODE must be 'domain' or 'request', not {mode!r}")
        self.crawler = crawler
        self.stats = crawler.stats
        self.client = client
        self.mode = mode
        self.selector = dict(selector or {})
        self.ban_codes = set(ban_codes if ban_codes is not None else (403, 429))
        self.ttl_seconds = ttl_seconds
        self.idle_release = idle_release
        self.give_up = give_up
        self.ban_retries = max(ban_retries, 0)
        self.banned_give_up = banned_give_up
        self.unhealthy_retries = max(unhealthy_retries, 0)
        self.report_outcomes = report_outcomes
        # Each lease's last outcome report in progress: the next report and the release wait
        # for it, so that a report never reaches a lease already released.
        self._reporting: Dict[str, defer.Deferred[Any]] = {}
        # Leases whose release has begun: a report now would find no lease.
        self._releasing: Set[str] = set()
        # Domains every proxy is banned for: until when their requests are dropped.
        self._banned_until: Dict[str, float] = {}
        # Endpoints of proxies out of rotation: requests routed through each and not done.
        self._left: Dict[str, int] = {}
        self._pending: Dict[str, int] = {}
        self._aborter: Optional[task.LoopingCall] = None
        # Since when no acquire has succeeded while some failed for want of a proxy.
        self._unavailable_since: Optional[float] = None
        self._unavailable_domains: Set[str] = set()
        self._closing = False
        self._held: Dict[_Key, _Held] = {}
        self._acquiring: Dict[_Key, List[defer.Deferred[Any]]] = {}
        self._releases: Set[defer.Deferred[Any]] = set()
        # The release in progress of each session's last lease.
        self._session_releases: Dict[str, defer.Deferred[Any]] = {}
        # Own threads for the blocking API calls: an acquire may wait for a proxy, and must
        # not hold up Twisted's pool, which also resolves host names.
        self._pool = ThreadPool(minthreads=0, maxthreads=max(threads_max, 1), name="egress-proxies")
        self._sweeper: Optional[task.LoopingCall] = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> "EgressProxiesMiddleware":
        settings = crawler.settings
        url, token = endpoint_and_token(crawler, "EGRESS_PROXIES_URL", "leased proxies")
        client = DiscoveryClient(
            url,
            token,
            holder=holder(crawler),
            max_wait=settings.getfloat("EGRESS_PROXIES_MAX_WAIT", 30.0),
            renew_every=settings.getfloat("EGRESS_PROXIES_RENEW_INTERVAL", 5.0) or None,
        )
        ttl = settings.getint("EGRESS_PROXIES_TTL", 0)
        middleware = cls(
            crawler,
            client,
            mode=settings.get("EGRESS_PROXIES_MODE", "domain"),
            selector=settings.getdict("EGRESS_PROXIES_SELECTOR"),
            ban_codes={int(c) for c in settings.getlist("EGRESS_PROXIES_BAN_CODES", [403, 429])},
            ttl_seconds=ttl or None,
            idle_release=settings.getfloat("EGRESS_PROXIES_IDLE_RELEASE", 30.0),
            threads_max=settings.getint("EGRESS_PROXIES_THREADS", 4),
            give_up=settings.getfloat("EGRESS_PROXIES_GIVE_UP", 300.0),
            ban_retries=settings.getint("EGRESS_PROXIES_BAN_RETRIES", 2),
            banned_give_up=settings.getfloat("EGRESS_PROXIES_BANNED_GIVE_UP", 60.0),
            unhealthy_retries=settings.getint("EGRESS_PROXIES_UNHEALTHY_RETRIES", 2),
            report_outcomes=settings.getbool("EGRESS_PROXIES_REPORT_OUTCOMES", True),
        )
        client.on_out_of_rotation = middleware._on_out_of_rotation
        crawler.signals.connect(middleware.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(middleware.spider_closed, signal=signals.spider_closed)
        return middleware

    # -- signals --------------------------------------------------------------------------

    def spider_opened(self, spider: Spider) -> None:
        from twisted.internet import reactor

        self._pool.start()
        # Stopped when the reactor stops, as Twisted does with its own pool: its threads would
        # otherwise keep the process alive.
        reactor.addSystemEventTrigger("during", "shutdown", self._pool.stop)  # type: ignore[attr-defined]
        if self.mode == "domain" and self.idle_release > 0:
            self._sweeper = task.LoopingCall(self._release_idle)
            self._sweeper.start(min(self.idle_release, 5.0), now=False)

    async def spider_closed(self, spider: Optional[Spider] = None) -> None:
        """Releases every lease still held (``ok``); the crawl ends once every release and
        outcome report has."""
        if self._sweeper is not None and self._sweeper.running:
            self._sweeper.stop()
        if self._aborter is not None and self._aborter.running:
            self._aborter.stop()
        for key in list(self._held):
            self._drop(key, "ok")
        await maybe_deferred_to_future(self._releases_done())

    @defer.inlineCallbacks
    def _releases_done(self) -> Any:
        # Reports too: one made after its lease was dropped waits in no release.
        while self._releases or self._reporting:
            yield defer.DeferredList(list(self._releases) + list(self._reporting.values()), consumeErrors=True)
        self.client.close()

    # -- downloader middleware ------------------------------------------------------------

    # Coroutines, and `spider` optional: Scrapy 2.13+ deprecates Deferreds returned by
    # middlewares and a required `spider` argument; older ones (2.8) pass it and await these.
    async def process_request(self, request: Request, spider: Optional[Spider] = None) -> None:
        routed = self._process_request(request, spider or self.crawler.spider)
        if routed is not None:
            await maybe_deferred_to_future(routed)

    def _process_request(self, request: Request, spider: Spider) -> Optional[defer.Deferred[Any]]:
        if request.meta.get(SKIP_META) or ("proxy" in request.meta and LEASE_META not in request.meta):
            return None
        domain = urlparse_cached(request).hostname or ""
        session = request.meta.get(SESSION_META)
        banned_until = self._banned_until.get(domain)
        if banned_until is not None:
            if time.time() < banned_until:
                self.stats.inc_value("egress_proxies/banned_everywhere")
                raise IgnoreRequest(f"every proxy is banned for {domain}")
            del self._banned_until[domain]
        if self.mode == "request":
            acquired = self._acquire_in_turn(domain, session)
            acquired.addCallback(self._when_polite)
            acquired.addCallback(self._route, request)
            acquired.addErrback(self._unavailable, domain, spider)
            return acquired
        key = (domain, session)
        held = self._held.get(key)
        if held is not None and held.lease.active:
            self._use(key, held, request)
            return None
        if held is not None:  # the server dropped it (expired while unused, revoked)
            self._drop(key, "ok")
        waiting: defer.Deferred[Any] = defer.Deferred()
        waiting.addCallback(lambda held: self._use(key, held, request))
        waiting.addErrback(self._unavailable, domain, spider)
        waiters = self._acquiring.get(key)
        if waiters is not None:  # another request of this domain is acquiring: share it
            waiters.append(waiting)
            return waiting
        self._acquiring[key] = [waiting]
        self._acquire_in_turn(domain, session).addBoth(self._acquired, key)
        return waiting

    def process_response(
        self, request: Request, response: Response, spider: Optional[Spider] = None
    ) -> Union[Request, Response]:
        spider = spider or self.crawler.spider
        lease = self._lease_of(request)
        if lease is None:
            return response
        banned = response.status in self.ban_codes
        self._report(lease, request, status=response.status, bytes_received=len(response.body))
        self._done(request, lease, "banned" if banned else "ok")
        if banned:
            again = self._send_again(request, lease, response.status, spider)
            if again is not None:
                return again
        return response

    def _send_again(self, request: Request, lease: Lease, status: int, spider: Spider) -> Optional[Request]:
        """A copy of ``request`` to route through another proxy after a ban, within
        ``EGRESS_PROXIES_BAN_RETRIES``; ``None`` past it."""
        if self.ban_retries == 0:
            return None
        again = self._reroute(request, BAN_RETRIES_META, self.ban_retries, "ban_retries")
        if again is not None:
            spider.logger.info(
                "%s answered %d through %s (a ban): sending it again through another proxy (%d of %d)",
                request.url,
                status,
                lease.proxy.key,
                again.meta[BAN_RETRIES_META],
                self.ban_retries,
            )
        return again

    def _reroute(self, request: Request, tries_meta: str, limit: int, stat: str) -> Optional[Request]:
        """A copy of ``request`` without its routing, to go through another proxy, counted in
        ``request.meta[tries_meta]`` and the stat ``{stat}``; ``None``
        once ``limit`` copies were made (counted in the stat ``{stat}_exhausted``)."""
        tries = int(request.meta.get(tries_meta, 0))
        if tries >= limit:
            self.stats.inc_value(f"egress_proxies/{stat}_exhausted")
            return None
        again = request.replace(dont_filter=True)
        for key in _ROUTING_META:
            again.meta.pop(key, None)
        again.meta[tries_meta] = tries + 1
        self.stats.inc_value(f"egress_proxies/{stat}")
        return again

    def process_exception(
        self, request: Request, exception: BaseException, spider: Optional[Spider] = None
    ) -> Optional[Request]:
        lease = self._lease_of(request)
        if lease is None:
            return None
        self._report(lease, request, error=_error_kind(exception))
        self._done(request, lease, "error")
        if not lease.out_of_rotation:
            return None  # Scrapy's RetryMiddleware decides, as for any download error
        return self._reroute(request, UNHEALTHY_RETRIES_META, self.unhealthy_retries, "unhealthy_retries")

    # -- proxies out of rotation ----------------------------------------------------------

    def _on_out_of_rotation(self, lease: Lease) -> None:
        """The client's renewal thread heard that ``lease``'s proxy is out of rotation."""
        from twisted.internet import reactor

        reactor.callFromThread(self._leave, lease)  # type: ignore[attr-defined]

    def _leave(self, lease: Lease) -> None:
        """Stops using ``lease``'s proxy: releases the lease, and aborts the connections open
        to the proxy, now and while requests routed through it before are still pending (a
        request queued in Scrapy's downloader connects later)."""
        if self._closing_down():
            return
        self.stats.inc_value("egress_proxies/out_of_rotation")
        self.crawler.spider.logger.warning(
            "proxy %s is out of rotation (its health checks fail): moving its requests to another proxy",
            lease.proxy.key,
        )
        for key, held in list(self._held.items()):
            if held.lease is lease:
                self._drop(key, "error")
        endpoint = lease.proxy.endpoint
        self._left[endpoint] = self._left.get(endpoint, 0) + 1
        self._abort_connections()
        if self._aborter is None or not self._aborter.running:
            self._aborter = task.LoopingCall(self._abort_connections)
            self._aborter.start(0.2, now=False)

    def _closing_down(self) -> bool:
        return self.crawler.engine is None or self.crawler.spider is None

    def _abort_connections(self) -> None:
        from twisted.internet import reactor

        for endpoint in [e for e in self._left if not self._pending.get(e)]:
            del self._left[endpoint]
        if not self._left:
            if self._aborter is not None and self._aborter.running:
                self._aborter.stop()
            return
        transports = set(reactor.getReaders()) | set(reactor.getWriters())  # type: ignore[attr-defined]
        for transport in transports:
            get_peer = getattr(transport, "getPeer", None)
            abort = getattr(transport, "abortConnection", None)
            if get_peer is None or abort is None:
                continue
            try:
                peer = get_peer()
            except Exception:  # not connected (yet, or any more)
                continue
            host, port = getattr(peer, "host", None), getattr(peer, "port", None)
            if host is None or port is None:
                continue
            if _endpoint(host, port) in self._left:
                self.stats.inc_value("egress_proxies/aborted_connections")
                abort()

    # -- leases ---------------------------------------------------------------------------

    def _acquire_in_turn(self, domain: str, session: Optional[str]) -> defer.Deferred[Any]:
        """Acquires in a pool thread; for a session, once its last lease's release is done.

        Releases run in the background; without the wait, a session's next request could find
        the session's proxy still taken by its previous lease and be bound to another proxy.
        """
        releasing = self._session_releases.get(session) if session else None
        if releasing is None:
            return self._in_pool(self._acquire, domain, session)
        after: defer.Deferred[Any] = defer.DeferredList([releasing])
        after.addCallback(lambda _: self._in_pool(self._acquire, domain, session))
        return after

    def _acquire(self, domain: str, session: Optional[str]) -> Lease:
        """Runs in a pool thread. A first attempt without waiting: when it finds nothing, a
        listing tells whether every proxy is banned for the domain for long (no point in
        waiting); otherwise the acquire waits as ``Retry-After`` says, within the bound."""

        def acquire(max_wait: Optional[float]) -> Lease:
            return self.client.acquire(
                self.selector or None,
                target_domain=domain or None,
                session_key=session,
                ttl_seconds=self.ttl_seconds,
                max_wait=max_wait,
            )

        try:
            lease = acquire(0)
        except NoProxyAvailable:
            if domain:
                self._check_banned_everywhere(domain)
            lease = acquire(None)
        self._unavailable_since = None
        return lease

    def _check_banned_everywhere(self, domain: str) -> None:
        """Raises :class:`_BannedEverywhere` if every proxy matching the selector is banned
        for ``domain`` for at least ``EGRESS_PROXIES_BANNED_GIVE_UP`` seconds."""
        if self.banned_give_up <= 0:
            return
        listing = self.client.list_proxies(self.selector or None, target_domain=domain)
        ends = [p.bans.get(domain) for p in listing]
        if not listing or any(end is None for end in ends):
            return
        soonest = min(end for end in ends if end is not None)
        if (soonest - datetime.now(timezone.utc)).total_seconds() >= self.banned_give_up:
            raise _BannedEverywhere(domain, soonest)

    def _unavailable(self, failure: Failure, domain: str, spider: Spider) -> None:
        """A request that found no proxy within ``EGRESS_PROXIES_MAX_WAIT``: dropped with one
        warning per domain (no traceback); past ``EGRESS_PROXIES_GIVE_UP`` the spider closes."""
        failure.trap(NoProxyAvailable)
        if isinstance(failure.value, _BannedEverywhere):
            self._banned_everywhere(failure.value, spider)
        self.stats.inc_value("egress_proxies/no_proxy_available")
        now = time.monotonic()
        if self._unavailable_since is None:
            self._unavailable_since = now
        if domain not in self._unavailable_domains:
            self._unavailable_domains.add(domain)
            spider.logger.warning(
                "no proxy available for %s (selector %s): dropping its requests until one is; %s",
                domain or "(no host)",
                self.selector or "{}",
                failure.value,
            )
        if self.give_up > 0 and now - self._unavailable_since >= self.give_up and not self._closing:
            self._closing = True
            spider.logger.warning(
                "no proxy available for %.0f s: closing the spider (EGRESS_PROXIES_GIVE_UP)",
                now - self._unavailable_since,
            )
            self._close_spider(spider, "egress_proxies_unavailable")
        raise IgnoreRequest(f"no proxy available for {domain}")

    def _close_spider(self, spider: Spider, reason: str) -> None:
        engine = self.crawler.engine
        close_async = getattr(engine, "close_spider_async", None)
        if close_async is None:  # before Scrapy 2.14
            engine.close_spider(spider, reason)
            return
        # Scrapy 2.14+ deprecates close_spider(); the coroutine runs on whichever reactor.
        closing = deferred_from_coro(close_async(reason=reason))
        closing.addErrback(lambda failure: spider.logger.warning("closing the spider failed: %s", failure.value))

    def _banned_everywhere(self, err: _BannedEverywhere, spider: Spider) -> None:
        self.stats.inc_value("egress_proxies/banned_everywhere")
        if err.domain not in self._banned_until:
            spider.logger.warning(
                "every proxy (selector %s) is banned for %s until %s: dropping its requests until then"
                " (EGRESS_PROXIES_BANNED_GIVE_UP)",
                self.selector or "{}",
                err.domain,
                err.until.isoformat(timespec="seconds"),
            )
        self._banned_until[err.domain] = err.until.timestamp()
        raise IgnoreRequest(f"every proxy is banned for {err.domain}")

    def _acquired(self, result: Any, key: _Key) -> None:
        waiters = self._acquiring.pop(key, [])
        if isinstance(result, Failure):
            for waiter in waiters:
                waiter.errback(result)
            return None
        self.stats.inc_value("egress_proxies/acquired")
        held = _Held(result)
        self._held[key] = held
        for waiter in waiters:
            waiter.callback(held)
        return None

    def _use(self, key: _Key, held: _Held, request: Request) -> None:
        held.in_flight += 1
        self._route(held.lease, request, counted=True)
        request.meta["_egress_proxies_key"] = key

    def _when_polite(self, lease: Lease) -> Union[Lease, defer.Deferred[Lease]]:
        """``lease`` once the start the operator reserved for its request (``notBefore``, under
        its politeness for the domain) has come; at once without one."""
        if lease.not_before is None:
            return lease
        wait = (lease.not_before - datetime.now(timezone.utc)).total_seconds()
        if wait <= 0:
            return lease
        self.stats.inc_value("egress_proxies/politeness_waits")
        from twisted.internet import reactor  # the one Scrapy installed

        return task.deferLater(cast(IReactorTime, reactor), wait, lambda: lease)

    def _route(self, lease: Lease, request: Request, counted: bool = False) -> None:
        if not counted:
            self.stats.inc_value("egress_proxies/acquired")
        request.meta[LEASE_META] = lease
        # HttpProxyMiddleware (after this one) turns the URL's credentials into
        # Proxy-Authorization, and drops a stale one when the proxy changes (a retry).
        request.meta["proxy"] = lease.proxy_url
        request.meta["_egress_proxies_pending"] = True
        endpoint = lease.proxy.endpoint
        self._pending[endpoint] = self._pending.get(endpoint, 0) + 1

    def _lease_of(self, request: Request) -> Optional[Lease]:
        # Each download ends once (response or exception); a retried copy is routed afresh.
        if not request.meta.pop("_egress_proxies_pending", False):
            return None
        lease: Optional[Lease] = request.meta.get(LEASE_META)
        if lease is not None:
            endpoint = lease.proxy.endpoint
            left = self._pending.get(endpoint, 0) - 1
            if left > 0:
                self._pending[endpoint] = left
            else:
                self._pending.pop(endpoint, None)
        return lease

    def _done(self, request: Request, lease: Lease, outcome: Outcome) -> None:
        domain = urlparse_cached(request).hostname or None
        if self.mode == "request":
            self._release(lease, outcome, domain)
            return
        key = request.meta.get("_egress_proxies_key")
        held = self._held.get(key) if key is not None else None
        if held is None or held.lease is not lease:
            return  # already dropped (a ban or error seen on another request of the domain)
        held.in_flight -= 1
        held.idle_since = time.monotonic()
        if outcome != "ok" or not lease.active:
            # The next request of this domain gets a fresh lease, which skips a banned proxy.
            self._drop(key, outcome, domain)

    def _drop(self, key: _Key, outcome: Outcome, domain: Optional[str] = None) -> None:
        held = self._held.pop(key)
        self._release(held.lease, outcome, domain or key[0] or None)

    def _release_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_release
        for key, held in list(self._held.items()):
            if held.in_flight == 0 and held.idle_since <= cutoff:
                self.stats.inc_value("egress_proxies/idle_released")
                self._drop(key, "ok")

    def _report(
        self,
        lease: Lease,
        request: Request,
        status: Optional[int] = None,
        error: Optional[str] = None,
        bytes_received: Optional[int] = None,
    ) -> None:
        """Reports how ``request`` through ``lease``'s proxy went, after the lease's earlier
        reports (a failed report is counted, never raised: it is only statistics)."""
        domain = urlparse_cached(request).hostname
        if not self.report_outcomes or not domain:
            return
        if lease.released or lease.lease_id in self._releasing:
            # A response still in flight when its lease ended (after a ban on another request
            # of the domain, say): the API no longer takes reports for that lease.
            self.stats.inc_value("egress_proxies/outcomes_unreported")
            return
        latency = request.meta.get("download_latency")
        latency_ms = int(latency * 1000) if isinstance(latency, (int, float)) else None

        def send() -> None:
            self.client.report(
                lease, domain, status=status, error=error, latency_ms=latency_ms, bytes_received=bytes_received
            )

        reported: defer.Deferred[Any] = defer.Deferred()

        def start(_: Any = None) -> None:
            self._in_pool(send).addBoth(reported.callback)

        def finished(result: Any) -> None:
            failed = isinstance(result, Failure)
            self.stats.inc_value("egress_proxies/outcome_reports_failed" if failed else "egress_proxies/outcomes_reported")
            if self._reporting.get(lease.lease_id) is reported:
                del self._reporting[lease.lease_id]

        previous = self._reporting.get(lease.lease_id)
        self._reporting[lease.lease_id] = reported
        reported.addBoth(finished)
        if previous is None:
            start()
        else:
            previous.addBoth(start)

    def _release(self, lease: Lease, outcome: Outcome, domain: Optional[str]) -> None:
        target = domain if outcome == "banned" else None

        def release() -> bool:
            return self.client.release(lease, outcome, target_domain=target)

        def finished(result: Any) -> None:
            self._releases.discard(releasing)
            if session and self._session_releases.get(session) is releasing:
                del self._session_releases[session]
            if isinstance(result, Failure):
                self.crawler.spider.logger.warning(
                    "releasing lease on %s failed: %s", lease.proxy.key, result.getErrorMessage()
                )
                return None
            self.stats.inc_value("egress_proxies/renewals", lease.renewals)
            # False: the server no longer knew it (expired or revoked before the release).
            self.stats.inc_value(f"egress_proxies/released/{outcome}" if result else "egress_proxies/lost")
            return None

        session = lease.session_key
        self._releasing.add(lease.lease_id)

        def releasing_done(result: Any) -> Any:
            self._releasing.discard(lease.lease_id)
            return result

        reporting = self._reporting.pop(lease.lease_id, None)
        if reporting is None:
            releasing = self._in_pool(release)
        else:
            # After the lease's last report: a report after the release would find no lease.
            releasing = defer.Deferred()
            reporting.addBoth(lambda _: self._in_pool(release).addBoth(releasing.callback))
        releasing.addBoth(releasing_done)
        self._releases.add(releasing)
        if session:
            self._session_releases[session] = releasing
        releasing.addBoth(finished)

    def _in_pool(self, function: Any, *args: Any) -> defer.Deferred[Any]:
        # Imported here: importing the reactor installs one, and Scrapy picks it (asyncio or not).
        from twisted.internet import reactor

        return threads.deferToThreadPool(reactor, self._pool, function, *args)


def _error_kind(exception: BaseException) -> str:
    """What the operator's statistics call a download error: ``timeout``, ``connect`` (no
    connection to the proxy) or ``reset``."""
    from twisted.internet import error as net

    if isinstance(exception, (net.TimeoutError, defer.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exception, (net.ConnectionRefusedError, net.ConnectError, ConnectionRefusedError)):
        return "connect"
    return "reset"


def _endpoint(host: str, port: int) -> str:
    """``host:port`` as the API names endpoints (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
