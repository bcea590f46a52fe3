"""A Scrapy downloader middleware that sends every request through the operator's gateway
(``--gateway-listen``, docs/gateway.md) instead of leasing proxies itself.

The gateway takes a lease per request (or per sticky session) and bans a proxy for a domain when
the target answers 403 or 429, so there are no lease calls, threads or renewals here. This
middleware owns only what the gateway cannot know: the proxy URL of each request (the holder,
the selector's attributes and the request's session in the proxy user name, the discovery token
as the password) and sending a request answered with a ban status again, which the gateway then
routes through another proxy, since it has banned the first one for that domain. Enable it
before Scrapy's ``HttpProxyMiddleware`` (750), which turns the URL into the request's proxy and
its ``Proxy-Authorization``:

    DOWNLOADER_MIDDLEWARES = {"egress_proxies.scrapy_gateway.EgressGatewayMiddleware": 740}
    EGRESS_PROXIES_GATEWAY = "http://127.0.0.1:8888"
    EGRESS_PROXIES_TOKEN = "..."            # or EGRESS_PROXIES_TOKEN_FILE = "/path/to/token"

Settings: ``EGRESS_PROXIES_SELECTOR`` (a dict of attributes, sent as ``attr.NAME=VALUE``),
``EGRESS_PROXIES_HOLDER`` (default ``scrapy/<spider>``), ``EGRESS_PROXIES_BAN_CODES`` (default
``[403, 429]``: the statuses sent again; keep them the gateway's ban rule's),
``EGRESS_PROXIES_BAN_RETRIES`` (default 2), ``EGRESS_PROXIES_ENABLED``. Per request,
``meta["egress_proxies_session"]`` makes a sticky session and ``meta["egress_proxies_skip"]``
(or a ``meta["proxy"]`` set elsewhere) leaves the request alone. Stats:
``egress_gateway/routed``, ``egress_gateway/ban_retries``, ``egress_gateway/ban_retries_exhausted``.
"""

from typing import Dict, Optional, Set, Union
from urllib.parse import quote, urlsplit

from scrapy import Request, Spider
from scrapy.crawler import Crawler
from scrapy.http import Response

from ._scrapy_settings import endpoint_and_token, holder

SESSION_META = "egress_proxies_session"
SKIP_META = "egress_proxies_skip"
ROUTED_META = "egress_gateway_routed"
BAN_RETRIES_META = "egress_gateway_ban_retries"

# What may stand unescaped in a proxy URL's user name: the gateway's separators (`;`, `=`,
# RFC 3986 sub-delimiters) and the unreserved characters; the rest is percent-encoded, which
# HttpProxyMiddleware decodes before it makes the Basic credentials.
_USER_SAFE = ";=.-_~"


def gateway_user(holder: str, selector: Dict[str, str], session: Optional[str] = None) -> str:
    """The gateway's user name, ``HOLDER[;session=KEY][;attr.NAME=VALUE]...``, as it is sent."""
    parts = [holder]
    if session is not None:
        parts.append(f"session={session}")
    parts.extend(f"attr.{name}={value}" for name, value in sorted(selector.items()))
    return ";".join(parts)


def gateway_proxy_url(gateway: str, token: str, user: str) -> str:
    """``gateway`` (``http://host:port``) with ``user`` and ``token`` as its credentials."""
    address = urlsplit(gateway)
    if address.scheme != "http" or not address.netloc or "@" in address.netloc:
        raise ValueError(f"EGRESS_PROXIES_GATEWAY must be http://HOST:PORT, not {gateway!r}")
    return f"http://{quote(user, safe=_USER_SAFE)}:{quote(token, safe='')}@{address.netloc}"


class EgressGatewayMiddleware:
    """Routes requests through the gateway; see the module's doc."""

    def __init__(
        self,
        crawler: Crawler,
        gateway: str,
        token: str,
        holder: str,
        selector: Dict[str, str],
        ban_codes: Set[int],
        ban_retries: int,
    ) -> None:
        self.crawler = crawler
        self.stats = crawler.stats
        self.gateway = gateway
        self.token = token
        self.holder = holder
        self.selector = selector
        self.ban_codes = ban_codes
        self.ban_retries = ban_retries
        # Checked now: a bad address stops the crawl before its first request.
        self._plain_url = gateway_proxy_url(gateway, token, gateway_user(holder, selector))

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> "EgressGatewayMiddleware":
        settings = crawler.settings
        gateway, token = endpoint_and_token(crawler, "EGRESS_PROXIES_GATEWAY", "the gateway")
        return cls(
            crawler,
            gateway,
            token,
            holder=holder(crawler),
            selector={str(k): str(v) for k, v in settings.getdict("EGRESS_PROXIES_SELECTOR").items()},
            ban_codes={int(c) for c in settings.getlist("EGRESS_PROXIES_BAN_CODES", [403, 429])},
            ban_retries=settings.getint("EGRESS_PROXIES_BAN_RETRIES", 2),
        )

    def process_request(self, request: Request, spider: Optional[Spider] = None) -> None:
        if request.meta.get(SKIP_META) or "proxy" in request.meta:
            return None
        session = request.meta.get(SESSION_META)
        if session is None:
            url = self._plain_url
        else:
            url = gateway_proxy_url(self.gateway, self.token, gateway_user(self.holder, self.selector, str(session)))
        request.meta["proxy"] = url
        request.meta[ROUTED_META] = True
        self.stats.inc_value("egress_gateway/routed")
        return None

    def process_response(
        self, request: Request, response: Response, spider: Optional[Spider] = None
    ) -> Union[Request, Response]:
        if not request.meta.get(ROUTED_META) or response.status not in self.ban_codes:
            return response
        tries = int(request.meta.get(BAN_RETRIES_META, 0))
        if tries >= self.ban_retries:
            self.stats.inc_value("egress_gateway/ban_retries_exhausted")
            return response
        # The gateway banned that proxy for this domain: the copy goes through another.
        again = request.replace(dont_filter=True)
        for key in ("proxy", ROUTED_META, "_auth_proxy"):
            again.meta.pop(key, None)
        again.meta[BAN_RETRIES_META] = tries + 1
        self.stats.inc_value("egress_gateway/ban_retries")
        (spider or self.crawler.spider).logger.info(
            "%s answered %d through the gateway (a ban): sending it again (%d of %d)",
            request.url,
            response.status,
            tries + 1,
            self.ban_retries,
        )
        return again
