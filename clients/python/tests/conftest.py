"""Fixtures for tests against a live discovery API with real Squids.

tests/python_client.rs (in the operator's repository) starts standalone mode with three local
Squids and runs this suite with:

- ``EPO_URL``: the discovery API, ``EPO_TOKEN_FILE`` (or ``EPO_TOKEN``): its token;
- ``EPO_SELECTOR``: ``key=value,...`` matching exactly the test's proxies (each with
  ``maxConcurrent: 1`` and ``cooldownSeconds: 1``);
- ``EPO_ACCESS_LOGS``: JSON ``{"host:port": "/path/to/access.log"}``, each Squid's access log;
- ``EPO_PROXY_USER``: the user name of the proxies' credentials (Squid logs it per request),
  ``EPO_PROXY_PASSWORD``: their password (no crawl log may show it).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from egress_proxies import DiscoveryClient


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set: run these tests through `cargo test --test python_client`")
    return value


@pytest.fixture(scope="session")
def api_url() -> str:
    return _env("EPO_URL")


@pytest.fixture(scope="session")
def token() -> str:
    if os.environ.get("EPO_TOKEN"):
        return os.environ["EPO_TOKEN"]
    return Path(_env("EPO_TOKEN_FILE")).read_text().strip()


@pytest.fixture(scope="session")
def selector() -> Dict[str, str]:
    return dict(term.split("=", 1) for term in _env("EPO_SELECTOR").split(","))


@pytest.fixture
def client(api_url: str, token: str, selector: Dict[str, str]) -> Iterator[DiscoveryClient]:
    """A client; after the test, no lease on the test's proxies is left active."""
    with DiscoveryClient(api_url, token, holder="pytest", max_wait=30) as client:
        yield client
        assert_no_active_lease(client, selector)


def assert_no_active_lease(client: DiscoveryClient, selector: Dict[str, str]) -> None:
    listing = client.list_proxies(selector)
    assert listing, "the selector matches the test's proxies"
    active = {p.proxy.key: p.active_leases for p in listing if p.active_leases}
    assert not active, f"leases left behind: {active}"


