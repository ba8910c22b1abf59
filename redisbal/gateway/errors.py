"""The gateway's error answers: OpenAI-style JSON (``{"error": {"message", "type",
"code"}}``), which OpenAI clients parse, for the gateway's own errors and for aiohttp's
404 and 405."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

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


@web.middleware
async def unserved_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (a path or method the gateway does not serve) as error
    JSON like the gateway's other errors."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return json_error(
            405, f"{request.method} is not served on {request.path[:200]}: use {allowed}",
            Allow=allowed,
        )  # fmt: skip
    except web.HTTPNotFound:
        return json_error(404, f"no such path: {request.path[:200]} (served: {', '.join(SERVED)})")
    except web.HTTPException as exc:  # aiohttp's other errors (413 and the like)
        if exc.status < 400:
            raise
        return json_error(exc.status, exc.reason)
