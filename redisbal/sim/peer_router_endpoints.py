"""What real engines serve to peer routers, in their formats, for the simulated HTTP
engines.

The real routers (vllm-router, sglang-router) call more than the OpenAI API on
their workers; without these a router runs below strength (its prefix-aware path
falls back, or its load is unknown). What the pinned routers were seen to call
(their logs and /metrics, against engine-sim):

- vLLM's ``POST /tokenize`` (``{"count", "max_model_len", "tokens",
  "token_strs"}``), ``POST /v1/completions/render`` (a list with one rendered
  prompt per prompt: ``{"request_id", "token_ids", "sampling_params", "model"}``)
  and ``POST /v1/chat/completions/render`` (one such object): vllm-router's
  cache_aware policy renders each request on a worker and routes by its tokens.
- SGLang's ``GET /get_load`` (a list, one entry per data-parallel rank:
  ``{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}``), which
  sglang-router's power_of_two polls; ``GET /server_info`` and ``/model_info``
  (and their older names ``/get_server_info``, ``/get_model_info``), from which it
  registers the worker's model.
- SGLang's ``GET /v1/loads`` (``{"loads": [...]}``, one entry per data-parallel rank
  with ``dp_rank``, ``num_running_reqs``, ``num_waiting_reqs``, ``max_running_requests``
  and ``token_usage``), from which ``redisbal scrape`` takes the running cap: served
  by engines that report as SGLang (``--report-as sglang``) only, since vLLM has none.

Tokens: the engines count 4 characters a token (redisbal.sim.prefix_cache), so a
text's token ids are one id per 4-character chunk, a hash of the chunk: the same
text gives the same ids, and two prompts that share a prefix share the ids of
it, as with a real tokenizer. vllm-router reads no ``/get_load`` from a real vLLM
(which serves none), and none here is in its format either.
"""

from __future__ import annotations

import functools
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from redisbal.routing.cache_view import sim_token_ids
from redisbal.sim.model import SimEngine
from redisbal.sim.report_as import Feed


class HttpEngine(Protocol):
    """What these routes read of an HTTP engine (redisbal.sim.http_engine.HttpEngine)."""

    model: SimEngine
    model_name: str
    feed: Feed  # what it reports and serves (redisbal.sim.report_as)


Handler = Callable[[web.Request], Awaitable[web.Response]]
MAX_MODEL_LEN = 131072  # what /tokenize and /server_info report as the context length


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _bad(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    return _json(body | {"object": "error"}, 400)


def _chat_text(messages: list[Any]) -> str:
    """The chat prompt as the engines read it: the messages' contents in order."""
    return "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))


async def _body(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _bad(f"malformed JSON: {exc}")
    if not isinstance(body, dict):
        return _bad("the body must be a JSON object")
    return body


def _check_model(engine: HttpEngine, body: dict[str, Any]) -> web.Response | None:
    model = body.get("model")
    if model is not None and model != engine.model_name:
        msg = f"The model `{model}` does not exist."
        return _json({"error": {"message": msg, "type": "NotFoundError", "code": 404}}, 404)
    return None


def _prompts(body: dict[str, Any]) -> list[str] | None:
    """A completions request's prompts: one string, or a list of strings."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)
    return None


@functools.lru_cache(maxsize=32)
def token_ids(text: str) -> tuple[int, ...]:
    """engine-sim's token ids of ``text``, kept for the last few texts: vllm-router's
    kv_aware renders each request on every worker at once, and the engines of one
    engine-sim process would each tokenize the same text again on one event loop (real
    engines tokenize apart, in parallel), making the simulator the bottleneck."""
    return tuple(sim_token_ids(text))


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters a rendered request carries (the ones the engines use)."""
    return {
        "max_tokens": body.get("max_tokens"),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "temperature": body.get("temperature", 1.0),
    }


def _rendered(engine: HttpEngine, body: dict[str, Any], text: str, kind: str) -> dict[str, Any]:
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex[:16]}",
        "token_ids": token_ids(text),
        "features": None,
        "sampling_params": _sampling(body),
        "model": engine.model_name,
    }


PEER_CALLS = web.AppKey("peer_calls", Counter)


