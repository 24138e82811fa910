"""One bounded HTTP GET, shared by the exporter (vLLM's /metrics) and the operator's probe (the
exporter's /metrics), and the error every input source raises."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

_MAX_BODY = 32 * 1024 * 1024  # a /metrics page larger than this is not one we read


class SourceError(Exception):
    """A source could not be read. `str()` is a short, stable reason (no timings, no counters), so
    that the same failure repeated on every scrape compares equal and is logged only once."""


def fetch_text(url: str, timeout: float) -> str:
    """GET `url` (plain http, no proxy) and return the body; every socket wait is capped by what is
    left of `timeout`, so a hung vLLM cannot hold a scrape longer than that."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SourceError(f"unsupported URL {url!r} (http://host:port/path only)")
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.connect()
        _cap(conn, deadline, timeout)
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain;version=0.0.4"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SourceError(f"HTTP {resp.status} from {url}")
        body = bytearray()
        while chunk := resp.read1(65536):
            body += chunk
            if len(body) > _MAX_BODY:
                raise SourceError(f"response from {url} larger than {_MAX_BODY} bytes")
            _cap(conn, deadline, timeout)
    except TimeoutError:
        raise SourceError(f"no complete answer from {url} within {timeout:g}s") from None
    except ConnectionRefusedError:
        raise SourceError(f"connection refused by {url}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise SourceError(f"cannot read {url}: {type(exc).__name__}") from None
    finally:
        conn.close()
    return body.decode("utf-8", errors="replace")


def _cap(conn: http.client.HTTPConnection, deadline: float, timeout: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(min(left, timeout))
