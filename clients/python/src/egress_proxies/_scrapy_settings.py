"""What both Scrapy middlewares read from the crawl's settings the same way: whether they are
on, where they send to, the discovery token, and the lease holder."""

from pathlib import Path
from typing import Tuple

from scrapy.crawler import Crawler
from scrapy.exceptions import NotConfigured


def endpoint_and_token(crawler: Crawler, endpoint_setting: str, without: str) -> Tuple[str, str]:
    """The URL in ``endpoint_setting`` and the token (``EGRESS_PROXIES_TOKEN``, else the file in
    ``EGRESS_PROXIES_TOKEN_FILE``). ``NotConfigured`` when ``EGRESS_PROXIES_ENABLED`` is off;
    ``ValueError`` when either is missing."""
    settings = crawler.settings
    if not settings.getbool("EGRESS_PROXIES_ENABLED", True):
        raise NotConfigured("EGRESS_PROXIES_ENABLED is off")
    endpoint = settings.get(endpoint_setting)
    token = settings.get("EGRESS_PROXIES_TOKEN")
    token_file = settings.get("EGRESS_PROXIES_TOKEN_FILE")
    if not token and token_file:
        token = Path(token_file).read_text().strip()
    if not endpoint or not token:
        # An error, not NotConfigured: Scrapy would carry on without the middleware and crawl
        # from this host's own address.
        raise ValueError(
            f"{endpoint_setting} and EGRESS_PROXIES_TOKEN (or EGRESS_PROXIES_TOKEN_FILE) are required;"
            f" set EGRESS_PROXIES_ENABLED = False to crawl without {without}"
        )
    return str(endpoint), str(token)


def holder(crawler: Crawler) -> str:
    """``EGRESS_PROXIES_HOLDER``, else ``scrapy/<spider name>``."""
    spider_name = getattr(crawler.spidercls, "name", None) or "spider"
    return str(crawler.settings.get("EGRESS_PROXIES_HOLDER") or f"scrapy/{spider_name}")
