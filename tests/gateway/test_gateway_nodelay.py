"""The gateway turns Nagle's algorithm off on both of its sockets of a streamed
request, the client's and the engine's: with it on, a small SSE chunk written right
after another waits for the peer's delayed ACK (40 ms on Linux) before it leaves.
Checked on the real sockets of a live stream, in the test's own process."""

from __future__ import annotations

import os
import socket

import openai
import pytest
from support.gateway_stack import MODEL, settled, stack

pytestmark = pytest.mark.gateway  # .ci/run runs these on the lowest aiohttp too


def _tcp_sockets() -> list[tuple[tuple[str, int], tuple[str, int], int]]:
    """(local address, peer address, TCP_NODELAY) of every connected TCP socket of
    this process."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                continue
            try:
                peer = s.getpeername()
            except OSError:  # a listening socket
                continue
            out.append(
                (s.getsockname(), peer, s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            )
    return out


async def test_both_sockets_of_a_streamed_request_have_nodelay(
    redis_url: str, deployment: str
) -> None:
    async with stack(redis_url, deployment, n=1) as st:
        gw_port = st.gateways[0].ports[0]
        engine_port = st.engines[0].port
        client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0)
        try:
            stream = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=40, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            seen = None
            async for _chunk in stream:
                if seen is None:  # mid-stream: both of the gateway's sockets are open
                    seen = _tcp_sockets()
        finally:
            await client.close()
        await settled(st)
    assert seen is not None
    # the gateway's end of the client's connection, and its end of the engine's
    accepted = [nd for local, _, nd in seen if local[1] == gw_port]
    upstream = [
        nd for local, peer, nd in seen if peer[1] == engine_port and local[1] != engine_port
    ]
    assert accepted and upstream, seen
    assert all(accepted) and all(upstream), seen
