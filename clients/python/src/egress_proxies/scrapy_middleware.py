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
    request, released with its response.
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
``EGRESS_PROXIES_HOLDER``
    the lease holder (default: ``scrapy/<spider name>``).
``EGRESS_PROXIES_IDLE_RELEASE``
    in ``domain`` mode, release a domain's lease after this many seconds without requests
    (default 30; 0 keeps it until the crawl ends).
``EGRESS_PROXIES_THREADS``
    threads for the blocking API calls (default 4), apart from Twisted's DNS thread pool.

Per request (``request.meta``): ``egress_proxies_session`` names a sticky session (its own
lease, acquired with that ``sessionKey``); ``egress_proxies_skip`` sends the request without
a leased proxy, as does a ``proxy`` set by someone else. The middleware sets
``egress_proxies_lease`` (a :class:`~egress_proxies.client.Lease`) on every request it routes.

Stats: ``egress_proxies/acquired``, ``egress_proxies/released/<outcome>``,
``egress_proxies/idle_released`` (of those, domain leases released for being idle),
``egress_proxies/renewals``, ``egress_proxies/lost`` (leases the server dropped before release),
``egress_proxies/no_proxy_available`` (requests dropped for want of a proxy),
``egress_proxies/ban_retries`` (requests sent again after a ban) and
``egress_proxies/ban_retries_exhausted`` (ban responses passed on past the bound).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from scrapy import Request, Spider, signals
from scrapy.crawler import Crawler
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import Response
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import defer, task, threads
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from .client import DiscoveryClient, Lease, NoProxyAvailable, Outcome

__all__ = ["EgressProxiesMiddleware"]

LEASE_META = "egress_proxies_lease"
SESSION_META = "egress_proxies_session"
SKIP_META = "egress_proxies_skip"
BAN_RETRIES_META = "egress_proxies_ban_retries"
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
        if not settings.getbool("EGRESS_PROXIES_ENABLED", True):
            raise NotConfigured("EGRESS_PROXIES_ENABLED is off")
        url = settings.get("EGRESS_PROXIES_URL")
        token = settings.get("EGRESS_PROXIES_TOKEN")
        token_file = settings.get("EGRESS_PROXIES_TOKEN_FILE")
        if not token and token_file:
            token = Path(token_file).read_text().strip()
        if not url or not token:
            # An error, not NotConfigured: Scrapy would carry on without the middleware and
            # crawl from this host's own address.
            raise ValueError(
                "EGRESS_PROXIES_URL and EGRESS_PROXIES_TOKEN (or EGRESS_PROXIES_TOKEN_FILE) are required;"
                " set EGRESS_PROXIES_ENABLED = False to crawl without leased proxies"
            )
        spider_name = getattr(crawler.spidercls, "name", None) or "spider"
        client = DiscoveryClient(
            url,
            token,
            holder=settings.get("EGRESS_PROXIES_HOLDER") or f"scrapy/{spider_name}",
            max_wait=settings.getfloat("EGRESS_PROXIES_MAX_WAIT", 30.0),
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
        )
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

    def spider_closed(self, spider: Spider) -> defer.Deferred[Any]:
        """Releases every lease still held (``ok``); the crawl ends once every release has."""
        if self._sweeper is not None and self._sweeper.running:
            self._sweeper.stop()
        for key in list(self._held):
            self._drop(key, "ok")
        return self._releases_done()

    @defer.inlineCallbacks
    def _releases_done(self) -> Any:
        while self._releases:
            yield defer.DeferredList(list(self._releases), consumeErrors=True)
        self.client.close()

    # -- downloader middleware ------------------------------------------------------------

    def process_request(self, request: Request, spider: Spider) -> Optional[defer.Deferred[Any]]:
        if request.meta.get(SKIP_META) or ("proxy" in request.meta and LEASE_META not in request.meta):
            return None
        domain = urlparse_cached(request).hostname or ""
        session = request.meta.get(SESSION_META)
        if self.mode == "request":
            acquired = self._acquire_in_turn(domain, session)
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

    def process_response(self, request: Request, response: Response, spider: Spider) -> Union[Request, Response]:
        lease = self._lease_of(request)
        if lease is None:
            return response
        banned = response.status in self.ban_codes
        self._done(request, lease, "banned" if banned else "ok")
        if banned:
            again = self._send_again(request, lease, response.status, spider)
            if again is not None:
                return again
        return response

    def _send_again(self, request: Request, lease: Lease, status: int, spider: Spider) -> Optional[Request]:
        """A copy of ``request`` to route through another proxy after a ban, within
        ``EGRESS_PROXIES_BAN_RETRIES``; ``None`` past it."""
        tries = int(request.meta.get(BAN_RETRIES_META, 0))
        if tries >= self.ban_retries:
            if self.ban_retries > 0:
                self.stats.inc_value("egress_proxies/ban_retries_exhausted")
            return None
        again = request.replace(dont_filter=True)
        for key in _ROUTING_META:
            again.meta.pop(key, None)
        again.meta[BAN_RETRIES_META] = tries + 1
        self.stats.inc_value("egress_proxies/ban_retries")
        spider.logger.info(
            "%s answered %d through %s (a ban): sending it again through another proxy (%d of %d)",
            request.url,
            status,
            lease.proxy.key,
            tries + 1,
            self.ban_retries,
        )
        return again

    def process_exception(self, request: Request, exception: BaseException, spider: Spider) -> None:
        lease = self._lease_of(request)
        if lease is not None:
            self._done(request, lease, "error")
        return None

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
        lease = self.client.acquire(
            self.selector or None,
            target_domain=domain or None,
            session_key=session,
            ttl_seconds=self.ttl_seconds,
        )
        self._unavailable_since = None
        return lease

    def _unavailable(self, failure: Failure, domain: str, spider: Spider) -> None:
        """A request that found no proxy within ``EGRESS_PROXIES_MAX_WAIT``: dropped with one
        warning per domain (no traceback); past ``EGRESS_PROXIES_GIVE_UP`` the spider closes."""
        failure.trap(NoProxyAvailable)
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
            self.crawler.engine.close_spider(spider, "egress_proxies_unavailable")
        raise IgnoreRequest(f"no proxy available for {domain}")

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

    def _route(self, lease: Lease, request: Request, counted: bool = False) -> None:
        if not counted:
            self.stats.inc_value("egress_proxies/acquired")
        request.meta[LEASE_META] = lease
        # HttpProxyMiddleware (after this one) turns the URL's credentials into
        # Proxy-Authorization, and drops a stale one when the proxy changes (a retry).
        request.meta["proxy"] = lease.proxy_url
        request.meta["_egress_proxies_pending"] = True

    def _lease_of(self, request: Request) -> Optional[Lease]:
        # Each download ends once (response or exception); a retried copy is routed afresh.
        if not request.meta.pop("_egress_proxies_pending", False):
            return None
        lease: Optional[Lease] = request.meta.get(LEASE_META)
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
        releasing = self._in_pool(release)
        self._releases.add(releasing)
        if session:
            self._session_releases[session] = releasing
        releasing.addBoth(finished)

    def _in_pool(self, function: Any, *args: Any) -> defer.Deferred[Any]:
        # Imported here: importing the reactor installs one, and Scrapy picks it (asyncio or not).
        from twisted.internet import reactor

        return threads.deferToThreadPool(reactor, self._pool, function, *args)
