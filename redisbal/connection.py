"""Redis clients from one URL: redis://, rediss://, unix://, Sentinel and Cluster.

``redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[?db=0]``
asks the sentinels for the primary of ``service_name`` (and follows failovers);
``redis+cluster://[user:pass@]host:port[,host:port...]`` speaks Redis Cluster.
``rediss+sentinel://`` and ``rediss+cluster://`` use TLS to the data nodes;
``rediss+sentinel://`` also speaks TLS to the sentinels, with the same options,
unless the query says ``sentinel_tls=no`` (sentinels on plain TCP, data nodes on
TLS). TLS options (ssl_ca_certs=..., ssl_certfile=..., ssl_keyfile=...,
ssl_cert_reqs=none) go in the query string as with redis-py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

import redis.exceptions

# A Redis outage as a client sees it: unreachable, connection lost, a call timed out,
# or a cluster in the middle of a failover or a slot migration (CLUSTERDOWN, TRYAGAIN,
# redirections that ran out of tries). Every component treats these alike (retry, route
# on local state, report degraded), unlike a refusal (ResponseError), which is a bug or
# a permission to report.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterError,
    OSError,
)

DEFAULT_URL_ENV = "REDISBAL_REDIS_URL"
_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
)


class BadRedisURL(ValueError):
    """A Redis URL that redisbal cannot use."""


_USERINFO_SECRET = re.compile(r"(//[^:/@\s]*:)[^@\s]*@")
_BARE_USERINFO_SECRET = re.compile(r"^([^:/@\s]*:)[^@\s/]*@")  # "user:pw@host" (no scheme)
_QUERY_SECRET = re.compile(r"((?:password|sentinel_password)=)[^&;#\s]*", re.IGNORECASE)


def redact(url: str) -> str:
    """The text with every URL password replaced by ``***`` (for logs and errors):
    ``user:password@`` userinfo and ``password=`` / ``sentinel_password=`` query
    options. Works on any text that may contain URLs (exception messages too)."""
    text = _BARE_USERINFO_SECRET.sub(r"\1***@", _USERINFO_SECRET.sub(r"\1***@", url))
    return _QUERY_SECRET.sub(r"\1***", text)


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL: what to connect to and how."""

    url: str
    kind: str  # "single", "sentinel" or "cluster"
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    username: str | None = None
    password: str | None = None
    db: int = 0
    tls: bool = False
    options: dict[str, str] = field(default_factory=dict)

    @property
    def safe_url(self) -> str:
        return redact(self.url)


