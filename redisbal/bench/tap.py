"""A counting TCP relay in front of one engine: how many requests a router sent it.

The fault benchmark compares redisbal's gateways with peer routers that do not all
count their decisions per worker (sglang-router counts them per policy only), and an
engine stopped with SIGSTOP counts nothing itself. The relay forwards bytes both
ways untouched, closes each side when the other closes (so a router giving up on a
request closes the engine's side too, as it would directly) and counts the HTTP
requests (``POST /v1/...``) in what routers send, reading each request's head and
skipping its body (``Content-Length`` or chunked). It writes the times it saw them
(``time.monotonic()``, one a line: comparable between processes of one host) to a
file whenever they change (at most every 50 ms, replaced atomically), so that a
loaded benchmark still knows when each request came, however late it reads them.

    python -m redisbal.bench.tap --port 8101 --to http://127.0.0.1:8001 --count-file f
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from urllib.parse import urlsplit

REQUEST_START = b"POST /v1/"


class RequestCounter:
    """Counts the HTTP/1.1 requests in one connection's bytes, fed in any pieces."""

    def __init__(self) -> None:
        self.requests = 0
        self._buf = b""
        self._body_left = 0  # bytes of the current body still to skip
        self._chunked = False  # skipping a chunked body: until its last chunk

    def feed(self, data: bytes) -> None:
        buf = self._buf + data
        while buf:
            if self._body_left:
                skip = min(self._body_left, len(buf))
                buf, self._body_left = buf[skip:], self._body_left - skip
                continue
            if self._chunked:
                end = buf.find(b"\r\n0\r\n\r\n")
                if end < 0:
                    buf = buf[-6:]  # (the terminator may be split)
                    break
                buf, self._chunked = buf[end + 7 :], False
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head, buf = buf[:end].lower(), buf[end + 4 :]
            if head.startswith(REQUEST_START.lower()):
                self.requests += 1
            self._chunked = b"transfer-encoding: chunked" in head
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    self._body_left = int(line.split(b":", 1)[1])
        self._buf = buf


class Tap:
    """Relays connections to ``host:port`` and counts the requests sent through it."""

    def __init__(self, host: str, port: int, count_file: str) -> None:
        self.host, self.port, self.count_file = host, port, count_file
        self.requests = 0
        self.times: list[float] = []  # when each request was seen
        self._written = -1

    async def _pipe(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, counter: RequestCounter | None
    ) -> None:
        try:
            while data := await r.read(65536):
                if counter is not None:
                    before = counter.requests
                    counter.feed(data)
                    if counter.requests > before:
                        self.requests += counter.requests - before
                        self.times += [time.monotonic()] * (counter.requests - before)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                w.close()

    async def _client(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(self.host, self.port)
        except OSError:
            cw.close()
            return
        await asyncio.gather(self._pipe(cr, uw, RequestCounter()), self._pipe(ur, cw, None))

    async def _writer(self) -> None:
        while True:
            if self.requests != self._written:
                self._written = self.requests
                tmp = self.count_file + ".tmp"
                with open(tmp, "w") as fh:
                    fh.write("".join(f"{t:.4f}\n" for t in self.times[: self._written]))
                os.replace(tmp, self.count_file)
            await asyncio.sleep(0.05)

    async def serve(self, listen_port: int) -> None:
        server = await asyncio.start_server(self._client, "127.0.0.1", listen_port, backlog=1024)
        async with server:
            await asyncio.gather(server.serve_forever(), self._writer())


def read_times(count_file: str) -> list[float]:
    """When the tap saw each request so far (``time.monotonic()``; none before its
    first write)."""
    try:
        with open(count_file) as fh:
            return [float(line) for line in fh.read().split()]
    except (OSError, ValueError):
        return []


def read_count(count_file: str) -> int:
    """The tap's count so far (0 before its first write)."""
    return len(read_times(count_file))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--port", type=int, required=True, help="listen here (127.0.0.1)")
    ap.add_argument("--to", required=True, help="the engine's base URL (http://host:port)")
    ap.add_argument("--count-file", required=True)
    a = ap.parse_args()
    to = urlsplit(a.to)
    if to.scheme != "http" or not to.hostname or not to.port:
        ap.error(f"--to must be http://host:port, got {a.to!r}")
    tap = Tap(to.hostname, to.port, a.count_file)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(tap.serve(a.port))


if __name__ == "__main__":
    main()
