"""Traces where placement decides the prefix-cache hit rate, for the real-time policy
benchmark (scripts/session_trace.py ``prefixes`` and ``agentic``): prompts share long
prefixes, but no request carries a session key (no ``user``), so only a router that
knows or guesses which engine holds a prefix can send it there.

- ``prefix_lines``: many shared prefixes (documents, few-shot sets, system prompts;
  48 of 2-6k tokens by default) with heavy-tailed (Zipf) popularity; each request is
  one prefix (the line's ``system`` and ``system_tokens``) and a short suffix of its
  own. More prefixes than an engine's cache holds: where each prefix goes decides
  whether it is computed once or on every engine.
- ``agentic_lines``: agents making multi-turn calls without ``user``: each call
  resends the agent's whole history (the previous prompt and its answer) with a tool
  result appended, so consecutive calls of one agent share a growing prefix; the first
  call starts with one of a few shared agent scaffolds. A line names its agent as a
  ``thread`` (loadgen rebuilds the history from it and never sends it).

The lines are the trace format ``redisbal loadgen --trace --session-prompts`` replays
(redisbal.sim.load_plan): prompt texts are built there, 4 characters a token, so two
prompts share whole 64-character chunks (the engines' 16-token blocks) exactly as far
as they share a prefix. Every generator is a pure function of its arguments and seed.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

from redisbal.errors import InvalidArgument
from redisbal.sim.load_plan import output_text
from redisbal.sim.workload import lognormal_tokens, poisson

MAX_PROMPT = 1_000_000  # what a trace line may carry (redisbal.sim.load_plan.read_trace)


@dataclass(frozen=True)
class PrefixShape:
    """The ``prefixes`` trace: ``prefixes`` shared prefixes of lengths drawn once (per
    seed) in ``prefix_range`` tokens, prefix k's popularity 1 / rank^``zipf`` (ranks in
    an order drawn from the seed), a suffix of its own per request (lognormal, mean
    ``suffix_mean``), outputs ShareGPT-shaped times ``output_scale``."""

    prefixes: int = 48
    prefix_range: tuple[int, int] = (2048, 6144)
    zipf: float = 1.0
    suffix_mean: float = 64.0
    output_scale: float = 0.12

    def check(self) -> None:
        lo, hi = self.prefix_range
        if not 1 <= self.prefixes <= 10_000:
            raise InvalidArgument(f"prefixes: --prefixes {self.prefixes}: use 1..10000")
        if not 16 <= lo <= hi <= 100_000:
            raise InvalidArgument(
                f"prefixes: --prefix-min {lo} / --prefix-max {hi}: use 16 <= min <= max <= 100000"
            )
        if not 0 <= self.zipf <= 5:
            raise InvalidArgument(f"prefixes: --zipf {self.zipf:g}: use 0..5 (0: uniform)")
        if not 1 <= self.suffix_mean <= 10_000:
            raise InvalidArgument(f"prefixes: --suffix-mean {self.suffix_mean:g}: use 1..10000")
        if not 0 < self.output_scale <= 100:
            raise InvalidArgument(f"prefixes: --output-scale {self.output_scale:g}: use (0, 100]")


def _check_rate(rate: float, duration: float, what: str) -> None:
    if not (0 < rate <= 10_000 and 0 < duration <= 86_400):
        raise InvalidArgument(
            f"{what}: --rate {rate:g} and --duration {duration:g}: use a rate in (0, 10000] "
            "and a duration in (0, 86400] s"
        )


def prefix_lines(
    rate: float, duration: float, seed: int, shape: PrefixShape | None = None
) -> list[dict[str, Any]]:
    """Poisson requests at ``rate`` over ``duration`` s, each a shared prefix and a
    suffix of its own, no key; as trace lines in time order."""
    shape = shape or PrefixShape()
    shape.check()
    _check_rate(rate, duration, "prefixes")
    rng = random.Random(f"prefixes-{seed}")
    lengths = [rng.randint(*shape.prefix_range) for _ in range(shape.prefixes)]
    ranks = list(range(1, shape.prefixes + 1))
    rng.shuffle(ranks)  # popularity does not follow length
    cum = list(itertools.accumulate(r**-shape.zipf for r in ranks))
    cap = 8 * int(shape.suffix_mean) + 1
    out: list[dict[str, Any]] = []
    for r in poisson(rate, duration, 1, seed):
        k = min(bisect.bisect_right(cum, rng.random() * cum[-1]), shape.prefixes - 1)
        suffix = lognormal_tokens(rng, shape.suffix_mean, 1.0, cap)
        out.append(
            {
                "t": round(r.t, 4),
                "prompt_tokens": lengths[k] + suffix,
                "output_tokens": max(1, round(r.output_tokens * shape.output_scale)),
                "system": k,
                "system_tokens": lengths[k],
            }
        )
    return out


@dataclass(frozen=True)
class AgentShape:
    """The ``agentic`` trace. An agent's first call: one of ``scaffolds`` shared
    scaffolds (lengths drawn once in ``scaffold_range``) and a task of its own (mean
    ``task_mean`` tokens). Each later call: the previous call's prompt and answer, and a
    tool result (lognormal, mean ``tool_mean``, within ``tool_range``), sent once the
    previous answer is estimated done (``step_s`` a token) plus a tool latency
    (exponential, mean ``tool_wait_s``). Calls per agent: geometric with mean
    ``turns_mean``, at most ``turns_max``, and none whose prompt would pass
    ``max_prompt`` tokens. Answers: lognormal, mean ``output_mean``."""

    scaffolds: int = 8
    scaffold_range: tuple[int, int] = (1024, 3072)
    task_mean: float = 200.0
    turns_mean: float = 6.0
    turns_max: int = 16
    tool_mean: float = 600.0
    tool_range: tuple[int, int] = (100, 4000)
    output_mean: float = 40.0
    tool_wait_s: float = 0.5
    step_s: float = 0.04
    max_prompt: int = 12_000

    def check(self) -> None:
        slo, shi = self.scaffold_range
        tlo, thi = self.tool_range
        bad = [
            (not 1 <= self.scaffolds <= 10_000, f"--scaffolds {self.scaffolds}: use 1..10000"),
            (not 16 <= slo <= shi <= 100_000, "--scaffold-min/--scaffold-max: 16 <= min <= max"),
            (not 1 <= self.task_mean <= 10_000, f"--task-mean {self.task_mean:g}: use 1..10000"),
            (not 1 <= self.turns_max <= 1000, f"--turns-max {self.turns_max}: use 1..1000"),
            (
                not 1 <= self.turns_mean <= self.turns_max,
                f"--turns-mean {self.turns_mean:g}: use 1..--turns-max",
            ),
            (not 1 <= tlo <= thi <= 100_000, "--tool-min/--tool-max: 1 <= min <= max <= 100000"),
            (not tlo <= self.tool_mean <= thi, "--tool-mean: within --tool-min..--tool-max"),
            (not 1 <= self.output_mean <= 10_000, "--output-mean: use 1..10000"),
            (not 0 <= self.tool_wait_s <= 3600, "--tool-wait-s: use 0..3600"),
            (not 0 <= self.step_s <= 10, "--step-ms: use 0..10000"),
            (
                not shi + 8 * self.task_mean < self.max_prompt <= MAX_PROMPT,
                f"--max-prompt {self.max_prompt}: above the longest first call, at most "
                f"{MAX_PROMPT}",
            ),
        ]
        for wrong, words in bad:
            if wrong:
                raise InvalidArgument(f"agentic: {words}")


def next_prompt_tokens(prompt_tokens: int, output_tokens: int, tool_tokens: int) -> int:
    """A call's prompt after one of ``prompt_tokens`` answered with ``output_tokens``:
    the history (the prompt's text and the engines' answer text, rounded up to whole
    tokens) and the tool result."""
    history = 4 * prompt_tokens + len(output_text(output_tokens))
    return -(-history // 4) + tool_tokens


def agentic_lines(
    rate: float, duration: float, seed: int, shape: AgentShape | None = None
) -> list[dict[str, Any]]:
    """Agents starting Poisson at ``rate`` a second over ``duration`` s, each a chain of
    calls naming it as their ``thread`` (no key); trace lines in time order (open loop:
    each call's send time is estimated, as session traces' turns are)."""
    shape = shape or AgentShape()
    shape.check()
    _check_rate(rate, duration, "agentic")
    rng = random.Random(f"agentic-{seed}")
    lengths = [rng.randint(*shape.scaffold_range) for _ in range(shape.scaffolds)]
    tlo, thi = shape.tool_range
    out: list[dict[str, Any]] = []
    t = rng.expovariate(rate)
    agent = 0
    while t < duration:
        k = rng.randrange(shape.scaffolds)
        extra = shape.turns_mean - 1
        turns = 1 + (math.floor(rng.expovariate(1 / extra)) if extra > 0 else 0)
        turns = min(turns, shape.turns_max)
        prompt = lengths[k] + lognormal_tokens(rng, shape.task_mean, 1.0, 8 * int(shape.task_mean))
        sent = t
        for _ in range(turns):
            output = lognormal_tokens(rng, shape.output_mean, 1.0, 8 * int(shape.output_mean))
            out.append(
                {
                    "t": round(sent, 4),
                    "prompt_tokens": prompt,
                    "output_tokens": output,
                    "thread": f"agent-{agent}",
                    "system": k,
                    "system_tokens": lengths[k],
                }
            )
            tool = max(tlo, min(thi, lognormal_tokens(rng, shape.tool_mean, 1.0, thi)))
            wait = rng.expovariate(1 / shape.tool_wait_s) if shape.tool_wait_s > 0 else 0.0
            sent += output * shape.step_s + wait
            prompt = next_prompt_tokens(prompt, output, tool)
            if prompt > shape.max_prompt:
                break
        agent += 1
        t += rng.expovariate(rate)
    out.sort(key=lambda d: d["t"])
    return out
