"""redisbal.bench.bare_proxy, the gateway overhead benchmark's floor: a streamed and a
whole completion pass through it unchanged from a real HTTP engine to the openai client."""

from __future__ import annotations

import openai
from aiohttp import web
from support.gateway_stack import MODEL, settled, stack

from redisbal.bench.bare_proxy import make_app


async def test_streamed_and_whole_answers_pass_through(redis_url: str, deployment: str) -> None:
    async with stack(redis_url, deployment, n=1) as st:
        runner = web.AppRunner(make_app(f"http://127.0.0.1:{st.engines[0].port}"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
        )
        try:
            stream = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=5, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            texts = [c.choices[0].text async for c in stream if c.choices]
            whole = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=3, extra_body={"ignore_eos": True}
            )
        finally:
            await client.close()
            await runner.cleanup()
        await settled(st)
    assert len(texts) == 5
    assert whole.usage is not None and whole.usage.completion_tokens == 3
