#!/usr/bin/env python3
"""A gateway whose router runs one of the benchmark's peer policies
(redisbal.bench.peer_policies: p2c, sglang-cache-aware, llmd, chbl), for
scripts/gateway_policies.py: ``redisbal gateway --policy`` takes only the names in
redisbal.routing.policies.POLICIES, while ``AsyncRouter`` takes any Policy object.

The prefix-aware peers route by a prompt's block hashes, which the gateway does not
tell its router; this process (only) wraps the gateway's ``request_hints`` and the
router's ``route`` so that each route also gets the blocks of its prompt text as the
HTTP engines hash them (``text_blocks``). Redis URL and deployment come from the
environment (REDISBAL_REDIS_URL, REDISBAL_DEPLOYMENT), as for every redisbal command.

    python scripts/peer_gateway.py --policy llmd --kv-blocks 1024 --port 0
"""

from __future__ import annotations

import argparse
import contextvars
import inspect
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from redisbal.bench.peer_policies import PEER_POLICIES, make_peer
from redisbal.bench.quality import VARIANTS
from redisbal.gateway import cli, proxy
from redisbal.routing.policies import Policy, RedisbalPolicy
from redisbal.routing.router import AsyncRouter
from redisbal.sim.http_engine import _prompt_text
from redisbal.sim.prefix_cache import text_blocks

_BLOCKS: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("blocks", default=())
_hints = proxy.request_hints
_route = AsyncRouter.route


def _hints_with_blocks(
    body: Mapping[str, Any], key_header: str | None, user_key: bool = True
) -> tuple[str | None, int]:
    got = _hints(body, key_header, user_key)
    _BLOCKS.set(text_blocks(_prompt_text(dict(body), "messages" in body)))  # this request's task
    return got


def _route_with_blocks(self: AsyncRouter, engine_id: str | None = None, **kw: Any) -> Any:
    if kw.get("blocks") is None and engine_id is None:
        kw["blocks"] = _BLOCKS.get() or None
    return _route(self, engine_id, **kw)


def _policy(name: str, kv_blocks: int | None) -> Policy:
    """A peer emulation, or the default policy with one option flipped (bench's VARIANTS)."""
    if name in VARIANTS:
        policy = RedisbalPolicy()
        for option, value in VARIANTS[name].items():
            setattr(policy, option, value)
        return policy
    return make_peer(name, kv_blocks=kv_blocks)


# what this script sets itself of the gateway's options; the rest take the gateway
# command's own defaults (serve_kwargs), so that a new option cannot break this script
SET_HERE = frozenset(
    [
        "engines",
        "models",
        "client_index",
        "client_count",
        "lease_ttl_s",
        "policy",
        "timeout_s",
        "connect_timeout_s",
        "max_body_bytes",
        "drain_s",
        "refresh_s",
        "wait_s",
        "host",
        "port",
    ]
)


def serve_kwargs(**given: Any) -> dict[str, Any]:
    """``cli._serve``'s keywords: ``given`` over the gateway command's defaults."""
    defaults = {p.name: p.default for p in cli.gateway.params if p.name}
    params = inspect.signature(cli._serve).parameters.values()
    keywords = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in SET_HERE]
    kw = {k: defaults[k] for k in keywords if k in defaults}
    return {**kw, **given}


def _prefix_blocks(spec: str) -> Any:
    """The gateway's ``--prefix-tokens`` hasher, at its default ``--prefix-max-tokens``."""
    defaults = {p.name: p.default for p in cli.gateway.params}
    return cli._prefix_blocks(spec, defaults["prefix_max_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", required=True, choices=sorted(PEER_POLICIES) + sorted(VARIANTS))
    ap.add_argument("--kv-blocks", type=int, default=None, help="an engine's KV in 16-token blocks")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--lease-ttl-s", type=float, default=10.0)
    ap.add_argument("--refresh-s", type=float, default=1.0)
    ap.add_argument("--prefix-tokens", default=None, help="as the gateway's (cache views)")
    a = ap.parse_args()
    url = os.environ.get("REDISBAL_REDIS_URL")
    if not url:
        sys.exit("peer_gateway: set REDISBAL_REDIS_URL")
    logging.basicConfig(level=os.environ.get("REDISBAL_LOG_LEVEL", "warning").upper())
    proxy.request_hints = _hints_with_blocks  # type: ignore[assignment]
    AsyncRouter.route = _route_with_blocks  # type: ignore[method-assign]
    ok = cli.run_loop(
        cli._serve(
            url,
            os.environ.get("REDISBAL_DEPLOYMENT", "default"),
            **serve_kwargs(
                host=a.host,
                port=a.port,
                engines={},
                models={},
                client_index="auto",
                client_count=1,
                lease_ttl_s=a.lease_ttl_s,
                policy=_policy(a.policy, a.kv_blocks),
                timeout_s=600.0,
                connect_timeout_s=2.0,
                max_body_bytes=4 << 20,
                drain_s=5.0,  # below the demo's 10 s before SIGKILL
                refresh_s=a.refresh_s,
                wait_s=5.0,
                **({"prefix_blocks": _prefix_blocks(a.prefix_tokens)} if a.prefix_tokens else {}),
            ),
        )
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
