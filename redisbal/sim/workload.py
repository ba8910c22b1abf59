"""LLM-like traffic for the quality benchmark: heavy-tailed sizes, Poisson, bursts,
multi-turn sessions over shared system prompts, and trace replay.

Every generator is a pure function of its arguments and a seed: the same seed
gives the same requests (arrival times, sizes, API server, prompt blocks) for
every policy under test.

Sizes follow the shape of ShareGPT conversations as the vLLM paper reports them
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, Fig. 11: mean input 161 tokens, mean output 338,
both long-tailed): lognormal with those means; sigma 1.2 for prompts and 1.0
for outputs (medians about half the means, p99 several times them); outputs
capped at 4,096 tokens, prompts at 16,384.

Prompts are token streams with an identity: a token is (owner, position), where
the owner is a shared system prompt, a session (or a trace's key) or a single
request. A prompt's ``blocks`` are the chained hashes of its full 16-token blocks
(a block's hash covers every token before it, as vLLM's prefix-cache hashes
do), so two prompts share blocks exactly as far as they share a prefix: the
turns of one session (each turn's prompt = system prompt + the session's history
+ new user text) and the requests that start with the same system prompt.

A session's next turn arrives a think time after the previous turn finished
(closed loop): ``Request.after`` names the request it follows and
``Request.t`` is then the think time.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from redisbal.errors import TraceError as TraceError
from redisbal.routing.cache_view import BLOCK_TOKENS

PROMPT_MEAN, PROMPT_SIGMA, PROMPT_CAP = 161.0, 1.2, 16384
OUTPUT_MEAN, OUTPUT_SIGMA, OUTPUT_CAP = 338.0, 1.0, 4096


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload."""

    t: float  # arrival (s from start); for a follow-up turn: think time after ``after``
    client: int  # API-server index
    prompt_tokens: int
    output_tokens: int
    key: str | None = None
    blocks: tuple[int, ...] = ()  # the prompt's full blocks
    done_blocks: tuple[int, ...] = ()  # the full blocks of prompt + output
    group: int = 0  # burst index (0 for other traffic)
    after: int = -1  # index of the request this one follows (a session's previous turn)


