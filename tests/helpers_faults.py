"""Loopback servers that fail the way real networks do (import: ``from helpers_faults import ...``).

- :func:`serve_faulty` serves a directory over HTTP/1.0 (``Range`` supported, ``HEAD`` too);
- :func:`proxy_faulty` forwards every request to another server (moto's S3) unchanged;
- :func:`silent_server` accepts connections and never answers.

Both HTTP servers log every request (:class:`Request`) and apply the faults queued in their
:class:`FaultPlan`, each to the next matching request::

    with serve_faulty(tmp_path) as server:
        server.plan.add(Fault("short", fraction=0.3), times=2)   # the next 2 GETs end early
        url = server.url + "/shard-000000.tar"

Fault kinds: ``status`` (answer ``status``, e.g. a burst of 503s, or for ``seconds`` seconds),
``short`` (declare the full Content-Length, send ``fraction`` of the body, close),
``truncate`` (a consistent but short answer: Content-Length and Content-Range say fewer bytes
than asked), ``reset`` (send ``fraction`` of the body, then a TCP reset), ``trickle`` (one byte
every ``interval`` seconds), ``hang`` (never answer), ``delay`` (answer after ``delay``
seconds), ``redirect`` (302 to ``location``, where ``{path}`` is the request path),
``endless`` (no Content-Length, the body never ends), ``long`` (``extra`` bytes after the
declared Content-Length), ``slow_headers`` (the status line and headers one byte every
``interval`` seconds), ``head_size`` (a HEAD that declares ``size`` bytes). A ``status`` fault
sends ``Retry-After: retry_after`` when that is set. The file server honours ``If-Match``
(412 when it names another ETag) unless ``if_match=False``; its ETag is size + mtime.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

S3_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
               b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass(frozen=True)
class Fault:
    kind: str
    status: int = 503
    fraction: float = 0.5
    interval: float = 0.2
    delay: float = 0.0
    location: str = ""
    method: str = "GET"
    """Which requests it applies to ("GET", "HEAD", or "*")."""
    path: str = ""
    """Only requests whose path contains this."""
    host: str = ""
    """Only requests whose Host header contains this."""
    seconds: float = 0.0
    """``status`` only: keep answering ``status`` for this long (instead of ``times`` requests)."""
    retry_after: str = ""
    """``status`` only: the Retry-After header to send."""
    extra: int = 0
    """``long`` only: bytes sent past the declared Content-Length."""
    size: int = 0
    """``head_size`` only: the Content-Length a HEAD declares."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    fault: str | None


class FaultPlan:
    """Faults waiting for matching requests, in order."""

    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()
        self._until: list[tuple[float, Fault]] = []
        self._lock = threading.Lock()

    def add(self, fault: Fault, times: int = 1) -> None:
        with self._lock:
            if fault.seconds:
                self._until.append((0.0, fault))  # the clock starts at the first matching request
            else:
                self._queue.extend([fault] * times)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self._until.clear()

    def take(self, method: str, path: str, host: str = "") -> Fault | None:
        def matches(f: Fault) -> bool:
            return f.method in ("*", method) and f.path in path and f.host in host

        with self._lock:
            now = time.monotonic()
            for i, (start, f) in enumerate(self._until):
                if matches(f):
                    start = start or now
                    self._until[i] = (start, f)
                    if now - start < f.seconds:
                        return f
            for f in self._queue:
                if matches(f):
                    self._queue.remove(f)
                    return f
        return None


@dataclass
class FaultyServer:
    url: str
    plan: FaultPlan
    if_match: bool = True
    """The file server answers 412 to an ``If-Match`` naming another ETag."""
    requests: list[Request] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def gets(self, path: str = "") -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and path in r.path]


