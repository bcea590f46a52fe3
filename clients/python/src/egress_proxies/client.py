"""A small client for the egress-proxies-operator discovery API (see docs/api.md).

It owns the HTTP exchanges with the API (standard library only), the background renewal of
the leases it granted, and the bounded wait on a 503 with ``Retry-After``. Thread-safe: one
client can serve every thread of a crawler.

    client = DiscoveryClient("http://127.0.0.1:8080", token, holder="crawler-7")
    with client.lease(selector={"region": "eu"}, target_domain="shop.example") as lease:
        fetch(url, proxy=lease.proxy_url)   # released with outcome "ok" (or "error" on exception)
    client.close()
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

try:  # Python 3.8+ has Literal; keep the annotation importable everywhere.
    from typing import Literal

    Outcome = Literal["ok", "banned", "error"]
except ImportError:  # pragma: no cover
    Outcome = str  # type: ignore[misc]

__all__ = [
    "DiscoveryClient",
    "DiscoveryError",
    "Lease",
    "LeaseNotFound",
    "NoProxyAvailable",
    "Proxy",
    "ProxyStatus",
    "StaleToken",
]

_log = logging.getLogger(__name__)

# 503 codes after which the same request can succeed later (docs/api.md, "Errors").
_WAITABLE_CODES = frozenset({"no_proxy_available", "not_ready", "not_leader", "request_in_progress"})
# Retry-After when a 503 carries none (the server always sends one; a proxy in front may not).
_DEFAULT_RETRY_AFTER = 1.0
# Attempts of a release whose answer leaves it in doubt (no answer, or a 5xx).
_RELEASE_ATTEMPTS = 3


def _may_have_happened(err: DiscoveryError) -> bool:
    """Whether the operation that got ``err`` may have happened: no answer came, or a 5xx (a
    journal that may hold it); sending it again settles it."""
    return err.code == "no_answer" or err.status >= 500


class DiscoveryError(Exception):
    """An error answer from the API: its HTTP status, stable ``code`` and message.

    ``status`` is 0 when no answer came: ``code`` is ``"unreachable"`` when the request was
    never sent (no connection), ``"no_answer"`` when it may have been (the connection broke or
    timed out after sending): the operation may then have happened.
    """

    def __init__(self, status: int, code: str, message: str, retry_after: Optional[float] = None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class NoProxyAvailable(DiscoveryError):
    """Nothing eligible (503) and the bounded wait is over; ``retry_after`` is the server's hint."""


class LeaseNotFound(DiscoveryError):
    """404 ``lease_not_found``: the lease was released, revoked or has expired."""


class StaleToken(DiscoveryError):
    """409 ``stale_token``: a newer fencing token was issued for the lease."""


@dataclass(frozen=True)
class Proxy:
    """A proxy as the API names it (no credentials)."""

    key: str
    namespace: str
    name: str
    endpoint: str
    attributes: Dict[str, str]

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "Proxy":
        return cls(
            key=body["key"],
            namespace=body["namespace"],
            name=body["name"],
            endpoint=body["endpoint"],
            attributes=dict(body.get("attributes") or {}),
        )


@dataclass(frozen=True)
class ProxyStatus:
    """A proxy in a listing, with how it stands for new leases."""

    proxy: Proxy
    availability: str
    """``available``, ``busy``, ``coolingDown``, ``banned`` (for the listing's target
    domain), ``closed`` or ``draining``."""
    active_leases: int
    max_concurrent: int
    bans: Dict[str, datetime]
    """Active bans: when each banned domain's ban ends."""
    outcomes: Optional[Dict[str, Any]] = None
    """What went through it (the API's ``outcomes``, as it is: ``total``, ``domains``,
    ``otherDomains``), once anything was recorded; see ``report``."""

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "ProxyStatus":
        return cls(
            proxy=Proxy.from_json(body),
            availability=body["availability"],
            active_leases=int(body["activeLeases"]),
            max_concurrent=int(body["maxConcurrent"]),
            bans={ban["domain"]: _parse_time(ban["until"]) for ban in body.get("bans") or []},
            outcomes=body.get("outcomes"),
        )

    def domain_outcomes(self, domain: str) -> Optional[Dict[str, Any]]:
        """The statistics recorded for ``domain`` (``requests``, ``successes``, ``failures``,
        ``bans``, ``latencyMs``, bytes), if the listing has them."""
        for entry in (self.outcomes or {}).get("domains") or []:
            if entry.get("domain") == domain:
                stats: Dict[str, Any] = entry.get("stats") or {}
                return stats
        return None


