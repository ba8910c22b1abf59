"""Scenario options of the real-time policy benchmark (scripts/gateway_policies.py),
chosen where state shared between router replicas should matter.

- ``--split S``: replica 0 takes a share S of the requests, the others the rest in
  turn (``redisbal loadgen --split``, drawn per request from the seed).
- ``--bypass RATE:IDS``: a client of its own sends Poisson traffic straight to the
  engines ``IDS`` (no router sees it; only the engines' reports do), shaped like the
  load (``bypass_trace``), its figures kept apart from the routed requests'.
- ``--slow ID[,ID...]:FACTOR`` (repeatable): slower engines, as ``redisbal demo --slow``.
- Peer policies fed by the engines' KV events (vllm-router's kv_aware): a ZMQ
  publisher per engine (``kv_event_endpoints``), given to engine-sim as ``--kv-events``
  once per engine in id order (``kv_events_engine_args``) and to the router as each
  worker URL's source (``kv_sources``).

Everything here is checked at the boundary with a one-line error (``ValueError``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import click

from redisbal.errors import InvalidArgument
from redisbal.sim.cli import parse_slow
from redisbal.sim.load_plan import Planned

MAX_BYPASS_RATE = 10_000.0


@dataclass(frozen=True)
class Bypass:
    """Poisson traffic at ``rate`` requests/s straight to the engines ``engines``."""

    rate: float
    engines: tuple[str, ...]

    def label(self) -> str:
        return f"bypass {self.rate:g}/s to {','.join(self.engines)}"


def parse_bypass(value: str, engines: int) -> Bypass:
    """``RATE:ID[,ID...]`` with engine ids among the run's ``0 .. engines-1``."""
    rate_s, sep, ids_s = value.partition(":")
    try:
        rate = float(rate_s)
    except ValueError:
        rate = -1.0
    if not sep or not 0 < rate <= MAX_BYPASS_RATE:
        raise InvalidArgument(
            f"--bypass {value!r}: use RATE:ID[,ID...] with RATE in (0, {MAX_BYPASS_RATE:g}] "
            "requests/s, e.g. 12:0,1"
        )
    ids = [i.strip() for i in ids_s.split(",")]
    known = {str(i) for i in range(engines)}
    bad = [i for i in ids if i not in known]
    if bad or not ids:
        raise InvalidArgument(
            f"--bypass {value!r}: engine ids must be among 0..{engines - 1} "
            f"(the run's {engines} engines), got {','.join(bad) or 'none'}"
        )
    return Bypass(rate, tuple(dict.fromkeys(ids)))


def check_slow(values: list[str], engines: int) -> dict[str, float]:
    """``--slow`` values (``redisbal demo``'s format) -> {engine id: factor}, every id
    among the run's engines."""
    try:
        slow = parse_slow(tuple(values))
    except click.BadParameter as exc:
        raise InvalidArgument(f"--slow {exc.format_message()}") from None
    bad = sorted(set(slow) - {str(i) for i in range(engines)})
    if bad:
        raise InvalidArgument(
            f"--slow names engines the run does not have: {', '.join(bad)} "
            f"(its {engines} engines are 0..{engines - 1})"
        )
    return slow


def check_split(share: float | None, gateways: int) -> None:
    if share is None:
        return
    if not 0 <= share <= 1:
        raise InvalidArgument(f"--split {share:g}: a share in [0, 1] (replica 0's)")
    if gateways < 2:
        raise InvalidArgument("--split needs --gateways 2 or more")


def bypass_trace(
    bypass: Bypass, duration: float, seed: int, shapes: list[Planned]
) -> list[dict[str, Any]]:
    """The bypass client's requests as trace lines: Poisson arrivals at its rate over
    ``duration``, each the prompt and output lengths (and shared system prompt, if any)
    of a request of ``shapes`` (the load's) drawn at random, under a key of its own, so
    its text is its own past the system prompt. Deterministic in ``seed``: every policy
    sees the same bypass traffic."""
    if not shapes:
        raise InvalidArgument("the load has no requests to shape the bypass traffic on")
    rng = random.Random(f"bypass-{seed}")
    out: list[dict[str, Any]] = []
    t = rng.expovariate(bypass.rate)
    while t < duration:
        p = shapes[rng.randrange(len(shapes))]
        line: dict[str, Any] = {
            "t": round(t, 4),
            "prompt_tokens": p.prompt_tokens,
            "output_tokens": p.output_tokens,
            "key": f"bypass-{len(out)}",
        }
        if p.system is not None:
            line["system"], line["system_tokens"] = p.system, p.system_tokens
        out.append(line)
        t += rng.expovariate(bypass.rate)
    return out


def kv_event_endpoints(base: int, n: int) -> list[str]:
    """Engine i's KV-event publisher: ``tcp://127.0.0.1:<base + i>`` (loopback), as
    engine-sim binds them from one ``--kv-events`` endpoint."""
    if n < 0 or base < 1 or base + n > 65536:
        raise InvalidArgument(f"KV event ports {base}..{base + n - 1} must be in 1..65535")
    return [f"tcp://127.0.0.1:{base + i}" for i in range(n)]


def kv_events_engine_args(endpoints: list[str]) -> list[str]:
    """engine-sim's arguments publishing each engine's KV events: ``--kv-events`` with
    engine 0's endpoint (engine k binds its port + k); nothing without endpoints."""
    return ["--kv-events", endpoints[0]] if endpoints else []


def kv_subscriber_args(endpoints: list[str]) -> list[str]:
    """``redisbal kv-events`` following every engine's publisher (engine ids "0".., in
    the order of ``endpoints``)."""
    return [a for i, ep in enumerate(endpoints) for a in ("--source", f"{i}={ep}")]


def kv_sources(urls: dict[str, str], endpoints: list[str]) -> dict[str, str]:
    """{worker URL: its engine's publisher}: ``urls`` maps engine ids (``"0"`` ..) to the
    URLs they registered, ``endpoints`` is in engine-id order."""
    want = {str(i) for i in range(len(endpoints))}
    if set(urls) != want:
        raise InvalidArgument(
            f"engines registered ids {sorted(urls)}, the KV event publishers are for {sorted(want)}"
        )
    return {urls[str(i)]: ep for i, ep in enumerate(endpoints)}


def cache_blocks(engine_args: list[str]) -> int | None:
    """The engines' prefix-cache size in blocks, if ``--cache-blocks`` is among their
    arguments (for the scenario's label)."""
    if "--cache-blocks" not in engine_args:
        return None
    i = engine_args.index("--cache-blocks")
    try:
        return int(engine_args[i + 1])
    except (IndexError, ValueError):
        raise InvalidArgument("--engine-args: --cache-blocks needs a number of blocks") from None


def scenario(
    gateways: int,
    engines: int,
    split: float | None,
    bypass: Bypass | None,
    slow: list[str],
    cache: int | None = None,
) -> dict[str, Any]:
    """What ran, for the JSON rows; ``label`` says it in a few words for the table
    (``cache``: the engines' prefix cache in blocks, where it is small enough to say)."""
    parts = [f"{gateways} replicas x {engines} engines"]
    if cache is not None:
        parts.append(f"cache {cache} blocks")
    if split is not None:
        parts.append(f"split {split:g}")
    if bypass is not None:
        parts.append(bypass.label())
    if slow:
        parts.append("slow " + " ".join(slow))
    return {
        "gateways": gateways,
        "engines": engines,
        "split": split,
        "bypass": None
        if bypass is None
        else {"rate": bypass.rate, "engines": list(bypass.engines)},
        "slow": list(slow),
        "cache_blocks": cache,
        "label": ", ".join(parts),
    }
