"""Engine counts from a Prometheus /metrics page of vLLM or SGLang.

Only the few series a report needs are read; the other lines of the page (a vLLM
page is mostly histogram buckets) are dropped before ``prometheus_client``'s parser
sees the text, which keeps a 50 ms scrape cheap.

- vLLM: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` on older servers);
  one engine per value of the ``engine`` label ("0" when there is none, as on
  servers before the V1 engine).
- SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``,
  ``sglang:token_usage``; one engine per value of ``dp_rank`` ("0" when absent).

Several series for one engine (one per ``tp_rank``, or per ``priority`` next to
their aggregate with ``priority=""``) describe the same queue: the largest wins,
never their sum. KV usage is optional (``None`` when the page has neither name);
waiting and running are required.

The requests an engine finished, for its admitted total (finished + waiting +
running: what routers reconcile with where there are no per-router counts), are
optional too: vLLM's ``vllm:request_success_total`` (every ``finished_reason``,
aborts included where vLLM counts them), SGLang's ``sglang:num_requests_total``;
their series are summed over their other labels (``finished_reason``,
``is_streaming``), rank labels and ``priority`` aside (one count, seen by each rank).
A counter that not every engine of the page has (SGLang's without ``dp_rank`` next to
per-rank gauges) or that is no count gives no total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redisbal.errors import PageError as PageError

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "reading /metrics needs prometheus-client: pip install 'redisbal[scrape]'"
    ) from exc


@dataclass(frozen=True)
class Flavour:
    name: str
    waiting: str
    running: str
    kv: tuple[str, ...]
    engine_label: str
    # counters that move when the engine's loop makes progress (a step, a token): the
    # sidecar reports "no progress" while they stand still, so a hung engine stalls
    progress: tuple[str, ...] = ()
    # the counter of requests the engine finished (None: none read)
    finished: str | None = None


VLLM = Flavour(
    "vLLM",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "engine",
    (
        "vllm:iteration_tokens_total_count",  # one observation per engine step
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
    ),
    "vllm:request_success_total",
)
SGLANG = Flavour(
    "SGLang",
    "sglang:num_queue_reqs",
    "sglang:num_running_reqs",
    ("sglang:token_usage",),
    "dp_rank",
    ("sglang:generation_tokens_total", "sglang:prompt_tokens_total"),
    "sglang:num_requests_total",
)
FLAVOURS = (VLLM, SGLANG)
_LABEL = {n: f.engine_label for f in FLAVOURS for n in (f.waiting, f.running, *f.kv, *f.progress)}
_FINISHED = {f.finished: f.engine_label for f in FLAVOURS if f.finished}
_WANTED = set(_LABEL) | set(_FINISHED)
# finished requests read as a count: an admitted total stays under a report's bound
# (10^15, barrier.snapshot.MAX_TOTAL) whatever the queue gauges add
MAX_FINISHED = 10**14
# labels of a finished counter's series that repeat one count (each rank, the aggregate)
_SAME_COUNT = frozenset(("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank", "priority"))


@dataclass(frozen=True)
class EngineSample:
    """One engine's counts on one page."""

    engine: str  # the engine / dp_rank label value
    waiting: int
    running: int
    kv_usage: float | None
    progress: float | None = None  # sum of the flavour's progress counters (None: none)
    finished: int | None = None  # requests it finished (None: the page does not say)

    @property
    def admitted_total(self) -> int | None:
        """finished + waiting + running: the requests it took in (None without finished)."""
        return None if self.finished is None else self.finished + self.waiting + self.running


def _line_name(line: str) -> str:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for ch in "{ \t":
        i = line.find(ch)
        if i != -1 and i < end:
            end = i
    return line[:end]


def relevant_text(text: str) -> str:
    """The page's lines for the series we read (and their HELP/TYPE lines)."""
    return "\n".join(ln for ln in text.splitlines() if _line_name(ln) in _WANTED) + "\n"


