"""The gateway matching prompts with the engines' prefix caches (``--prefix-tokens``):
engine-sim engines with a prefix cache behind a gateway whose router's cache view is
filled as the engines' KV-event reader fills it (the blocks an engine stored, named by
engine-sim's tokens). A request sharing a long prefix with an earlier one goes to the
engine that computed it, and that engine's own cache confirms the hit."""

from __future__ import annotations

import re
from typing import Any

import pytest
from support.gateway_stack import (
    MODEL,
    gateway_process,
    openai_client,
    stack,
    start_engines,
    start_gateway,
    stop_gateway,
)
from support.gateway_stack import settled as stack_settled
from support.helpers import await_until
from support.prometheus import scrape, val

from redisbal.gateway.prefix import EVERY, SimBlocks
from redisbal.gateway.proxy import ENGINE_HEADER, route_facts
from redisbal.gateway.server import Gateway
from redisbal.routing.cache_view import anchors
from redisbal.sim.model import EngineParams

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

CACHED = EngineParams(
    running_cap=8,
    base_step_s=0.004,
    per_seq_s=0.0,
    prefill_s=0.0,
    kv_capacity_tokens=1 << 16,
    cache_blocks=512,
)
SHARED = "".join(f"Rule {i}: answer briefly and cite the manual, section {i}. " for i in range(40))


def cache_routes(gw: Gateway) -> tuple[float, float]:
    """The gateway's cache_routes and cache_matched_tokens counters, as scraped."""
    text = gw.metrics.render().decode()
    got = [
        re.search(rf"^{name}_total (\S+)$", text, re.M)
        for name in ("redisbal_gateway_cache_routes", "redisbal_gateway_cache_matched_tokens")
    ]
    return tuple(float(m.group(1)) if m else -1.0 for m in got)  # type: ignore[return-value]


async def served_by(gw: Gateway, **req: Any) -> str:
    """Send one request through the official client; the engine that served it."""
    url = f"http://127.0.0.1:{gw.ports[0]}"
    async with openai_client(url) as client:
        if "messages" in req:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=2, **req
            )
        else:
            raw = await client.completions.with_raw_response.create(
                model=MODEL, max_tokens=2, **req
            )
    return raw.headers[ENGINE_HEADER]


def settled(gw: Gateway) -> bool:
    return all(e.pending == 0 and e.inflight == 0 for e in gw.router.core.known)


@pytest.mark.parametrize("source", ["told", "learned", "off"])
async def test_a_shared_prefix_goes_to_the_engine_that_holds_it(
    redis_url: str, deployment: str, source: str
) -> None:
    """told: the view as the engines' KV-event reader fills it; learned: the gateway's
    own routes (no KV events, --prefix-cache-tokens); off: no --prefix-tokens."""
    matching = source != "off"
    engines = await start_engines(redis_url, deployment, 4, CACHED)
    by_id = {e.engine_id: e for e in engines}
    gw = None
    try:
        gw = await start_gateway(
            redis_url,
            deployment,
            prefix_blocks=SimBlocks() if matching else None,
            learn_routes=64 if source == "learned" else 0,
        )
        await await_until(lambda: len(gw.live_engines()) == 4)
        first = SHARED + "Question: what is rule 3?"
        home = await served_by(gw, prompt=first)
        held = anchors(SimBlocks()({"prompt": first}, False, EVERY))
        if source == "told":  # what the reader would add: the blocks the engine stored
            gw.router.core.cache_view.apply(home, added=held)
        # the gateway's /metrics show what its view holds of each engine
        text = gw.metrics.render().decode()
        gauge = r'^redisbal_gateway_cache_anchors\{engine="([^"]+)"\} (\S+)$'
        shown = [(e, float(v)) for e, v in re.findall(gauge, text, re.M)]
        assert shown == ([(home, float(len(held)))] if matching else [])
        await await_until(lambda: settled(gw))
        seen = by_id[home].model.cached_tokens_seen
        # the same prefix as a chat: the messages' contents one after the other
        chat = [{"role": "system", "content": SHARED}, {"role": "user", "content": "And 7?"}]
        again = await served_by(gw, messages=chat)
        routes, tokens = cache_routes(gw)
        if matching:
            assert again == home
            assert by_id[home].model.cached_tokens_seen - seen >= len(SHARED) // 4 - 64
            assert routes == 1 and tokens >= len(SHARED) // 4 - 64
            # a trace's attempt says so too: the tokens the engine holds
            blocks = SimBlocks()({"messages": chat}, True, EVERY)
            d = gw.router.route(blocks=blocks, prompt_tokens=len(blocks) * 16)
            facts = route_facts(gw.models.default, d, 1, None, False)
            gw.router.core.unroute(d)
            assert facts["redisbal.engine"] == home and facts["redisbal.cache.tokens"] == tokens
        else:  # off: routed on load alone, whichever engine that is
            assert routes == 0 and tokens == 0
    finally:
        if gw is not None:
            await stop_gateway(gw)
        for e in engines:
            await e.stop()


@pytest.mark.slow
async def test_the_gateway_command_learns_its_routes_within_its_cache_tokens(
    redis_url: str, deployment: str
) -> None:
    """``redisbal gateway --prefix-tokens text --prefix-cache-tokens 128``, no KV events:
    a chat sharing an earlier prompt's text goes where that prompt went, and the view
    keeps at most 2 anchors (128 tokens) of each engine."""
    async with stack(redis_url, deployment, n=4) as st:
        async with gateway_process(
            redis_url, deployment, "--prefix-tokens", "text", "--prefix-cache-tokens", "128"
        ) as (g, base, _):
            async with openai_client(base) as client:
                raw = await client.completions.with_raw_response.create(
                    model=MODEL, prompt=SHARED, max_tokens=2
                )
                home = raw.headers[ENGINE_HEADER]
                chat = [{"role": "user", "content": SHARED + " And rule 7?"}]
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=chat, max_tokens=2
                )
            got = scrape(base + "/metrics")
            assert raw.headers[ENGINE_HEADER] == home
            assert val(got, "redisbal_gateway_cache_routes_total") == 1
            anchors_held = {
                dict(labels)["engine"]: v
                for (name, labels), v in got.items()
                if name == "redisbal_gateway_cache_anchors"
            }
            assert anchors_held == {home: 2.0}, anchors_held
            g.terminate()
        await stack_settled(st)
