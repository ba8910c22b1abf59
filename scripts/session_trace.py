#!/usr/bin/env python3
"""Write the simulator's traffic (redisbal.sim.workload) as a JSON-lines trace for
``redisbal loadgen --trace`` (with ``--session-prompts``) and
``scripts/gateway_policies.py --trace``: the real-time counterpart of
``redisbal bench``'s sessions and straggler scenarios.

``sessions``: multi-turn sessions over shared system prompts (``workload.sessions``);
each line names its session (``key``) and system prompt (``system``,
``system_tokens``), so loadgen rebuilds prompts that share their history. A trace
is open loop: a follow-up turn is sent at the previous turn's send time + an
estimate of its service time (``--step-ms`` x its output tokens) + its think time,
where the simulator waits for the previous turn to end. ``poisson``: independent
ShareGPT-like requests (``workload.poisson``), outputs heavy-tailed. ``burst``: the
same requests in bursts (``workload.bursts``): ``--burst-size`` requests within
``--burst-window-s``, every ``--burst-every-s`` over ``--duration``. ``longprompt``:
long prompts sharing prefixes (documents, few-shot examples): Poisson requests, each
one of ``--prefixes`` shared prefixes (lengths drawn once in ``--prefix-min`` ..
``--prefix-max`` tokens; written as the line's ``system`` and ``system_tokens``) and a
short suffix of its own (lognormal, mean ``--suffix-mean``) under a key of its own;
outputs as poisson's.

``prefixes`` and ``agentic`` (redisbal.bench.prefix_traces): traffic where placement
decides the prefix-cache hit rate, with no session key at all. ``prefixes``: Poisson
requests, each one of ``--prefixes`` (default 48) shared prefixes of ``--prefix-min``
.. ``--prefix-max`` tokens, popularity Zipf (``--zipf``), and a short suffix of its own.
``agentic``: agents starting Poisson at ``--rate`` a second, each a chain of calls
(mean ``--turns-mean``) that resend the whole history with a tool result appended
(``--tool-mean`` tokens), named by a ``thread`` loadgen never sends; the first call
starts with one of ``--scaffolds`` shared scaffolds.

    python scripts/session_trace.py sessions --rate 4 --duration 20 --seed 1 -o s.jsonl
    python scripts/session_trace.py prefixes --rate 26 --duration 20 --seed 1 -o p.jsonl
    python scripts/session_trace.py agentic --rate 4 --duration 20 --seed 1 -o a.jsonl
"""

from __future__ import annotations

import argparse
import random
import sys

import orjson

from redisbal.bench.prefix_traces import AgentShape, PrefixShape, agentic_lines, prefix_lines
from redisbal.errors import InvalidArgument
from redisbal.sim.workload import (
    Request,
    SessionShape,
    bursts,
    lognormal_tokens,
    poisson,
    sessions,
)


def _system_of(first_block: int, shape: SessionShape) -> tuple[int, int] | None:
    """Which shared system prompt a session's first block belongs to (the simulator
    hashes block 0 of system prompt k as ``hash((0, -1 - k, 0))``)."""
    for k in range(shape.system_prompts):
        if hash((0, -1 - k, 0)) == first_block:
            return k, shape.system_tokens[k % len(shape.system_tokens)]
    return None


def session_lines(
    rate: float, duration: float, seed: int, shape: SessionShape, step_s: float
) -> list[dict[str, object]]:
    reqs = sessions(rate, duration, 1, seed, shape)
    sent: list[float] = []
    out: list[dict[str, object]] = []
    for r in reqs:
        if r.after < 0:
            t = r.t
        else:
            prev = reqs[r.after]
            t = sent[r.after] + prev.output_tokens * step_s + r.t
        sent.append(t)
        line: dict[str, object] = {
            "t": round(t, 4),
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "key": r.key,
        }
        system = _system_of(r.blocks[0], shape) if r.blocks else None
        if system is not None:
            line["system"], line["system_tokens"] = system
        out.append(line)
    out.sort(key=lambda d: d["t"])  # type: ignore[arg-type, return-value]
    return out


