"""Runs one Scrapy crawl with the middleware, in its own process (a Twisted reactor runs once
per process): ``python crawl.py CONFIG.json RESULT.json``.

CONFIG: ``start_urls``, ``settings`` (Scrapy settings, the middleware's included),
``allowed_domains`` (optional), ``session`` (optional: a sticky session for every request),
``sessions`` (optional: a session for a start URL, overriding ``session``).
RESULT: ``pages`` (url, status, the lease's proxy endpoint and ID for each response) and the
crawl's ``stats``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional

import scrapy
from scrapy.crawler import CrawlerProcess
from scrapy.http import Response

PAGES: List[Dict[str, Any]] = []


class SiteSpider(scrapy.Spider):
    name = "site"
    # See the banning site's 403s, which Scrapy would otherwise drop before the spider.
    handle_httpstatus_list = [403, 404, 429]

    def __init__(
        self,
        start_urls: List[str],
        session: Optional[str] = None,
        sessions: Optional[Dict[str, str]] = None,
        allowed: Optional[List[str]] = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.start_urls = start_urls
        self.session = session
        self.sessions = sessions or {}
        if allowed:
            self.allowed_domains = allowed

    async def start(self) -> AsyncIterator[scrapy.Request]:
        # Scrapy 2.13+ starts here, and its own start() no longer reads start_requests(), which
        # Scrapy 2.8 calls instead.
        for request in self.start_requests():
            yield request

    def start_requests(self) -> Iterator[scrapy.Request]:
        for url in self.start_urls:
            yield self._request(url, self.sessions.get(url, self.session))

    def _request(self, url: str, session: Optional[str]) -> scrapy.Request:
        meta = {"egress_proxies_session": session} if session else {}
        return scrapy.Request(url, meta=meta, callback=self.parse)

    def parse(self, response: Response) -> Iterator[scrapy.Request]:
        lease = response.meta.get("egress_proxies_lease")
        PAGES.append(
            {
                "url": response.url,
                "status": response.status,
                "proxy": lease.proxy.endpoint if lease else None,
                "lease": lease.lease_id if lease else None,
            }
        )
        if response.status == 200:
            for href in response.css("a::attr(href)").getall():
                yield self._request(response.urljoin(href), self.session)


def main(config_path: str, result_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    settings = {
        "DOWNLOADER_MIDDLEWARES": {"egress_proxies.scrapy_middleware.EgressProxiesMiddleware": 740},
        "COOKIES_ENABLED": False,
        "TELNETCONSOLE_ENABLED": False,
        # Everything Scrapy logs, so that the test sees that no proxy password is among it.
        "LOG_LEVEL": "DEBUG",
        "REQUEST_FINGERPRINTER_IMPLEMENTATION": "2.7",
        "DOWNLOAD_TIMEOUT": 20,
        **config["settings"],
    }
    process = CrawlerProcess(settings)
    crawler = process.create_crawler(SiteSpider)
    process.crawl(
        crawler,
        start_urls=config["start_urls"],
        session=config.get("session"),
        sessions=config.get("sessions"),
        allowed=config.get("allowed_domains"),
    )
    process.start()
    stats = crawler.stats.get_stats()
    with open(result_path, "w") as f:
        json.dump({"pages": PAGES, "stats": stats}, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