def sglang_metrics(engine: HttpEngine) -> web.Response:
    """The engine's counts as SGLang's /metrics page shows them (one ``dp_rank``), for
    engines that report as SGLang (``--report-as sglang``): what ``redisbal scrape``
    reads there, next to the cap it takes from ``/v1/loads``."""
    m = engine.model
    labels = f'model_name="{engine.model_name}",dp_rank="0"'
    out = []
    for name, kind, value in (
        ("num_running_reqs", "gauge", len(m.running)),
        ("num_queue_reqs", "gauge", len(m.waiting) + len(m.inbox)),
        ("token_usage", "gauge", m.kv_usage or 0.0),
        ("generation_tokens_total", "counter", m.tokens),
        ("num_requests_total", "counter", m.finished),  # (an aborted one never finished)
    ):
        family = name.removesuffix("_total")
        out += [f"# TYPE sglang:{family} {kind}", f"sglang:{name}{{{labels}}} {float(value)}"]
    return web.Response(text="\n".join(out) + "\n", content_type="text/plain")


def add_peer_routes(app: web.Application, engine: HttpEngine) -> None:
    """Serve the routes above on ``app`` for ``engine``, and ``GET /sim/peer_calls``: how
    many calls each of them answered (``{path: n}``; what a benchmark reads to tell that
    a router's prefix- or load-aware path asked the engines at all)."""
    calls: Counter[str] = Counter()
    app[PEER_CALLS] = calls

    def counted(path: str, handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.Response:
            calls[path] += 1
            return await handler(request)

        return run

    async def tokenize(request: web.Request) -> web.Response:
        body = await _body(request)
        if isinstance(body, web.Response):
            return body
        bad = _check_model(engine, body)
        if bad is not None:
            return bad
        if isinstance(body.get("messages"), list):
            text = _chat_text(body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            return _bad("prompt (a string) or messages (a list) is required")
        ids = token_ids(text)
        return _json(
            {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
        )

    async def completions_render(request: web.Request) -> web.Response:
        body = await _body(request)
        if isinstance(body, web.Response):
            return body
        bad = _check_model(engine, body)
        if bad is not None:
            return bad
        prompts = _prompts(body)
        if prompts is None:
            return _bad("prompt: a string or a non-empty list of strings is required")
        return _json([_rendered(engine, body, p, "cmpl") for p in prompts])

    async def chat_render(request: web.Request) -> web.Response:
        body = await _body(request)
        if isinstance(body, web.Response):
            return body
        bad = _check_model(engine, body)
        if bad is not None:
            return bad
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _bad("messages: a non-empty list of messages is required")
        return _json(_rendered(engine, body, _chat_text(body["messages"]), "chatcmpl"))

    async def get_load(request: web.Request) -> web.Response:
        m = engine.model
        waiting = len(m.waiting) + len(m.inbox)
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": waiting + len(m.running),
                    "num_waiting_reqs": waiting,
                    "num_tokens": m.kv_tokens,
                }
            ]
        )

    async def loads(request: web.Request) -> web.Response:
        m = engine.model
        return _json(
            {
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": len(m.running),
                        "num_waiting_reqs": len(m.waiting) + len(m.inbox),
                        "num_used_tokens": m.kv_tokens,
                        "max_total_num_tokens": m.params.kv_capacity_tokens,
                        "token_usage": m.kv_usage or 0.0,
                        "max_running_requests": m.params.running_cap,
                    }
                ]
            }
        )

    async def server_info(request: web.Request) -> web.Response:
        return _json(
            {
                "served_model_name": engine.model_name,
                "tokenizer_path": None,
                "context_length": MAX_MODEL_LEN,
                "tp_size": 1,
                "dp_size": 1,
                "disaggregation_mode": "null",
                "max_running_requests": engine.model.params.running_cap,
                "page_size": 16,
                "version": "redisbal-sim",
            }
        )

    async def model_info(request: web.Request) -> web.Response:
        return _json(
            {
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "redisbal-sim",
                "architectures": None,
            }
        )

    async def peer_calls(request: web.Request) -> web.Response:
        return _json(dict(calls))

    app.router.add_get("/sim/peer_calls", peer_calls)
    for path, handler in (
        ("/tokenize", tokenize),
        ("/v1/completions/render", completions_render),
        ("/v1/chat/completions/render", chat_render),
    ):
        app.router.add_post(path, counted(path, handler))
    for path, handler in (
        ("/get_load", get_load),
        ("/server_info", server_info),
        ("/get_server_info", server_info),
        ("/model_info", model_info),
        ("/get_model_info", model_info),
        *([("/v1/loads", loads)] if engine.feed.serves_loads else []),
    ):
        app.router.add_get(path, counted(path, handler))
