"""What engine-sim tells the deployment, as each real engine's path does
(``engine-sim --report-as``), so that a benchmark runs with the information real
engines give.

- ``full``: running, waiting, KV usage and admitted counts per API server (exact
  pending counts; the running cap learned from queues). No real engine sends these.
- ``vllm-plugin``: what vLLM's stat-logger plugin sends: no admitted counts but their
  total (finished + waiting + running, aborted requests never finished), counts made
  after each step's admission, the running cap declared (``max_num_seqs``).
- ``vllm-metrics``: what ``redisbal scrape`` reads off vLLM's /metrics: no admitted
  counts but their total (``request_success_total`` + waiting + running) and no cap
  (unless the sidecar is given ``--max-num-seqs``).
- ``sglang``: what ``redisbal scrape`` reads off SGLang: no admitted counts but their
  total (``num_requests_total`` + waiting + running), the cap from ``GET /v1/loads``
  (``max_running_requests`` per ``dp_rank``), which the HTTP engines then serve as
  SGLang does.

The HTTP engines' /metrics pages carry the finished counters those totals come from.

The quality simulator (``redisbal bench --report-as``) feeds its routers in each of these
forms, and in one more that engine-sim no longer sends:

- ``load-only``: running, waiting and KV usage; no admitted counts, no total, no cap.
  What compact snapshots carry, and what engine-sim's ``--no-admitted`` sent (runs
  recorded before ``--report-as`` and the admitted total).
"""

from __future__ import annotations

from dataclasses import dataclass

from redisbal.errors import InvalidArgument

REPORT_AS = ("full", "vllm-plugin", "vllm-metrics", "sglang")  # engine-sim's forms
LOAD_ONLY = "load-only"
FEEDS = (*REPORT_AS, LOAD_ONLY)  # the simulator's (module docstring)


@dataclass(frozen=True)
class Feed:
    """One ``--report-as`` form: what the engines' reports and routes carry."""

    name: str
    admitted: bool  # admitted counts per API server in every report
    total: bool  # the admitted total (finished + waiting + running) in every report
    declares_cap: bool  # the running cap declared once (redisbal.running_caps)
    serves_loads: bool  # GET /v1/loads, as SGLang serves it

    @classmethod
    def of(cls, name: str) -> Feed:
        if name not in FEEDS:
            raise InvalidArgument(f"report_as must be one of {', '.join(FEEDS)}, got {name!r}")
        return cls(
            name,
            admitted=name == "full",
            total=name not in ("full", LOAD_ONLY),
            declares_cap=name in ("vllm-plugin", "sglang"),
            serves_loads=name == "sglang",
        )