def _values(text: str) -> dict[str, dict[str, list[float]]]:
    """name -> engine label value -> values, for the wanted series only (a finished
    counter's: one value per set of its other labels, the largest where only rank
    labels tell its series apart)."""
    out: dict[str, dict[str, list[float]]] = {}
    fin: dict[str, dict[str, dict[tuple[tuple[str, str], ...], float]]] = {}
    for fam in text_string_to_metric_families(relevant_text(text)):
        for s in fam.samples:
            if s.name in _FINISHED:
                label = _FINISHED[s.name]
                rest = tuple(
                    sorted(
                        (k, v) for k, v in s.labels.items() if k != label and k not in _SAME_COUNT
                    )
                )
                per = fin.setdefault(s.name, {}).setdefault(s.labels.get(label, "0"), {})
                per[rest] = max(per.get(rest, s.value), s.value)
            elif s.name in _LABEL:
                label = _LABEL[s.name]
                out.setdefault(s.name, {}).setdefault(s.labels.get(label, "0"), []).append(s.value)
    for name, by_engine in fin.items():
        out[name] = {e: list(per.values()) for e, per in by_engine.items()}
    return out


def _finished(
    fl: Flavour, vals: dict[str, dict[str, list[float]]], engines: list[str]
) -> dict[str, int]:
    """Each engine's finished requests, summed over its counter's series; none unless
    every engine of the page has the counter and every value is a count."""
    by_engine = vals.get(fl.finished or "", {})
    if set(by_engine) != set(engines):
        return {}
    out = {}
    for e, values in by_engine.items():
        total = math.fsum(values)
        if not all(math.isfinite(v) and v >= 0 for v in values) or total > MAX_FINISHED:
            return {}
        out[e] = round(total)
    return out


def _count(flavour: Flavour, name: str, engine: str, value: float) -> int:
    if not math.isfinite(value) or value < 0:
        raise PageError(f"{name} for {flavour.engine_label}={engine} is {value!r}: not a count")
    return round(value)


def parse_page(text: str) -> list[EngineSample]:
    """Every engine on a vLLM or SGLang /metrics page; PageError names what is missing."""
    try:
        vals = _values(text)
    except ValueError as exc:  # the parser's message names the bad line
        raise PageError(f"not Prometheus text: {str(exc)[:200]}") from None
    for fl in FLAVOURS:
        if fl.waiting not in vals and fl.running not in vals:
            continue
        missing = [n for n in (fl.waiting, fl.running) if n not in vals]
        if missing:
            raise PageError(f"{fl.name} page without {' and '.join(missing)}")
        kv_name = next((n for n in fl.kv if n in vals), None)
        engines = sorted(set(vals[fl.waiting]) | set(vals[fl.running]), key=_engine_order)
        finished = _finished(fl, vals, engines)
        out = []
        for e in engines:
            if e not in vals[fl.waiting] or e not in vals[fl.running]:
                gone = fl.waiting if e not in vals[fl.waiting] else fl.running
                raise PageError(f"{fl.name} page without {gone} for {fl.engine_label}={e}")
            kv = None
            if kv_name is not None and e in vals[kv_name]:
                raw = max(vals[kv_name][e])
                kv = min(1.0, max(0.0, raw)) if math.isfinite(raw) else None
            moved = [sum(vals[n][e]) for n in fl.progress if e in vals.get(n, {})]
            out.append(
                EngineSample(
                    e,
                    _count(fl, fl.waiting, e, max(vals[fl.waiting][e])),
                    _count(fl, fl.running, e, max(vals[fl.running][e])),
                    kv,
                    sum(moved) if moved else None,
                    finished.get(e),
                )
            )
        return out
    raise PageError(
        "no engine counts on the page: expected vLLM series "
        f"({VLLM.waiting}, {VLLM.running}) or SGLang series ({SGLANG.waiting}, {SGLANG.running})"
    )


def _engine_order(e: str) -> tuple[int, int | str]:
    return (0, int(e)) if e.isascii() and e.isdigit() else (1, e)  # a label may be "²"
