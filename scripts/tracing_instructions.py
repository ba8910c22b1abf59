#!/usr/bin/env python3
"""Instructions that tracing itself adds to a request, counted by callgrind: the traced
request path (its record and spans, an attempt's routing event, first byte when
streamed, the end) and the export of its spans in batches of ``--batch`` (encoded and
POSTed to an OTLP/HTTP sink that drops them), run ``--requests`` times in one process
and once with none; the difference over the count is tracing's cost per request.

``scripts/gateway_instructions.py`` counts a whole gateway traced and not, but what its
per-request figure includes besides tracing (the event loop's work, shared by the
requests that overlap) moves with the host's load by a quarter between runs on a busy
machine; this counts tracing's part alone, the same from run to run. Divide it by
the plain gateway's instructions per request for tracing's share.

    python scripts/tracing_instructions.py --mode whole [--src DIR]

``--src DIR``: the redisbal of another source tree (``git archive`` of an older
commit), to compare. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from gateway_overhead import SINK, free_port


def work(n: int, port: int, stream: bool, batch: int) -> None:
    """``n`` traced requests, then their spans exported ``batch`` at a time."""
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = str(10**9)  # (the spans are exported below)
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = "100000"
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from redisbal.gateway.accesslog import Record
    from redisbal.gateway.otlp import OTLPExporter
    from redisbal.gateway.tracing import Tracing

    class Keep(SpanExporter):
        def __init__(self) -> None:
            self.spans: list[object] = []

        def export(self, spans: object) -> SpanExportResult:
            self.spans += spans  # type: ignore[arg-type]
            return SpanExportResult.SUCCESS

    keep = Keep()
    tr = Tracing(exporter=keep, resource={"redisbal.policy": "redisbal"})
    exporter = OTLPExporter(f"http://127.0.0.1:{port}/v1/traces")
    headers = {"Host": "gateway", "Content-Type": "application/json"}
    for i in range(n):
        rec = Record(f"{i:032x}", "POST", "/v1/completions", "127.0.0.1")
        rec.spans = tr.request(headers, "POST", rec.path, rec.rid)
        rec.model, rec.stream, rec.engine, rec.tries = "redisbal-sim", stream, "0", 1
        route = {
            "redisbal.attempt": 1,
            "redisbal.engine": "0",
            "redisbal.snapshot.age_s": 0.001 * i,
            "redisbal.engine.running": i % 3,
            "redisbal.engine.waiting": 0,
            "redisbal.engine.pending": 1,
        }
        rec.spans.attempt(route, {})
        if stream:
            rec.first_byte()
        rec.kind, rec.status, rec.tokens = "ok", 200, None if stream else 1
        rec.attempt_end("ok", "", 200)
        rec.spans.end(rec)
    tr.flush()
    spans = keep.spans
    for k in range(0, len(spans), batch):
        if exporter.export(spans[k : k + batch]).name != "SUCCESS":  # type: ignore[arg-type]
            sys.exit("tracing_instructions: the sink refused an export")
    tr.provider.shutdown()


def count(n: int, port: int, a: argparse.Namespace, out_dir: str) -> int:
    """The instructions of one process doing ``n`` requests' tracing."""
    out = os.path.join(out_dir, f"callgrind.{n}")
    src = os.path.abspath(a.src) if a.src else os.path.dirname(os.path.dirname(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.path.dirname(__file__)])}
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
    cmd += [__file__, "--work", str(n), "--port", str(port), "--mode", a.mode]
    cmd += ["--batch", str(a.batch)]
    subprocess.run(cmd, env=env, cwd=src, check=True, stderr=subprocess.DEVNULL)
    with open(out) as fh:
        return sum(int(ln.split()[1]) for ln in fh if ln.startswith("totals:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mode", choices=("stream", "whole"), default="whole")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument(
        "--batch",
        type=int,
        default=40,
        help="spans per export (the batch processor sends every 5 s: 40 at 8 requests/s)",
    )
    ap.add_argument("--src", default=None, help="the source tree whose redisbal to count")
    ap.add_argument("--work", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.work is not None:  # (the process under callgrind)
        work(a.work, a.port, a.mode == "stream", a.batch)
        return
    port = free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(port)])
    try:
        time.sleep(2)
        with tempfile.TemporaryDirectory(prefix="redisbal-tracing-") as out_dir:
            none, some = (count(n, port, a, out_dir) for n in (0, a.requests))
    finally:
        sink.terminate()
        sink.wait(10)
    print(f"{a.mode}: {(some - none) / a.requests:,.0f} instructions per request "
          f"({a.requests} requests, spans exported {a.batch} at a time)")  # fmt: skip


if __name__ == "__main__":
    main()