class _Handler(http.server.BaseHTTPRequestHandler):
    server_info: FaultyServer
    upstream: str | None = None
    directory: str = ""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        info = self.server_info
        fault = info.plan.take(self.command, self.path, self.headers.get("Host", ""))
        info.requests.append(Request(self.command, self.path, self.headers.get("Range"), fault and fault.kind))
        if fault is not None and fault.kind == "hang":
            info.stop.wait()
            return
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.delay)
        if fault is not None and fault.kind == "redirect":
            self.send_response(302)
            self.send_header("Location", fault.location.format(path=self.path))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault is not None and fault.kind == "status":
            body = S3_SLOWDOWN if (self.upstream and fault.status == 503 and self.command != "HEAD") else b""
            headers = {"Content-Type": "application/xml"}
            if fault.retry_after:
                headers["Retry-After"] = fault.retry_after
            self._respond(fault.status, headers, body)
            return
        if fault is not None and fault.kind == "slow_headers":
            self._trickle(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n", fault.interval)
            return
        status, headers, body = self._upstream() if self.upstream else self._file()
        self._respond(status, headers, body, fault if status in (200, 206) else None)

    def _upstream(self) -> tuple[int, dict[str, str], bytes]:
        n = int(self.headers.get("Content-Length") or 0)
        payload = self.rfile.read(n) if n else None
        parts = urlsplit(self.upstream or "")
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        skip = {"host", "connection", "keep-alive", "transfer-encoding"}
        conn.request(self.command, self.path, body=payload,
                     headers={k: v for k, v in self.headers.items() if k.lower() not in skip})
        resp = conn.getresponse()
        body = resp.read()
        headers = {k: v for k, v in resp.getheaders() if k.lower() not in skip | {"content-length"}}
        conn.close()
        if self.command == "HEAD":
            headers["Content-Length"] = resp.getheader("Content-Length") or "0"
        return resp.status, headers, body

    def _file(self) -> tuple[int, dict[str, str], bytes]:
        path = os.path.join(self.directory, self.path.split("?", 1)[0].lstrip("/"))
        if os.path.isdir(path):  # an index page, as static file servers give
            links = "".join(f'<a href="{name}">{name}</a>\n' for name in sorted(os.listdir(path)))
            return 200, {"Content-Type": "text/html"}, f"<html><body>{links}</body></html>".encode()
        try:  # one open file for the ETag and the bytes: an object store's GET is atomic (a stat, then an open
            f = open(path, "rb")  # of the path, once served a replaced object's bytes under the old ETag)
        except (FileNotFoundError, IsADirectoryError):
            return 404, {}, b""
        with f:
            return self._object(f)

    def _object(self, f: Any) -> tuple[int, dict[str, str], bytes]:
        st = os.fstat(f.fileno())
        size, mtime = st.st_size, st.st_mtime
        start, stop, status = 0, size, 200
        headers = {"Content-Type": "application/octet-stream", "Last-Modified": self.date_time_string(int(mtime)),
                   "ETag": f'"{size}-{int(mtime * 1e6)}"'}
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if m is not None:
            start = int(m.group(1))
            stop = min(int(m.group(2)) + 1 if m.group(2) else size, size)
            if start >= size:
                return 416, {"Content-Range": f"bytes */{size}"}, b""
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        wanted = self.headers.get("If-Match")
        if self.server_info.if_match and wanted and wanted != headers["ETag"]:
            return 412, {}, b""
        if self.command == "HEAD":
            headers["Content-Length"] = str(size)
            return status, headers, b""
        f.seek(start)
        return status, headers, f.read(stop - start)

    def _respond(self, status: int, headers: dict[str, str], body: bytes, fault: Fault | None = None) -> None:
        kind = fault.kind if fault is not None else None
        sent = body
        if kind == "truncate":
            sent = body[: int(len(body) * fault.fraction)]
            rng = headers.get("Content-Range")
            if rng:
                a, _, total = re.match(r"bytes (\d+)-(\d+)/(\d+)", rng).groups()
                headers["Content-Range"] = f"bytes {a}-{int(a) + max(len(sent), 1) - 1}/{total}"
        if kind == "long":  # keep the connection open: the extra bytes reach the client's next answer
            self.protocol_version, self.close_connection = "HTTP/1.1", False
        if kind == "head_size" and self.command == "HEAD":
            headers["Content-Length"] = str(fault.size)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if kind != "endless" and (self.command != "HEAD" or "Content-Length" not in headers):
            self.send_header("Content-Length", str(len(sent)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if kind == "endless":
            self.close_connection = True
            while not self.server_info.stop.is_set():
                try:
                    self.wfile.write(sent or b"x" * 65536)
                except OSError:
                    return
            return
        if kind == "long":
            self.wfile.write(sent + b"X" * fault.extra)
            return
        if kind in ("short", "reset"):
            self.wfile.write(body[: int(len(body) * fault.fraction)])
            self.wfile.flush()
            if kind == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR) if kind == "short" else self.connection.close()
            return
        if kind == "trickle":
            self._trickle(sent, fault.interval)
            return
        self.wfile.write(sent)

    def _trickle(self, data: bytes, interval: float) -> None:
        for i in range(len(data)):
            if self.server_info.stop.is_set():
                return
            try:
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
            except OSError:
                return
            time.sleep(interval)


@contextlib.contextmanager
def _serve(handler: type[_Handler]) -> Iterator[FaultyServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    info = FaultyServer(url=f"http://127.0.0.1:{server.server_address[1]}", plan=FaultPlan())
    handler.server_info = info
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield info
    finally:
        info.stop.set()
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def serve_faulty(directory: str | os.PathLike[str]) -> Iterator[FaultyServer]:
    """Serve ``directory`` on ``127.0.0.1`` (free port) with ``Range`` support and faults."""
    handler = type("FileHandler", (_Handler,), {"directory": os.fspath(directory)})
    with _serve(handler) as info:
        yield info


@contextlib.contextmanager
def proxy_faulty(upstream: str) -> Iterator[FaultyServer]:
    """Forward every request to ``upstream`` (``http://host:port``), with faults."""
    handler = type("ProxyHandler", (_Handler,), {"upstream": upstream})
    with _serve(handler) as info:
        yield info


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """``http://127.0.0.1:PORT``: connections are accepted (by the kernel) and never answered."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def join_prefetch(timeout: float = 10.0) -> None:
    """Wait for block prefetches still in flight from streams already closed (a test's server
    log and fault plan must not see the previous test's requests)."""
    for thread in threading.enumerate():
        if thread.name == "streampack-prefetch":
            thread.join(timeout)

