"""The requests of a real-time load: when each is sent, its sizes and its prompt text
(what ``redisbal loadgen`` sends, and what the demo reads to know the load it will
send), and the answer text the simulated HTTP engines stream, which a conversation's
next prompt repeats."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import click
import orjson

MAX_TRACE_LINE = 4096


@dataclass(slots=True)
class Planned:
    t: float  # seconds from the start
    prompt_tokens: int
    output_tokens: int
    key: str | None = None
    system: int | None = None  # a shared system prompt the key's prompts start with
    system_tokens: int = 0
    text: str | None = None  # the prompt (session_prompts); else filler of the length
    thread: str | None = None  # a conversation the prompt continues, sent without a key


def lognormal_int(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
    return max(1, min(cap, int(rng.lognormvariate(mu, sigma))))


def plan(
    *,
    rate: float,
    duration: float,
    arrival: str,
    burst: int,
    burst_every: float,
    prompt_mean: float,
    output_mean: float,
    sigma: float,
    seed: int,
    output_cap: int = 8192,
) -> list[Planned]:
    """The schedule: Poisson arrivals at ``rate``, or ``burst`` requests at once every
    ``burst_every`` seconds; heavy-tailed lengths."""
    rng = random.Random(seed)
    times: list[float] = []
    if arrival == "poisson":
        t = rng.expovariate(rate)
        while t < duration:
            times.append(t)
            t += rng.expovariate(rate)
    else:
        t = 0.0
        while t < duration:
            times += [t] * burst
            t += burst_every
    return [
        Planned(
            t,
            lognormal_int(rng, prompt_mean, sigma, 32768),
            lognormal_int(rng, output_mean, sigma, output_cap),
        )
        for t in times
    ]


def read_trace(path: str) -> list[Planned]:
    """JSON lines {"t", "prompt_tokens", "output_tokens", "key"?, "thread"?, "system"?,
    "system_tokens"?}; errors name the line. ``key`` is sent as the body's ``user``;
    ``thread`` names a conversation as a key does (its prompts repeat its history) but
    is never sent: an agent's calls that carry no ``user``. A line has at most one."""
    out: list[Planned] = []
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            if len(line) > MAX_TRACE_LINE:
                raise click.BadParameter(f"{where}: line longer than {MAX_TRACE_LINE} bytes")
            try:
                d = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise click.BadParameter(f"{where}: not JSON: {exc}") from None
            if not isinstance(d, dict):
                raise click.BadParameter(f"{where}: each line must be a JSON object")
            t = d.get("t")
            if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < 1e7:
                raise click.BadParameter(f"{where}: t must be seconds >= 0, got {t!r}")
            vals = []
            for name in ("prompt_tokens", "output_tokens"):
                v = d.get(name)
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1_000_000:
                    raise click.BadParameter(f"{where}: {name} must be in 1..1000000, got {v!r}")
                vals.append(v)
            key, thread = d.get("key"), d.get("thread")
            for name, v in (("key", key), ("thread", thread)):
                if v is not None and not (isinstance(v, str) and len(v) <= 256):
                    raise click.BadParameter(
                        f"{where}: {name} must be a string of <= 256 characters"
                    )
            if key is not None and thread is not None:
                raise click.BadParameter(f"{where}: a line has a key or a thread, not both")
            system, system_tokens = d.get("system"), d.get("system_tokens", 0)
            for name, v in (("system", system), ("system_tokens", system_tokens)):
                bad = isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1_000_000
                if v is not None and bad:
                    raise click.BadParameter(f"{where}: {name} must be in 0..1000000, got {v!r}")
            p = Planned(float(t), vals[0], vals[1], key, system, system_tokens or 0, thread=thread)
            out.append(p)
    out.sort(key=lambda p: p.t)
    return out


def output_text(n: int) -> str:
    """The answer text of ``n`` tokens the simulated HTTP engines stream (one `` tI`` a
    token): what the next turn of a conversation repeats as its history."""
    return "".join(f" t{i}" for i in range(n))


def _filler(seed: str, tokens: int) -> str:
    """``tokens`` tokens (4 characters each) of text drawn from ``seed``."""
    return random.Random(seed).randbytes(2 * max(0, tokens)).hex()


def session_prompts(planned: list[Planned], seed: int = 0) -> None:
    """Give each request a prompt text of its ``prompt_tokens`` tokens (4 characters
    each, as the simulated engines count) shaped like a conversation, as the
    simulator's sessions are: a key's first prompt starts with its shared system prompt
    (``system``, ``system_tokens``; the same text for every key that names it), each
    later prompt with the previous prompt and that request's answer (the engines'
    answer text, ``output_text``), then new text drawn from the key. A ``thread``
    is a key that is not sent (its prompts built alike). Requests without either
    start with their system prompt, if any, then text of their own. A shared text
    is shared in whole 64-character chunks (the engines' blocks) up to where it
    ends. Deterministic in ``planned`` (in time order) and ``seed``, so every policy
    replays the same prompts."""
    history: dict[str, str] = {}
    for i, p in enumerate(planned):
        want = p.prompt_tokens * 4
        conv = p.key if p.key is not None else p.thread
        if conv is None and p.system is None:
            p.text = _filler(f"req-{seed}-{i}", p.prompt_tokens)
            continue
        head = history.get(conv) if conv is not None else None
        if head is None:
            head = "" if p.system is None else _filler(f"system-{p.system}", p.system_tokens)
        own = f"key-{seed}-{conv}-{i}" if conv is not None else f"req-{seed}-{i}"
        text = head[:want]
        text += _filler(own, (want - len(text) + 3) // 4)[: want - len(text)]
        p.text = text
        if conv is not None:
            history[conv] = text + output_text(p.output_tokens)
