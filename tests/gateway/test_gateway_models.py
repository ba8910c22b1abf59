"""Several deployments behind one gateway: each request's ``model`` picks its
deployment, whose own router, URLs and engines serve it. Real HTTP engines (in the
test's loop, the same engine ids in both deployments at different URLs) reporting
into a real redis-server, the official ``openai`` client, and ``redisbal gateway
--model`` as a process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from support.cli import run_cli
from support.gateway_stack import FAST, gateway_process, openai_client
from support.helpers import await_until

from redisbal.connection import make_client
from redisbal.gateway.deployments import Deployment
from redisbal.gateway.proxy import ENGINE_HEADER
from redisbal.gateway.server import Gateway
from redisbal.routing.router import AsyncRouter
from redisbal.sim.http_engine import HttpEngine

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too
UNREACHABLE = "redis://127.0.0.1:1/0"


async def _deployment(redis_url: str, name: str) -> Deployment:
    router = AsyncRouter(redis_url, name, "auto", lease_ttl_s=10.0)
    await router.start(wait=3.0 if redis_url != UNREACHABLE else 0.0)
    return Deployment(router, redis_client=make_client(redis_url, asyncio=True))


@contextlib.asynccontextmanager
async def engines(redis_url: str, deployment: str, model: str, n: int = 2) -> AsyncIterator[Any]:
    es = [
        HttpEngine(str(i), redis_url=redis_url, deployment=deployment, port=0, params=FAST,
                   model_name=model)
        for i in range(n)
    ]  # fmt: skip
    for e in es:
        await e.start()
    try:
        yield es
    finally:
        for e in es:
            await e.stop()


@contextlib.asynccontextmanager
async def models_gateway(
    redis_url: str, models: dict[str, tuple[str, str]], **kw: Any
) -> AsyncIterator[Gateway]:
    """``models``: model name -> (Redis URL, deployment) (one Deployment per name)."""
    deps: dict[str, Deployment] = {}
    by_model = {}
    for model, (url, name) in models.items():
        if name not in deps:
            deps[name] = await _deployment(url, name)
        by_model[model] = deps[name]
    gw = Gateway(models=by_model, **kw)
    await gw.start("127.0.0.1", 0)
    try:
        yield gw
    finally:
        await gw.close()
        for d in deps.values():
            await d.router.aclose()
            await d.redis.aclose()


def _arrived(es: list[HttpEngine]) -> list[int]:
    return [e.arrived for e in es]


async def test_each_model_goes_to_its_own_deployment_and_unknown_models_get_404(
    redis_url: str, deployment: str
) -> None:
    da, db = deployment + "a", deployment + "b"
    async with engines(redis_url, da, "alpha") as ea, engines(redis_url, db, "beta") as eb:
        mapping = {"alpha": (redis_url, da), "beta": (redis_url, db), "beta-alias": (redis_url, db)}
        async with models_gateway(redis_url, mapping) as gw:
            deps = gw.models.deployments
            await await_until(lambda: all(len(d.live_engines()) == 2 for d in deps))
            base = f"http://127.0.0.1:{gw.ports[0]}"
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            try:
                for _ in range(6):
                    c = await client.completions.create(model="alpha", prompt="hi", max_tokens=2)
                    assert c.model == "alpha"  # an alpha engine answered (they check the name)
                assert sum(_arrived(ea)) == 6 and _arrived(eb) == [0, 0]
                for _ in range(4):
                    ch = await client.chat.completions.create(
                        model="beta", messages=[{"role": "user", "content": "x"}], max_tokens=2
                    )
                    assert ch.model == "beta"
                assert sum(_arrived(ea)) == 6 and sum(_arrived(eb)) == 4

                # /v1/models: every configured model, as the engines list theirs when they do
                listed = await client.models.list()
                assert [m.id for m in listed.data] == ["alpha", "beta", "beta-alias"]

                # an unknown model: OpenAI's 404, nothing routed
                with pytest.raises(openai.NotFoundError) as err:
                    await client.completions.create(model="gamma", prompt="hi", max_tokens=2)
                assert err.value.code == "model_not_found"
            finally:
                await client.close()
            async with aiohttp.ClientSession() as s:
                body = {"model": "gamma", "prompt": "hi", "max_tokens": 2}
                async with s.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 404
                    assert await r.json() == {
                        "error": {
                            "message": "The model `gamma` does not exist.",
                            "type": "invalid_request_error",
                            "param": "model",
                            "code": "model_not_found",
                        }
                    }
                async with s.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
                    err_body = await r.json()
                    assert r.status == 400 and err_body["error"]["param"] == "model", err_body
                assert sum(_arrived(ea)) == 6 and sum(_arrived(eb)) == 4

                # a pin applies within the request's deployment: engine "1" of beta's
                before = _arrived(ea) + _arrived(eb)
                body = {"model": "beta", "prompt": "hi", "max_tokens": 2}
                async with s.post(
                    base + "/v1/completions", json=body, headers={ENGINE_HEADER: "1"}
                ) as r:
                    assert r.status == 200 and r.headers[ENGINE_HEADER] == "1"
                after = _arrived(ea) + _arrived(eb)
                assert [b - a for a, b in zip(before, after, strict=True)] == [0, 0, 0, 1]

                async with s.get(base + "/health") as r:
                    h = await r.json()
                    assert r.status == 200 and h["ready"], h
                    assert h["models"] == {"alpha": da, "beta": db, "beta-alias": db}
                    assert sorted(h["deployments"][da]["engines"]) == ["0", "1"]
                async with s.get(base + "/metrics") as r:
                    text = await r.text()
                    # engine ids repeat across deployments: named with theirs
                    assert f'redisbal_gateway_decisions_total{{engine="{db}/1"}}' in text
                    assert f'redisbal_gateway_client_index{{deployment="{da}"}}' in text


async def test_a_deployment_without_engines_or_redis_leaves_the_others_served(
    redis_url: str, deployment: str
) -> None:
    da, db, dc = deployment + "a", deployment + "b", deployment + "c"
    async with engines(redis_url, da, "alpha") as ea:
        async with engines(redis_url, db, "beta") as eb:
            mapping = {
                "alpha": (redis_url, da),
                "beta": (redis_url, db),
                "gamma": (UNREACHABLE, dc),  # its Redis is not there at all
            }
            gw_cm = models_gateway(redis_url, mapping)
            gw = await gw_cm.__aenter__()
        try:
            # beta's engines are stopped now
            dep_a, dep_b = gw.models.by_model["alpha"], gw.models.by_model["beta"]  # type: ignore[index]
            await await_until(lambda: len(dep_a.live_engines()) == 2)
            await await_until(lambda: not dep_b.live_engines())
            base = f"http://127.0.0.1:{gw.ports[0]}"
            async with aiohttp.ClientSession() as s:
                for model in ("alpha", "beta", "gamma", "alpha"):
                    body = {"model": model, "prompt": "hi", "max_tokens": 2}
                    async with s.post(base + "/v1/completions", json=body) as r:
                        answer = await r.json()
                        if model == "alpha":
                            assert r.status == 200 and answer["model"] == "alpha", answer
                        else:
                            assert r.status == 503, answer
                            assert answer["error"]["type"] == "unavailable"
                assert sum(_arrived(ea)) == 2 and sum(_arrived(eb)) == 0
                # /health: ready while any deployment can route; each one's state
                async with s.get(base + "/health") as r:
                    h = await r.json()
                    assert r.status == 200 and h["ready"], h
                    assert [h["deployments"][d]["ready"] for d in (da, db, dc)] == [
                        True, False, False,
                    ]  # fmt: skip
                    assert h["deployments"][dc]["degraded"]
                async with s.get(base + "/v1/models") as r:
                    assert r.status == 200
                    ids = [m["id"] for m in (await r.json())["data"]]
                    assert ids == ["alpha", "beta", "gamma"]
        finally:
            await gw_cm.__aexit__(None, None, None)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("alpha", "'alpha' is not NAME=DEPLOYMENT"),
        ("alpha=bad{name}", "invalid deployment name 'bad{name}'"),
        ("=dep", "'=dep' is not NAME=DEPLOYMENT"),
        ("al pha=dep", "no spaces or control characters"),
    ],
)
def test_a_bad_model_option_is_a_one_line_usage_error(
    redis_url: str, value: str, said: str
) -> None:
    out = run_cli("gateway", "--redis-url", redis_url, "--model", value)
    assert out.returncode == 2, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: Invalid value for '--model'") and said in last, out.stderr


def test_model_twice_or_with_engine_is_a_usage_error(redis_url: str) -> None:
    out = run_cli("gateway", "--redis-url", redis_url, env={"REDISBAL_MODELS": "a=d1,a=d2"})
    assert out.returncode == 2 and "model 'a' is given twice" in out.stderr, out.stderr
    out = run_cli(
        "gateway", "--redis-url", redis_url, "--model", "a=d1", "--engine", "0=http://127.0.0.1:9"
    )
    assert out.returncode == 2 and "--engine is for one deployment" in out.stderr, out.stderr


async def test_gateway_command_with_models_from_the_env_routes_by_model(
    redis_url: str, deployment: str
) -> None:
    da, db = deployment + "a", deployment + "b"
    async with engines(redis_url, da, "alpha") as ea, engines(redis_url, db, "beta") as eb:
        models = {"REDISBAL_MODELS": f"alpha={da},beta={db}"}
        async with gateway_process(redis_url, None, env=models) as (g, url, lines):
            assert f"models alpha ({da}: 2 engines), beta ({db}: 2 engines)" in lines[-1], lines
            client = openai_client(url)
            try:
                for model in ("alpha", "beta", "beta", "alpha", "alpha"):
                    c = await client.completions.create(model=model, prompt="hi", max_tokens=2)
                    assert c.model == model
                assert [m.id for m in (await client.models.list()).data] == ["alpha", "beta"]
            finally:
                await client.close()
            assert sum(_arrived(ea)) == 3 and sum(_arrived(eb)) == 2
            g.terminate()
            assert g.wait(30) == 0
