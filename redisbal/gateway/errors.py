"""The gateway's error answers: OpenAI-style JSON (``{"error": {"message", "type",
"code"}}``), which OpenAI clients parse, for every error the gateway answers, paths and
methods it does not serve included."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

# the paths the gateway serves, named in the 404's message
SERVED = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def json_error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | int | None = None,
    param: str | None = None,
    **headers: str,
) -> web.Response:
    """``code``: the HTTP status unless given (OpenAI's names: ``invalid_api_key``,
    ``model_not_found``); ``param``: the request field at fault, when one is."""
    error: dict[str, Any] = {"message": message, "type": kind}
    if param is not None:
        error["param"] = param
    error["code"] = status if code is None else code
    body = {"error": error}
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )


async def unserved(request: web.Request) -> web.Response:
    """The app's last route, matching every path and method the others do not: a 404,
    or a 405 naming the methods served on the path, as error JSON like the gateway's
    other errors. A route rather than a middleware around every request: a middleware
    costs each request served, this only the requests it answers."""
    mine = request.match_info.route.resource
    methods = {
        route.method
        for resource in request.app.router.resources()
        if resource is not mine and resource.canonical == request.path
        for route in resource
    }
    if methods:
        allowed = ", ".join(sorted(methods))
        return json_error(
            405, f"{request.method} is not served on {request.path[:200]}: use {allowed}",
            Allow=allowed,
        )  # fmt: skip
    return json_error(404, f"no such path: {request.path[:200]} (served: {', '.join(SERVED)})")