class LosingRelay:
    """A TCP relay on 127.0.0.1, port 0, in front of the discovery API that loses answers: a
    request whose path contains ``lose`` reaches the API, and then the relay closes the
    client's connection without its answer, ``times`` times; every other request is relayed
    whole. One request per connection (the client sends ``Connection: close``)."""

    def __init__(self, api_url: str) -> None:
        host, port = api_url.split("//", 1)[1].rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.lose = ""
        self.times = 0
        self.lost: List[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def lose_answers(self, path_part: str, times: int) -> None:
        self.lose, self.times = path_part, times

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(self.upstream) as upstream:
            request = self._read_request(conn)
            upstream.sendall(request)
            answer = b""
            while chunk := upstream.recv(65536):
                answer += chunk
            line = request.split(b"\r\n", 1)[0].decode()
            if self.times > 0 and self.lose in line:
                self.times -= 1
                self.lost.append(line)
                return  # the API did it; the client hears nothing
            conn.sendall(answer)

    @staticmethod
    def _read_request(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for header in head.split(b"\r\n")[1:]:
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            body += conn.recv(65536)
        return head + b"\r\n\r\n" + body

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def losing_relay(api_url: str) -> Iterator[LosingRelay]:
    relay = LosingRelay(api_url)
    yield relay
    relay.close()


class AccessLogs:
    """Squid access log lines written since this object was made, per proxy endpoint."""

    def __init__(self, paths: Dict[str, Path]) -> None:
        self.paths = paths
        self.offsets = {endpoint: self._size(path) for endpoint, path in paths.items()}

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def lines(self) -> Dict[str, List[Tuple[str, str, str, str]]]:
        """``(result code, method, URL, user)`` of each new line (native log format), by endpoint."""
        seen: Dict[str, List[Tuple[str, str, str, str]]] = {}
        for endpoint, path in self.paths.items():
            entries = seen.setdefault(endpoint, [])
            if not path.exists():
                continue
            with path.open("rb") as log:
                log.seek(self.offsets[endpoint])
                for raw in log.read().decode("utf-8", "replace").splitlines():
                    fields = raw.split()
                    if len(fields) >= 8:
                        entries.append((fields[3], fields[5], fields[6], fields[7]))
        return seen

    def wait_for(self, count: int, url_part: str, within: float = 10.0) -> Dict[str, List[Tuple[str, str, str, str]]]:
        """The new lines mentioning ``url_part``, once there are ``count`` (Squid writes a
        line when a transaction ends)."""
        deadline = time.monotonic() + within
        while True:
            lines = {e: [l for l in ls if url_part in l[2]] for e, ls in self.lines().items()}
            if sum(map(len, lines.values())) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)


@pytest.fixture(scope="session")
def proxy_user() -> str:
    return _env("EPO_PROXY_USER")


@pytest.fixture
def access_logs() -> AccessLogs:
    paths = {endpoint: Path(path) for endpoint, path in json.loads(_env("EPO_ACCESS_LOGS")).items()}
    return AccessLogs(paths)


BANNING_HOST = "localhost"


class Site:
    """A small site on 127.0.0.1, port 0: linked pages, ``/slow`` answering after a while, and
    every page on the host name ``localhost`` (the same server) answering 403, as a site that
    bans the proxy would, but for ``/many`` there, which links to ``ONCE_PAGES`` pages
    ``/once/<n>`` of which only the ``BAN_AT``-th request answers 403 (a ban mid-crawl);
    ``/paced`` links to ``PACED_PAGES`` pages that each take ``PACED_SECONDS``.
    Records ``(host name, path)`` of every request it answers."""

    PAGES: Dict[str, List[str]] = {
        "/": ["/a", "/b", "/slow", f"http://{BANNING_HOST}:{{port}}/"],
        "/a": ["/b", "/c"],
        "/b": ["/c", "/"],
        "/c": [],
        "/slow": ["/c"],
    }
    SLOW_SECONDS = 2.5
    ONCE_PAGES = 200
    BAN_AT = 50
    # ``/paced`` links to as many pages ``/paced/<n>``, each answering after a while: a crawl
    # long enough to freeze its proxy in the middle of.
    PACED_PAGES = 60
    PACED_SECONDS = 0.1

    def __init__(self) -> None:
        self.served: List[Tuple[str, str]] = []
        # When each request arrived (time.monotonic()), in order.
        self.arrivals: List[float] = []
        self.once_requests = 0
        self.lock = threading.Lock()
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
                site.served.append((host, self.path))
                site.arrivals.append(time.monotonic())
                if host == BANNING_HOST and self.path == "/many":
                    anchors = "".join(f'<a href="/once/{n}">{n}</a>' for n in range(site.ONCE_PAGES))
                    self._answer(200, f"<html><body>{anchors}</body></html>")
                    return
                if host == BANNING_HOST and self.path.startswith("/once/"):
                    with site.lock:
                        site.once_requests += 1
                        banned = site.once_requests == site.BAN_AT
                    self._answer(403 if banned else 200, "<html><body>once</body></html>")
                    return
                if host == BANNING_HOST:
                    self._answer(403, "<html><body>banned</body></html>")
                    return
                if self.path == "/paced":
                    anchors = "".join(f'<a href="/paced/{n}">{n}</a>' for n in range(site.PACED_PAGES))
                    self._answer(200, f"<html><body>{anchors}</body></html>")
                    return
                if self.path.startswith("/paced/"):
                    time.sleep(site.PACED_SECONDS)
                    self._answer(200, "<html><body>paced</body></html>")
                    return
                links = site.PAGES.get(self.path)
                if links is None:
                    self._answer(404, "<html><body>not found</body></html>")
                    return
                if self.path == "/slow":
                    time.sleep(site.SLOW_SECONDS)
                anchors = "".join(f'<a href="{l.format(port=site.port)}">{l}</a>' for l in links)
                self._answer(200, f"<html><body><h1>{self.path}</h1>{anchors}</body></html>")

            def _answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site() -> Iterator[Site]:
    site = Site()
    yield site
    site.close()
