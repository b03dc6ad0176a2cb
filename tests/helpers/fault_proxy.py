"""An HTTP proxy in front of an S3 endpoint that injects storage faults.

Put it between s3fs and moto_server (``--storage-option endpoint_url=<proxy url>``) and every
request the whole stack makes (aiohttp, botocore, s3fs, our retries) meets real failures:

- ``503``: a ``SlowDown`` throttling response
- ``500``: an ``InternalError`` response
- ``reset``: the connection is dropped after the request, with no response
- ``cut``: an upload is cut off midway (half the body read, then the connection dropped); a
  download gets half its body and then the connection dropped
- ``delay_s``: every request waits this long first
- ``down``: every request gets a 503 ``ServiceUnavailable`` until it is set back to False
- ``bandwidth_bps``: request and response bodies share one link of this many bytes per second
  (a slow remote: ``bench --recovery``)

``fail_fraction`` of the requests get one of ``kinds``, chosen by a seeded RNG. ``stats()`` counts
requests, faults per kind, and ``retried``: faulted requests that were later sent again (some layer
retried them). Usable from tests (``with FaultProxy(upstream) as url``) and by hand::

    python -m tests.helpers.fault_proxy --upstream http://127.0.0.1:5000 --fail 0.1
"""

from __future__ import annotations

import argparse
import collections
import http.client
import random
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KINDS = ("503", "500", "reset", "cut")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "proxy-connection",
}
_ERROR_BODY = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "down": (503, "ServiceUnavailable", "Service is unable to handle request."),
}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        fail_fraction: float = 0.0,
        kinds: tuple[str, ...] = KINDS,
        delay_s: float = 0.0,
        seed: int = 0,
        port: int = 0,
        bandwidth_bps: float | None = None,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {KINDS}")
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.fail_fraction = fail_fraction
        self.kinds = kinds
        self.delay_s = delay_s
        self.bandwidth_bps = bandwidth_bps
        self._link_free_at = 0.0
        self.down = False
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request, in arrival order (``count_requests`` reads them)."""
        self._faulted: set[tuple[str, str]] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _throttle(self, nbytes: int) -> None:
        """Hold ``nbytes`` back until the shared link has carried them (all connections queue)."""
        if not self.bandwidth_bps or not nbytes:
            return
        with self._lock:
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + nbytes / self.bandwidth_bps
            done = self._link_free_at
        time.sleep(max(0.0, done - time.monotonic()))

    # -- decisions ----------------------------------------------------------------------------
    def _decide(self, method: str, path: str) -> str | None:
        """The fault for this request (None: forward it), and the bookkeeping of retries."""
        key = (method, path)
        with self._lock:
            self._counts["requests"] += 1
            self.requests.append(key)
            if key in self._faulted:
                self._faulted.discard(key)
                self._counts["retried"] += 1
            if self.down:
                fault = "down"
            elif self._rng.random() < self.fail_fraction:
                fault = self._rng.choice(self.kinds)
            else:
                return None
            self._counts[f"fault_{fault}"] += 1
            self._counts["faults"] += 1
            self._faulted.add(key)
            return fault

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self
        local = threading.local()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as s3fs's connection pool expects

            def log_message(self, *args) -> None:  # quiet: the counters are the record
                pass

            def do_GET(self) -> None:
                self._handle()

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

            def _handle(self) -> None:
                fault = proxy._decide(self.command, self.path)
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                if fault == "cut" and self._body_length():
                    self.rfile.read(self._body_length() // 2)
                    return self._abort()
                body = self._read_body()
                proxy._throttle(len(body))
                if fault in _ERROR_BODY:
                    return self._error(fault)
                if fault == "reset":
                    return self._abort()
                status, headers, payload = self._forward(body)
                if self.command != "HEAD":
                    proxy._throttle(len(payload))
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                length = len(payload)
                if self.command == "HEAD":
                    length = int(dict((k.lower(), v) for k, v in headers).get("content-length", 0))
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if fault == "cut" and payload:  # a download cut off midway
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    return self._abort()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _body_length(self) -> int:
                return int(self.headers.get("Content-Length") or 0)

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            return b"".join(chunks)
                        chunks.append(chunk)
                return self.rfile.read(self._body_length())

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                for attempt in range(2):  # a pooled upstream connection may have gone stale
                    conn = getattr(local, "conn", None) or http.client.HTTPConnection(
                        *proxy.upstream, timeout=60
                    )
                    local.conn = conn
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        resp = conn.getresponse()
                        return resp.status, resp.getheaders(), resp.read()
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        local.conn = None
                        if attempt:
                            raise
                raise AssertionError("unreachable")

            def _error(self, kind: str) -> None:
                status, code, message = _ERROR_BODY[kind]
                xml = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><Resource>{self.path}</Resource></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)

            def _abort(self) -> None:
                # SO_LINGER 0: close() sends RST, the way a crashed load balancer drops a socket.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True

        return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--upstream", required=True, help="the real endpoint, e.g. http://127.0.0.1:5000"
    )
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fail", type=float, default=0.1, help="fraction of requests to fail")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--delay", type=float, default=0.0, help="seconds added to every request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", type=float, default=None, help="bytes per second, all requests")
    args = p.parse_args()
    proxy = FaultProxy(
        args.upstream,
        fail_fraction=args.fail,
        kinds=tuple(args.kinds.split(",")),
        delay_s=args.delay,
        seed=args.seed,
        port=args.port,
        bandwidth_bps=args.bandwidth,
    )
    with proxy:
        print(
            f"fault proxy on {proxy.url} -> {args.upstream}; Ctrl-C prints the counts", flush=True
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print(proxy.stats())


if __name__ == "__main__":
    main()