def parse_url(url: str) -> RedisTarget:
    """Parse and check a Redis URL; raise BadRedisURL with a hint when it is wrong."""
    if not isinstance(url, str) or "://" not in url:
        raise BadRedisURL(
            f"not a Redis URL: {redact(str(url))!r}; expected e.g. redis://localhost:6379/0, "
            "unix:///path/redis.sock, redis+sentinel://h:26379/mymaster or redis+cluster://h:7000"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise BadRedisURL(f"unsupported scheme {scheme!r}; use one of {', '.join(_SCHEMES)}")
    if scheme in ("redis", "rediss", "unix"):
        from redis.connection import parse_url as redis_parse_url

        try:  # a bad port or db would otherwise fail later, as a raw ValueError
            redis_parse_url(url)
        except ValueError as exc:
            detail = str(exc)
            if "@" in url.split("://", 1)[1]:
                # an unencoded "/" or "@" in the password moves part of it into the host
                # or port, and the parser's message quotes those: never echo it
                detail = "bad host, port or db (percent-encode / @ : in a password)"
            raise BadRedisURL(f"bad Redis URL {redact(url)!r}: {detail}") from None
        return RedisTarget(url=url, kind="single", tls=scheme == "rediss")
    base, kind = scheme.split("+")
    rest = url.split("://", 1)[1]
    userinfo, _, hostpart = rest.rpartition("@")
    hostpart, _, query = hostpart.partition("?")
    hostlist, _, path = hostpart.partition("/")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    hosts = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise BadRedisURL(f"bad host:port {item!r} in {redact(url)!r}")
        hosts.append((host.strip("[]"), int(port)))
    opts = {k: v[-1] for k, v in parse_qs(query).items()}
    db_text = opts.pop("db", "0") or "0"
    if not db_text.isdigit():
        raise BadRedisURL(f"bad db {db_text!r} in {redact(url)!r}: a whole number")
    db = int(db_text)
    service = path.strip("/")
    if kind == "sentinel" and not service:
        raise BadRedisURL(f"{redact(url)!r} names no service: add /<service_name>")
    return RedisTarget(
        url=url,
        kind=kind,
        hosts=tuple(hosts),
        service=service,
        username=username,
        password=password,
        db=db,
        tls=base == "rediss",
        options=opts,
    )


def default_url() -> str | None:
    return os.environ.get(DEFAULT_URL_ENV) or None


def _tls_kwargs(t: RedisTarget) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if t.tls:
        kw["ssl"] = True
        for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
            if k in t.options:
                kw[k] = t.options[k]
    return kw


def _sentinel_tls(t: RedisTarget) -> bool:
    """Whether connections to the sentinels use TLS (``rediss+sentinel://``, unless
    ``sentinel_tls=no``)."""
    flag = t.options.get("sentinel_tls", "yes").lower()
    if flag not in ("yes", "no", "1", "0", "true", "false"):
        raise BadRedisURL(f"bad sentinel_tls {flag!r} in {t.safe_url!r}: yes or no")
    return t.tls and flag in ("yes", "1", "true")


def make_client(url: str, *, asyncio: bool = False, **kw: Any) -> Any:
    """A redis-py client (sync or asyncio) for any supported URL."""
    t = parse_url(url)
    if asyncio:
        import redis.asyncio as r
        from redis.asyncio.cluster import RedisCluster
        from redis.asyncio.sentinel import Sentinel
    else:
        import redis as r  # type: ignore[no-redef]
        from redis.cluster import RedisCluster  # type: ignore[assignment]
        from redis.sentinel import Sentinel  # type: ignore[assignment]
    if t.kind == "single":
        return r.Redis.from_url(url, **kw)
    auth: dict[str, Any] = {"username": t.username, "password": t.password}
    if t.kind == "cluster":
        from redis.cluster import ClusterNode

        if asyncio:
            from redis.asyncio.cluster import ClusterNode as AClusterNode

            nodes: list[Any] = [AClusterNode(h, p) for h, p in t.hosts]
        else:
            nodes = [ClusterNode(h, p) for h, p in t.hosts]
        client = RedisCluster(startup_nodes=nodes, **auth, **_tls_kwargs(t), **kw)
        client.commands_parser = _cluster_commands(client, asyncio)
        return client
    # connections to the sentinels themselves: their own (optional) credentials, and
    # the same socket timeouts as the data connections, so a dead sentinel is skipped
    sentinel_kw: dict[str, Any] = {
        k[len("sentinel_") :]: v
        for k, v in t.options.items()
        if k in ("sentinel_username", "sentinel_password")
    }
    if _sentinel_tls(t):
        sentinel_kw.update(_tls_kwargs(t))
    sentinel_kw["socket_timeout"] = kw.get("socket_timeout", 2.0)
    if "socket_connect_timeout" in kw:
        sentinel_kw["socket_connect_timeout"] = kw["socket_connect_timeout"]
    sentinel = Sentinel(
        list(t.hosts),
        sentinel_kwargs=sentinel_kw,
        socket_timeout=kw.get("socket_timeout", 2.0),
    )
    return sentinel.master_for(t.service, db=t.db, **auth, **_tls_kwargs(t), **kw)


def _fcall_keys(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The keys of an FCALL / FCALL_RO (``FCALL fn numkeys key... arg...``), read from
    the arguments as redis-py does for EVALSHA; None for any other command."""
    if len(args) >= 3 and str(args[0]).upper() in ("FCALL", "FCALL_RO"):
        return tuple(args[3 : 3 + int(args[2])])
    return None


def _cluster_commands(client: Any, asyncio: bool) -> Any:
    """A command parser for a cluster client that needs no node but the one a call goes to.

    redis-py finds the slot of an FCALL by sending ``COMMAND GETKEYS`` to its default
    node (the first primary of the slot map), and its asyncio client fetches
    ``COMMAND`` from that node again at every re-initialization (after a connection
    error, CLUSTERDOWN or many MOVEDs). When that primary dies, every deployment's
    reports and snapshots failed, and the routers that re-initialized went degraded,
    until the replica was promoted: one shard's failover stopped them all. Here FCALL
    keys are read from the arguments, and the table is fetched once, from any node
    that answers (it is the same on every node)."""
    try:
        from redis._parsers.commands import AsyncCommandsParser, CommandsParser
    except ImportError:  # a redis-py without this module: its own parser, as it is
        return client.commands_parser

    if not asyncio:

        class SyncParser(CommandsParser):
            def get_keys(self, redis_conn: Any, *args: Any) -> Any:
                keys = _fcall_keys(args)
                return super().get_keys(redis_conn, *args) if keys is None else keys

        parser = SyncParser.__new__(SyncParser)  # keeps the table redis-py fetched
        vars(parser).update(vars(client.commands_parser))
        return parser

    class AsyncParser(AsyncCommandsParser):
        async def get_keys(self, *args: Any) -> Any:
            keys = _fcall_keys(args)
            return await super().get_keys(*args) if keys is None else keys

        async def initialize(self, node: Any = None) -> None:
            if node is not None:
                self.node = node  # where COMMAND GETKEYS goes: the current default node
                if self.commands:
                    return
            first = getattr(self, "node", None)
            nodes = [n for n in client.nodes_manager.nodes_cache.values() if n is not first]
            error: Exception | None = None
            for candidate in [first, *nodes] if first is not None else nodes:
                try:
                    return await super().initialize(candidate)
                except OUTAGE_ERRORS as exc:
                    error = exc
            if error is not None:
                raise error

    return AsyncParser()


def is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster as ARC
    from redis.cluster import RedisCluster as SRC

    return isinstance(client, SRC | ARC)


def refresh_slots(client: Any) -> Any:
    """Ask a Redis Cluster for its slot map again; None for another client, and an
    awaitable for an asyncio one. redis-py refreshes the map by itself after a
    failed call, but a client whose calls keep failing on a dead primary after a
    failover was seen to keep the stale map under load; callers use this after an
    outage so that the next call goes to the promoted replica."""
    if not is_cluster(client):
        return None
    return client.nodes_manager.initialize()
