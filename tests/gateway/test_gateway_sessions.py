"""Sessions on the HTTP path: engines with a prefix cache behind a gateway, fed
conversation-shaped prompts (loadgen's ``session_prompts``) with their key as the
body's ``user``. A session's second turn must find its history in the cache of the
engine that served its first."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from support.gateway_stack import MODEL, start_engines, start_gateway, stop_gateway
from support.helpers import await_until

from redisbal.gateway.proxy import ENGINE_HEADER
from redisbal.routing.cache_view import BLOCK_TOKENS, CHARS_PER_TOKEN
from redisbal.sim.load_plan import Planned, output_text, session_prompts
from redisbal.sim.model import EngineParams

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too

CACHED = EngineParams(
    running_cap=8,
    base_step_s=0.004,
    per_seq_s=0.0,
    prefill_s=0.0,
    prefill_per_token_s=1e-6,
    kv_capacity_tokens=16384,
    cache_blocks=512,
)


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def test_a_sessions_second_turn_hits_the_cache_of_its_first_turns_engine(
    redis_url: str, deployment: str
) -> None:
    engines = await start_engines(redis_url, deployment, 4, CACHED)
    gw = None
    try:
        gw = await start_gateway(redis_url, deployment)
        await await_until(lambda: len(gw.live_engines()) == 4)
        url = f"http://127.0.0.1:{gw.ports[0]}/v1/completions"
        planned = [  # two sessions of two turns, no shared system prompt
            Planned(0.0, 300, 6, "alice"),
            Planned(0.0, 260, 5, "bob"),
            Planned(1.0, 420, 4, "alice"),
            Planned(1.0, 390, 3, "bob"),
        ]
        session_prompts(planned, seed=1)
        served: list[str] = []
        async with aiohttp.ClientSession() as session:
            for p in planned:  # one at a time: a turn is sent once the previous one ended
                body = {"model": MODEL, "prompt": p.text, "max_tokens": p.output_tokens,
                        "ignore_eos": True, "user": p.key}  # fmt: skip
                async with session.post(url, data=orjson.dumps(body)) as r:
                    assert r.status == 200, await r.text()
                    got = orjson.loads(await r.read())
                    served.append(r.headers[ENGINE_HEADER])
                assert got["choices"][0]["text"] == output_text(p.output_tokens)
                assert got["usage"]["prompt_tokens"] == p.prompt_tokens
        by_id = {e.engine_id: e for e in engines}
        want: dict[str, int] = {}
        for first, second in ((0, 2), (1, 3)):
            assert served[second] == served[first], served  # the key kept its engine
            a, b = planned[first], planned[second]
            assert a.text is not None and b.text is not None
            shared = _common(a.text + output_text(a.output_tokens), b.text)
            assert shared >= len(a.text)  # the history is the prefix
            eid = served[second]
            want[eid] = want.get(eid, 0) + shared // (CHARS_PER_TOKEN * BLOCK_TOKENS) * 16
        for e in engines:  # first turns share nothing: only the second turns hit
            m = e.model
            assert m.cached_tokens_seen == want.get(e.engine_id, 0), (e.engine_id, want)
        total = sum(p.prompt_tokens for p in planned)
        assert sum(e.model.prompt_tokens_seen for e in engines) == total
        async with aiohttp.ClientSession() as session:
            eid = served[2]
            async with session.get(by_id[eid].url + "/sim/state") as r:
                state = orjson.loads(await r.read())
            assert state["cached_tokens"] == want[eid] > 0
            async with session.get(by_id[eid].url + "/metrics") as r:
                text = await r.text()
            assert f'vllm:prefix_cache_hits_total{{engine="{eid}",model_name="{MODEL}"}} ' \
                f"{float(want[eid])}" in text, text  # fmt: skip
    finally:
        if gw is not None:
            await stop_gateway(gw)
        for e in engines:
            await e.stop()
