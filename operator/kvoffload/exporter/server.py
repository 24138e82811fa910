"""The HTTP side: /metrics (Prometheus text) and /healthz, on a stdlib threading server."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..api.errors import ConfigError

log = logging.getLogger("kvoffload.exporter")


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPv6]:PORT` -> (host, port)."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError("--listen", f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9400)")
    return host, int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the process alive on shutdown

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection
    timeout = 120  # drop idle keep-alive connections

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = generate_latest(self.server.registry)
            except Exception:  # a bug, not a source failure (those are counted): answer, keep serving
                log.exception("cannot render /metrics")
                self._reply(500, "text/plain; charset=utf-8", b"internal error, see exporter log\n")
                return
            self._reply(200, CONTENT_TYPE_LATEST, body)
        elif path == "/healthz":
            # Answering at all proves the server loop runs; source health is in kvoffload_source_up.
            self._reply(200, "text/plain; charset=utf-8", b"ok\n")
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics or /healthz\n")

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape would drown the logs that matter


def start_server(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Bind (port 0 picks a free one: see `server_address`) and serve in a daemon thread."""
    server = _Server((host, port), registry)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