def _parse_time(text: str) -> datetime:
    # fromisoformat reads a trailing "Z" only from Python 3.11 on.
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


@dataclass(eq=False)
class Lease:
    """One granted lease. Its fencing token and expiry change when it is renewed.

    ``proxy_url`` (``http://[user:password@]host:port``) carries the proxy's credentials: do
    not log it.
    """

    lease_id: str
    proxy_url: str = field(repr=False)
    proxy: Proxy
    acquired_at: datetime
    ttl_seconds: int
    target_domain: Optional[str]
    session_key: Optional[str]
    fencing_token: int
    expires_at: datetime
    renewals: int = 0
    """How many times the client renewed it."""
    lost: Optional[DiscoveryError] = None
    """Why background renewal gave up on it (the server no longer knows it), if it did."""
    out_of_rotation: bool = False
    """A renewal said the operator took the proxy out of rotation (its health checks fail, or
    it is being replaced): the lease still runs, but requests through the proxy are likely
    failing or hanging. Move the work to another lease and release this one (``error``)."""
    released: bool = False
    not_before: Optional[datetime] = None
    """Under the operator's politeness for the lease's target domain: when the next request to
    that domain through the proxy may start (from the acquire, then from each ``report``). The
    operator reserved that start for this holder; send no earlier. ``None``: no limit applies."""
    # Serialises renew and release, so that a release always presents the latest token.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def active(self) -> bool:
        """Neither released nor lost, as far as this client knows."""
        return not self.released and self.lost is None