def lognormal_tokens(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    """A lognormal size with the given mean, in 1..cap."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, int(rng.lognormvariate(mu, sigma))))


def stream_blocks(
    owner: int, length: int, system: tuple[int, int] | None = None
) -> tuple[int, ...]:
    """Chained hashes of the full blocks of the first ``length`` tokens of a stream:
    the system prompt (id, tokens) if any, then the owner's own tokens. Integer
    tuples hash alike in every process (no hash randomisation for ints)."""
    sys_id, sys_len = system if system is not None else (0, 0)
    out = []
    h = 0
    for i in range(length // BLOCK_TOKENS):
        end = (i + 1) * BLOCK_TOKENS
        content = (-1 - sys_id, i) if end <= sys_len else (owner, i)
        h = hash((h, *content))
        out.append(h)
    return tuple(out)


def sized(
    rng: random.Random,
    prompt_mean: float = PROMPT_MEAN,
    output_mean: float = OUTPUT_MEAN,
) -> tuple[int, int]:
    """(prompt, output) tokens of one ShareGPT-like request."""
    return (
        lognormal_tokens(rng, prompt_mean, PROMPT_SIGMA, PROMPT_CAP),
        lognormal_tokens(rng, output_mean, OUTPUT_SIGMA, OUTPUT_CAP),
    )


def _single(owner: int, t: float, client: int, prompt: int, output: int, group: int = 0) -> Request:
    full = stream_blocks(owner, prompt + output)
    return Request(
        t,
        client,
        prompt,
        output,
        None,
        full[: prompt // BLOCK_TOKENS],
        full,
        group,
    )


def poisson(rate: float, duration_s: float, clients: int, seed: int) -> list[Request]:
    """Independent ShareGPT-like requests, Poisson arrivals at ``rate`` per second."""
    rng = random.Random(f"poisson-{seed}")
    out: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        p, o = sized(rng)
        out.append(_single(len(out), t, rng.randrange(clients), p, o))


def bursts(
    size: int, count: int, every_s: float, window_s: float, clients: int, seed: int
) -> list[Request]:
    """``count`` bursts of ``size`` requests, each spread uniformly over ``window_s``."""
    rng = random.Random(f"bursts-{seed}")
    out: list[Request] = []
    for b in range(count):
        for t in sorted(rng.random() * window_s for _ in range(size)):
            p, o = sized(rng)
            out.append(_single(len(out), b * every_s + t, rng.randrange(clients), p, o, b))
    return out


@dataclass(frozen=True)
class SessionShape:
    """Multi-turn sessions: turns per session (geometric, mean ``turns_mean``, at most
    ``turns_max``), think time (exponential, mean ``think_s``), new user text per
    turn (lognormal, ``user_mean``), and ``system_prompts`` shared system prompts of
    ``system_tokens`` tokens each (chosen uniformly per session)."""

    turns_mean: float = 4.0
    turns_max: int = 12
    think_s: float = 1.5
    user_mean: float = 120.0
    output_mean: float = 200.0
    system_prompts: int = 4
    system_tokens: tuple[int, ...] = (400, 800, 1200, 2000)


def sessions(
    rate: float, duration_s: float, clients: int, seed: int, shape: SessionShape | None = None
) -> list[Request]:
    """Sessions start as a Poisson process at ``rate`` per second for ``duration_s``;
    each turn's prompt is system prompt + history + new user text, its key the
    session id, its API server drawn per turn (so a session's turns cross routers)."""
    shape = shape or SessionShape()
    rng = random.Random(f"sessions-{seed}")
    out: list[Request] = []
    t = 0.0
    sid = 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        sid += 1
        k = rng.randrange(shape.system_prompts)
        system = (k, shape.system_tokens[k % len(shape.system_tokens)])
        turns = 1
        while turns < shape.turns_max and rng.random() > 1.0 / shape.turns_mean:
            turns += 1
        sizes = []
        for _ in range(turns):
            user = lognormal_tokens(rng, shape.user_mean, PROMPT_SIGMA, PROMPT_CAP)
            output = lognormal_tokens(rng, shape.output_mean, OUTPUT_SIGMA, OUTPUT_CAP)
            sizes.append((user, output))
        total = system[1] + sum(u + o for u, o in sizes)
        full = stream_blocks(sid, total, system)
        history = system[1]
        prev = -1
        for n, (user, output) in enumerate(sizes):
            prompt = history + user
            at = t if n == 0 else rng.expovariate(1.0 / shape.think_s)
            out.append(
                Request(
                    at,
                    rng.randrange(clients),
                    prompt,
                    output,
                    f"s{seed}-{sid}",
                    full[: prompt // BLOCK_TOKENS],
                    full[: (prompt + output) // BLOCK_TOKENS],
                    0,
                    prev,
                )
            )
            prev = len(out) - 1
            history = prompt + output


def parse_trace(lines: Iterable[str], clients: int, seed: int = 1) -> list[Request]:
    """Requests from a JSON-lines trace: ``{"t": s, "prompt_tokens": n,
    "output_tokens": n, "key": optional str, "system": optional n, "system_tokens":
    optional n}`` per line (other fields ignored, blank lines skipped). Requests of
    one key share a prefix: the key's token stream, of which each request's prompt
    is the first ``prompt_tokens``; a key whose line names a shared system prompt
    starts with its ``system_tokens`` (the same tokens for every key that names it,
    as ``loadgen --session-prompts`` sends them). API servers are drawn from the
    seed. Sorted by ``t``."""
    rows: list[tuple[float, int, int, str | None]] = []
    systems: dict[str, tuple[int, int]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"trace line {n}: not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise TraceError(f"trace line {n}: not a JSON object")
        for f in ("t", "prompt_tokens", "output_tokens"):
            if f not in d:
                raise TraceError(f"trace line {n}: missing field {f!r}")
        t = d["t"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf:
            raise TraceError(f"trace line {n}: field 't' must be a number >= 0, got {t!r:.40}")
        for f, least in (("prompt_tokens", 0), ("output_tokens", 1)):
            v = d[f]
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise TraceError(
                    f"trace line {n}: field {f!r} must be a whole number >= {least}, got {v!r:.40}"
                )
        key = d.get("key")
        if key is not None and (not isinstance(key, str) or len(key) > 1024):
            raise TraceError(
                f"trace line {n}: field 'key' must be a string of at most 1024 characters"
            )
        if key is not None and d.get("system") is not None:
            for f in ("system", "system_tokens"):
                v = d.get(f)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise TraceError(
                        f"trace line {n}: field {f!r} must be a whole number >= 0, got {v!r:.40}"
                    )
            systems.setdefault(key, (d["system"], d["system_tokens"]))
        rows.append((float(t), d["prompt_tokens"], d["output_tokens"], key))
    rows.sort(key=lambda r: r[0])
    rng = random.Random(f"trace-{seed}")
    owners: dict[str, int] = {}
    need: dict[str, int] = {}
    for _, p, o, key in rows:
        if key is not None:
            owners.setdefault(key, len(owners) + 1)
            need[key] = max(need.get(key, 0), p + o)
    streams = {
        key: stream_blocks(-owners[key] - 1_000_000, n, systems.get(key)) for key, n in need.items()
    }
    out: list[Request] = []
    for i, (t, p, o, key) in enumerate(rows):
        client = rng.randrange(clients)
        if key is None:
            out.append(_single(i + 1, t, client, p, o))
            continue
        full = streams[key]
        blocks = full[: p // BLOCK_TOKENS]
        out.append(Request(t, client, p, o, key, blocks, full[: (p + o) // BLOCK_TOKENS]))
    return out


def read_trace(path: str, clients: int, seed: int = 1) -> list[Request]:
    """``parse_trace`` of a file (TraceError for a bad line, OSError for the file)."""
    with open(path, encoding="utf-8") as f:
        return parse_trace(f, clients, seed)