def single_lines(reqs: list[Request], output_scale: float) -> list[dict[str, object]]:
    """Independent requests (Poisson or bursts) as trace lines, outputs scaled."""
    return [
        {
            "t": round(r.t, 4),
            "prompt_tokens": max(1, r.prompt_tokens),
            "output_tokens": max(1, round(r.output_tokens * output_scale)),
        }
        for r in reqs
    ]


def longprompt_lines(
    reqs: list[Request],
    prefixes: int,
    prefix_range: tuple[int, int],
    suffix_mean: float,
    output_scale: float,
    seed: int,
) -> list[dict[str, object]]:
    """Poisson requests as long prompts: a shared prefix (one of ``prefixes``, drawn at
    random, its length fixed) and a suffix of their own."""
    rng = random.Random(f"longprompt-{seed}")
    lengths = [rng.randint(*prefix_range) for _ in range(prefixes)]
    out = single_lines(reqs, output_scale)
    for i, line in enumerate(out):
        k = rng.randrange(prefixes)
        suffix = lognormal_tokens(rng, suffix_mean, 1.0, 8 * int(suffix_mean) + 1)
        line.update(
            prompt_tokens=lengths[k] + suffix, key=f"lp-{i}", system=k, system_tokens=lengths[k]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "traffic", choices=("sessions", "poisson", "burst", "longprompt", "prefixes", "agentic")
    )
    ap.add_argument("--rate", type=float, default=None, help="sessions (or requests) per s")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--output-mean", type=float, default=None, help="sessions, agentic: mean answer [200, 40]"
    )
    ap.add_argument("--user-mean", type=float, default=120.0, help="sessions: new text a turn")
    ap.add_argument("--think-s", type=float, default=1.5, help="sessions: mean think time")
    ap.add_argument("--turns-mean", type=float, default=None, help="sessions, agentic [4, 6]")
    ap.add_argument(
        "--step-ms", type=float, default=None, help="sessions, agentic: decode step [15, 40]"
    )
    ap.add_argument(
        "--output-scale",
        type=float,
        default=1.0,
        help="poisson, burst, longprompt, prefixes: scale output lengths",
    )
    ap.add_argument("--burst-size", type=int, default=96, help="burst: requests a burst")
    ap.add_argument("--burst-every-s", type=float, default=6.0, help="burst: period")
    ap.add_argument("--burst-window-s", type=float, default=0.5, help="burst: spread of one")
    ap.add_argument(
        "--prefixes", type=int, default=None, help="longprompt, prefixes: shared prefixes [4, 48]"
    )
    ap.add_argument("--prefix-min", type=int, default=2048, help="longprompt, prefixes: tokens")
    ap.add_argument("--prefix-max", type=int, default=6144, help="longprompt, prefixes: tokens")
    ap.add_argument(
        "--suffix-mean", type=float, default=64.0, help="longprompt, prefixes: mean own tokens"
    )
    ap.add_argument("--zipf", type=float, default=1.0, help="prefixes: popularity exponent")
    ag = AgentShape()
    ap.add_argument("--scaffolds", type=int, default=ag.scaffolds, help="agentic: shared starts")
    ap.add_argument("--scaffold-min", type=int, default=ag.scaffold_range[0], help="agentic")
    ap.add_argument("--scaffold-max", type=int, default=ag.scaffold_range[1], help="agentic")
    ap.add_argument("--task-mean", type=float, default=ag.task_mean, help="agentic: own tokens")
    ap.add_argument(
        "--turns-max", type=int, default=ag.turns_max, help="agentic: calls per agent, at most"
    )
    ap.add_argument(
        "--tool-mean", type=float, default=ag.tool_mean, help="agentic: tool result tokens"
    )
    ap.add_argument("--tool-min", type=int, default=ag.tool_range[0], help="agentic")
    ap.add_argument("--tool-max", type=int, default=ag.tool_range[1], help="agentic")
    ap.add_argument("--tool-wait-s", type=float, default=ag.tool_wait_s, help="agentic: mean")
    ap.add_argument(
        "--max-prompt", type=int, default=ag.max_prompt, help="agentic: longest call, tokens"
    )
    ap.add_argument(
        "--cut-s", type=float, default=None, help="drop requests sent later (sessions' tails)"
    )
    ap.add_argument("-o", "--out", default="-")
    a = ap.parse_args()
    if a.traffic != "burst" and a.rate is None:
        ap.error(f"{a.traffic} needs --rate")
    step_ms = a.step_ms if a.step_ms is not None else (40.0 if a.traffic == "agentic" else 15.0)
    output_mean = a.output_mean if a.output_mean is not None else 200.0
    turns_mean = a.turns_mean if a.turns_mean is not None else 4.0
    if a.traffic == "burst":
        count = max(1, int(a.duration / a.burst_every_s))
        reqs = bursts(a.burst_size, count, a.burst_every_s, a.burst_window_s, 1, a.seed)
        lines = single_lines(reqs, a.output_scale)
    elif a.traffic in ("prefixes", "agentic"):
        try:
            if a.traffic == "prefixes":
                pshape = PrefixShape(
                    prefixes=48 if a.prefixes is None else a.prefixes,
                    prefix_range=(a.prefix_min, a.prefix_max),
                    zipf=a.zipf,
                    suffix_mean=a.suffix_mean,
                    output_scale=a.output_scale,
                )
                lines = prefix_lines(a.rate, a.duration, a.seed, pshape)
            else:
                ashape = AgentShape(
                    scaffolds=a.scaffolds,
                    scaffold_range=(a.scaffold_min, a.scaffold_max),
                    task_mean=a.task_mean,
                    turns_mean=ag.turns_mean if a.turns_mean is None else a.turns_mean,
                    turns_max=a.turns_max,
                    tool_mean=a.tool_mean,
                    tool_range=(a.tool_min, a.tool_max),
                    output_mean=ag.output_mean if a.output_mean is None else a.output_mean,
                    tool_wait_s=a.tool_wait_s,
                    step_s=step_ms / 1000,
                    max_prompt=a.max_prompt,
                )
                lines = agentic_lines(a.rate, a.duration, a.seed, ashape)
        except InvalidArgument as exc:
            ap.error(str(exc))
    elif a.traffic == "longprompt":
        a.prefixes = 4 if a.prefixes is None else a.prefixes
        if not (1 <= a.prefixes <= 1000 and 1 <= a.prefix_min <= a.prefix_max <= 100_000):
            ap.error("longprompt: --prefixes in 1..1000, 1 <= --prefix-min <= --prefix-max")
        if not 1 <= a.suffix_mean <= 10_000:
            ap.error("longprompt: --suffix-mean in 1..10000")
        reqs = poisson(a.rate, a.duration, 1, a.seed)
        span = (a.prefix_min, a.prefix_max)
        lines = longprompt_lines(reqs, a.prefixes, span, a.suffix_mean, a.output_scale, a.seed)
    elif a.traffic == "sessions":
        shape = SessionShape(
            turns_mean=turns_mean,
            think_s=a.think_s,
            user_mean=a.user_mean,
            output_mean=output_mean,
        )
        lines = session_lines(a.rate, a.duration, a.seed, shape, step_ms / 1000)
    else:
        lines = single_lines(poisson(a.rate, a.duration, 1, a.seed), a.output_scale)
    if a.cut_s is not None:
        lines = [d for d in lines if d["t"] <= a.cut_s]  # type: ignore[operator]
    data = b"".join(orjson.dumps(d) + b"\n" for d in lines)
    if a.out == "-":
        sys.stdout.buffer.write(data)
    else:
        with open(a.out, "wb") as fh:
            fh.write(data)
    keys = len({d["key"] for d in lines if "key" in d})
    threads = len({d["thread"] for d in lines if "thread" in d})
    print(f"{len(lines)} requests, {keys} keys, {threads} threads", file=sys.stderr)


if __name__ == "__main__":
    main()