class DiscoveryClient:
    """Talks to one discovery API with one bearer token.

    ``max_wait`` bounds how long :meth:`acquire` keeps retrying while the API answers 503
    (nothing eligible, or a replica not ready / not leading), sleeping as ``Retry-After`` says.
    Leases are renewed in a background thread at a third of their TTL (at most every
    ``renew_every`` seconds, if given) until released; call :meth:`close` (or use the client
    as a context manager) to stop it. ``on_out_of_rotation`` is called (from that thread, once
    per lease) when a renewal says the lease's proxy is out of rotation.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        holder: str = "egress-proxies-python",
        timeout: float = 10.0,
        max_wait: float = 30.0,
        renew: bool = True,
        renew_every: Optional[float] = None,
        on_out_of_rotation: Optional[Callable[[Lease], None]] = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.holder = holder
        self.timeout = timeout
        self.max_wait = max_wait
        self._token = token.strip()
        # No proxy for the API itself, whatever http_proxy says: the crawler's environment
        # often points at the very proxies it leases.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._renew_enabled = renew
        self.renew_every = renew_every
        self.on_out_of_rotation = on_out_of_rotation
        self._renewer: Optional[_Renewer] = None
        self._renewer_lock = threading.Lock()

    # -- context management -------------------------------------------------------------

    def __enter__(self) -> "DiscoveryClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops background renewal. Leases still held stay valid until they expire."""
        with self._renewer_lock:
            renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    # -- API calls ------------------------------------------------------------------------

    def list_proxies(
        self, selector: Optional[Mapping[str, str]] = None, *, target_domain: Optional[str] = None
    ) -> List[ProxyStatus]:
        """``GET /v1/proxies``: proxies whose attributes match every ``selector`` term; with
        ``target_domain``, as a crawler of that domain sees them (``banned`` for it)."""
        path = "/v1/proxies"
        query: Dict[str, str] = {}
        if selector:
            query["selector"] = ",".join(f"{k}={v}" for k, v in selector.items())
        if target_domain:
            query["targetDomain"] = target_domain
        if query:
            path += "?" + urllib.parse.urlencode(query)
        _, body, _ = self._call("GET", path)
        return [ProxyStatus.from_json(p) for p in body["proxies"]]

    def acquire(
        self,
        selector: Optional[Mapping[str, str]] = None,
        *,
        target_domain: Optional[str] = None,
        session_key: Optional[str] = None,
        ttl_seconds: Optional[int] = None,
        holder: Optional[str] = None,
        max_wait: Optional[float] = None,
    ) -> Lease:
        """``POST /v1/leases``: a lease on an eligible proxy, renewed in the background.

        On a 503 it waits as ``Retry-After`` says and tries again, for at most ``max_wait``
        seconds in all (default: the client's); then raises :class:`NoProxyAvailable`.

        Every acquire carries a fresh ``requestId``, so one that gets no answer (or a 5xx) is
        sent again as it was, within the same bound: the API answers the lease the first one
        was granted, if it was, instead of granting a second.
        """
        body: Dict[str, Any] = {"holder": holder or self.holder, "requestId": uuid.uuid4().hex}
        if selector:
            body["selector"] = dict(selector)
        if ttl_seconds is not None:
            body["ttlSeconds"] = ttl_seconds
        if target_domain:
            body["targetDomain"] = target_domain
        if session_key:
            body["sessionKey"] = session_key
        budget = self.max_wait if max_wait is None else max_wait
        deadline = time.monotonic() + max(budget, 0.0)
        while True:
            try:
                _, answer, _ = self._call("POST", "/v1/leases", body)
                break
            except DiscoveryError as err:
                waitable = err.status == 503 and err.code in _WAITABLE_CODES
                # It may have been granted: the same requestId settles it.
                if not waitable and not _may_have_happened(err):
                    raise
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if not waitable:
                        raise
                    raise NoProxyAvailable(err.status, err.code, err.message, err.retry_after) from None
                # A slot can free up before Retry-After (a release), but not a cooldown: honour
                # the hint, within the budget, and make a last attempt when the budget ends.
                delay = err.retry_after or (_DEFAULT_RETRY_AFTER if waitable else 0.2)
                time.sleep(min(delay, remaining))
        lease = Lease(
            lease_id=answer["leaseId"],
            proxy_url=answer["proxyUrl"],
            proxy=Proxy.from_json(answer["proxy"]),
            acquired_at=_parse_time(answer["acquiredAt"]),
            ttl_seconds=int(answer["ttlSeconds"]),
            target_domain=target_domain,
            session_key=session_key,
            fencing_token=int(answer["fencingToken"]),
            expires_at=_parse_time(answer["expiresAt"]),
            not_before=_parse_time(answer["notBefore"]) if "notBefore" in answer else None,
        )
        if self._renew_enabled:
            self._renewer_for().add(lease)
        return lease

    def renew(self, lease: Lease, ttl_seconds: Optional[int] = None) -> None:
        """``POST /v1/leases/{id}/renew``: a new fencing token and expiry (updated in ``lease``)."""
        with lease._lock:
            self._renew_locked(lease, ttl_seconds)

    def _renew_locked(self, lease: Lease, ttl_seconds: Optional[int]) -> None:
        if lease.released:
            raise LeaseNotFound(404, "lease_not_found", "the lease was released by this client")
        body: Dict[str, Any] = {"fencingToken": lease.fencing_token}
        if ttl_seconds is not None:
            body["ttlSeconds"] = ttl_seconds
        _, answer, _ = self._call("POST", f"/v1/leases/{_quote(lease.lease_id)}/renew", body)
        lease.fencing_token = int(answer["fencingToken"])
        lease.expires_at = _parse_time(answer["expiresAt"])
        lease.renewals += 1
        # Sticky: a proxy back in rotation later does not make this lease's requests whole.
        lease.out_of_rotation = lease.out_of_rotation or bool(answer.get("outOfRotation", False))

    def report(
        self,
        lease: Lease,
        target_domain: Optional[str] = None,
        *,
        status: Optional[int] = None,
        error: Optional[str] = None,
        latency_ms: Optional[int] = None,
        bytes_received: Optional[int] = None,
        bytes_sent: Optional[int] = None,
    ) -> Optional[datetime]:
        """``POST /v1/leases/{id}/outcomes``: how one request through the lease's proxy went, for
        the proxy's statistics per target domain (``target_domain``, default the lease's). Give
        the target's ``status``, or ``error`` (``connect``, ``timeout``, ``reset``,
        ``proxy_error``) when there was none. Sent once: a report is not worth a retry.

        Returns (and keeps in ``lease.not_before``) when the next request to that domain through
        the proxy may start, under the operator's politeness; ``None`` when no limit applies."""
        domain = target_domain or lease.target_domain
        if not domain:
            raise ValueError("report needs a target_domain (the lease has none)")
        body: Dict[str, Any] = {"fencingToken": lease.fencing_token, "targetDomain": domain}
        for key, value in (
            ("status", status),
            ("error", error),
            ("latencyMs", latency_ms),
            ("bytesReceived", bytes_received),
            ("bytesSent", bytes_sent),
        ):
            if value is not None:
                body[key] = value
        _, answer, _ = self._call("POST", f"/v1/leases/{_quote(lease.lease_id)}/outcomes", body)
        lease.not_before = _parse_time(answer["notBefore"]) if "notBefore" in answer else None
        return lease.not_before

    def release(self, lease: Lease, outcome: Outcome = "ok", target_domain: Optional[str] = None) -> bool:
        """``POST /v1/leases/{id}/release`` with how it went: ``ok``, ``banned`` or ``error``.

        ``banned`` rests the proxy for ``target_domain`` (default: the lease's). Returns False
        when there was nothing to release: already released here, or unknown to the server
        (expired or revoked).

        A release that gets no answer (or a 5xx) is sent again, up to three attempts in all: a
        404 then means the earlier attempt released it (True). If every attempt stays in doubt,
        the last error is raised and the lease ends at its expiry at the latest.
        """
        if self._renewer is not None:
            self._renewer.discard(lease)
        with lease._lock:
            if lease.released:
                return False
            body: Dict[str, Any] = {"fencingToken": lease.fencing_token, "outcome": outcome}
            if target_domain:
                body["targetDomain"] = target_domain
            maybe_done = False
            for attempt in range(1, _RELEASE_ATTEMPTS + 1):
                try:
                    self._call("POST", f"/v1/leases/{_quote(lease.lease_id)}/release", body)
                except LeaseNotFound as err:
                    lease.released = True
                    if maybe_done:
                        return True
                    lease.lost = lease.lost or err
                    return False
                except DiscoveryError as err:
                    retry = _may_have_happened(err) or err.code == "unreachable"
                    if not retry or attempt == _RELEASE_ATTEMPTS:
                        raise
                    maybe_done = maybe_done or _may_have_happened(err)
                    time.sleep(min(err.retry_after or 0.2, 1.0))
                    continue
                lease.released = True
                return True
            raise AssertionError("unreachable: the last attempt returns or raises")

    @contextmanager
    def lease(self, selector: Optional[Mapping[str, str]] = None, **acquire_args: Any) -> Iterator[Lease]:
        """A lease for the ``with`` block: released ``ok``, or ``error`` if the block raises.

        Inside the block, ``client.release(lease, "banned")`` reports a ban (the exit then
        finds nothing left to release).
        """
        lease = self.acquire(selector, **acquire_args)
        try:
            yield lease
        except BaseException:
            self.release(lease, "error")
            raise
        self.release(lease, "ok")

    # -- plumbing -------------------------------------------------------------------------

    def _renewer_for(self) -> "_Renewer":
        with self._renewer_lock:
            if self._renewer is None:
                self._renewer = _Renewer(self)
            return self._renewer

    def _call(
        self, method: str, path: str, body: Optional[Mapping[str, Any]] = None
    ) -> Tuple[int, Any, Mapping[str, str]]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                return response.status, json.loads(response.read() or b"null"), response.headers
        except urllib.error.HTTPError as err:
            raise _error_from(err) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            # Refused or unresolvable: nothing was sent. Anything else (reset, timeout, closed
            # before the answer) may have cut off a request the server received.
            sent = not isinstance(reason, (ConnectionRefusedError, socket.gaierror))
            code = "no_answer" if sent else "unreachable"
            raise DiscoveryError(0, code, f"{method} {path}: {reason}") from None


