#!/usr/bin/env python3
"""What matching prompts with the engines' prefix caches costs, in one run (in-process,
one core, interleaved so that host noise hits every variant alike).

route(): the default policy's route() + unroute() on 8 and 64 engines, per variant:
``plain`` (no blocks: today's call), ``empty`` (a 512-block prompt, no engine's cache
known), ``nomatch`` (every engine holds other prompts), ``match`` (one engine holds the
prompt: the cache path decides), ``learned`` (the router learns its routes, no KV
events: the prompt was sent before, and each route learns it again). The gateway:
``--prefix-tokens text`` and ``sim`` on prompts of 2k, 6k and 16k tokens (the last cut
at 8192), against what the gateway already does per request before routing (parse the
body, ``request_hints``); and a BPE tokenizer
(``tokenizers``, trained here on this Python's standard library: no download) on the
same texts, when the package is installed.

    python scripts/prefix_cost.py [--reps 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from redisbal.gateway.prefix import EVERY, ChainMemo, SimBlocks, TextBlocks, TokenizerBlocks
from redisbal.gateway.proxy import request_hints
from redisbal.routing.cache_view import anchors, chain_hashes
from redisbal.routing.router_core import RouterCore


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def make_core(n: int, filled: str) -> RouterCore:
    from redisbal.barrier.snapshot import Snapshot

    ids = [f"e{i}" for i in range(n)]
    # even loads, no room (KV nearly full): a holder takes a request by the slack alone
    frag = {"wave": 0, "step": 1, "waiting": 0, "running": 10, "kv": 0.95, "t": 1, "adm": [0]}
    engines = {e: dict(frag) for e in ids}
    snap = {
        "deployment": "d", "epoch": "ep", "version": 1, "wave": 0, "step": 1, "forced": False,
        "laggards": {}, "gone": {}, "joining": [], "time_ms": 1, "engines": engines,
    }  # fmt: skip
    # learned: the router learns its routes (no KV events): the prompt, sent before
    core = RouterCore(0, 1, rng=random.Random(1), learn_routes=8192 if filled == "learned" else 0)
    core.apply_snapshot(Snapshot.from_json(orjson.dumps(snap)))
    core.connected = True
    if filled == "nomatch":
        for i, e in enumerate(ids):  # each engine holds 8 prompts of its own
            for k in range(8):
                core.cache_view.apply(e, added=anchors(chain_hashes([i * 10 + k + 1] * 8192)))
    elif filled == "match":
        core.cache_view.apply(ids[n // 2], added=anchors(PROMPT))
    return core


PROMPT = tuple(chain_hashes(list(range(8192))))  # 512 blocks, as the gateway passes them


def route_costs(reps: int) -> None:
    print("route() + unroute(), us per call (median of reps), and over plain in the same rep")
    for n in (8, 64):
        cores = {
            v: make_core(n, v if v in ("nomatch", "match", "learned") else "")
            for v in ("plain", "empty", "nomatch", "match", "learned")
        }
        kw = {"plain": {"prompt_tokens": 8192}}
        samples: dict[str, list[float]] = {v: [] for v in cores}
        ratios: dict[str, list[float]] = {v: [] for v in cores}
        for _ in range(reps):
            got = {}
            for v, core in cores.items():
                args = kw.get(v, {"prompt_tokens": 8192, "blocks": PROMPT})

                def once(core: RouterCore = core, args: dict[str, Any] = args) -> None:
                    core.unroute(core.route(**args))

                got[v] = per_call_us(once, 4000)
            for v in cores:
                samples[v].append(got[v])
                ratios[v].append(got[v] / got["plain"])
        for v in cores:
            print(
                f"  {n:3d} engines {v:8s} {statistics.median(samples[v]):7.2f} us"
                f"  x{statistics.median(ratios[v]):.2f}"
            )
        assert cores["match"].counters["cache_routes"] > 0


def corpus() -> str:
    root = Path(random.__file__).parent
    return "".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:120])


def gateway_costs(reps: int) -> None:
    text = corpus()
    tokenizers: dict[str, Any] = {"text": TextBlocks, "sim": SimBlocks}
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=16000, show_progress=False))
        path = Path("/tmp") / f"prefix_cost_{id(tok)}.json"
        tok.save(str(path))
        bpe = TokenizerBlocks(str(path))  # (read once: the file may go)
        path.unlink()
        tokenizers["bpe"] = lambda: _fresh(bpe)
    except ImportError:
        print("(no tokenizers package: the BPE rows are left out)")
    print(
        "gateway, per request, us (median of reps), against parsing the body and "
        "request_hints (what it does anyway before routing):"
    )
    print("  warm: a shared prefix its engines hold + a new 200-token question, hashed before")
    print(
        "  cold-held: every anchor held, nothing remembered (the bound: a new long prefix; "
        "any new prompt where the gateway learns its routes)"
    )
    print("  cold-unheld: a new prompt no engine holds any of (one piece hashed)")
    rng = random.Random(1)
    for tokens in (2048, 6144, 16384):
        shared = text[: tokens * 4]
        body = orjson.dumps({"model": "m", "prompt": shared, "max_tokens": 16})
        base = statistics.median(
            per_call_us(lambda body=body: request_hints(orjson.loads(body), None), 100)
            for _ in range(reps)
        )
        line = f"  {tokens:6d} sim-tokens: parse+hints {base:6.1f}"
        for name, make in tokenizers.items():
            hasher = make()
            held = set(anchors(hasher({"prompt": shared}, False, EVERY)))
            res: dict[str, list[float]] = {"warm": [], "cold-held": [], "cold-unheld": []}
            for rep in range(reps):
                n = 30
                asked = "abcdefgh "
                bodies = [
                    {"prompt": shared + "".join(rng.choice(asked) for _ in range(800))}
                    for _ in range(n)
                ]
                # a new first piece: nothing of it or after it is remembered
                cold = [{"prompt": f"{rep}.{k}:" + b["prompt"]} for k, b in enumerate(bodies)]
                for what, given, within in (
                    ("warm", bodies, held),
                    ("cold-unheld", cold, held),
                    ("cold-held", [{"prompt": "~" + b["prompt"]} for b in cold], EVERY),
                ):
                    it = iter(given)

                    def once(h: Any = hasher, it: Any = it, within: Any = within) -> None:
                        h(next(it), False, within)

                    res[what].append(per_call_us(once, n))
            line += (
                "; " + name + " " + " / ".join(f"{statistics.median(v):6.1f}" for v in res.values())
            )
        print(line + "  (warm / cold-held / cold-unheld)")


def _fresh(bpe: TokenizerBlocks) -> TokenizerBlocks:
    """The same tokenizer with a memo of its own."""
    out = TokenizerBlocks.__new__(TokenizerBlocks)
    out.tokenizer, out.max_tokens, out.memo = bpe.tokenizer, bpe.max_tokens, ChainMemo()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    route_costs(args.reps)
    gateway_costs(args.reps)


if __name__ == "__main__":
    sys.exit(main())