def _quote(lease_id: str) -> str:
    return urllib.parse.quote(lease_id, safe="")


def _error_from(err: urllib.error.HTTPError) -> DiscoveryError:
    raw = err.read()
    code, message = f"http_{err.code}", raw.decode("utf-8", "replace")[:200]
    try:
        detail = json.loads(raw)["error"]
        code, message = detail["code"], detail["message"]
    except (ValueError, KeyError, TypeError):
        pass
    retry_after: Optional[float] = None
    header = err.headers.get("Retry-After") if err.headers else None
    if header:
        try:
            retry_after = max(float(header), 0.0)
        except ValueError:  # an HTTP date: not sent by the operator
            retry_after = None
    kind = DiscoveryError
    if err.code == 503 and code == "no_proxy_available":
        kind = NoProxyAvailable
    elif err.code == 404 and code == "lease_not_found":
        kind = LeaseNotFound
    elif err.code == 409 and code == "stale_token":
        kind = StaleToken
    return kind(err.code, code, message, retry_after)


class _Renewer:
    """One daemon thread renewing a client's leases at a third of their TTL.

    A lease the server no longer knows (404, 409) is dropped and marked ``lost``; a failed
    attempt for any other reason (network, 5xx) is retried sooner while the lease lasts.
    """

    def __init__(self, client: DiscoveryClient) -> None:
        self._client = client
        self._due: Dict[Lease, float] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="egress-proxies-renewer", daemon=True)
        self._thread.start()

    def _interval(self, lease: Lease) -> float:
        every = self._client.renew_every
        third = lease.ttl_seconds / 3.0
        return min(third, every) if every else third

    def add(self, lease: Lease) -> None:
        with self._wake:
            self._due[lease] = time.monotonic() + self._interval(lease)
            self._wake.notify()

    def discard(self, lease: Lease) -> None:
        with self._wake:
            self._due.pop(lease, None)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=self._client.timeout + 1.0)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped:
                    now = time.monotonic()
                    due = [lease for lease, at in self._due.items() if at <= now]
                    if due:
                        break
                    soonest = min(self._due.values(), default=now + 60.0)
                    self._wake.wait(timeout=soonest - now)
                if self._stopped:
                    return
            for lease in due:
                self._renew(lease)

    def _renew(self, lease: Lease) -> None:
        started = time.monotonic()
        newly_out = False
        with lease._lock:
            if lease.released:
                return
            try:
                was_out = lease.out_of_rotation
                self._client._renew_locked(lease, None)
                newly_out = lease.out_of_rotation and not was_out
                next_at = time.monotonic() + self._interval(lease)
            except (LeaseNotFound, StaleToken) as err:
                lease.lost = err
                next_at = None
            except DiscoveryError as err:
                if err.code == "proxy_draining":  # the proxy is going: finish and release
                    lease.lost = err
                    next_at = None
                else:  # transient: try again soon, within the lease's lifetime
                    next_at = started + max(min(lease.ttl_seconds / 6.0, 5.0), 0.2)
        callback = self._client.on_out_of_rotation
        if newly_out and callback is not None:
            try:
                callback(lease)
            except Exception:  # the renewer thread must live on for the other leases
                _log.exception("on_out_of_rotation failed for the lease on %s", lease.proxy.key)
        with self._wake:
            if lease in self._due:
                if next_at is None:
                    del self._due[lease]
                else:
                    self._due[lease] = next_at
