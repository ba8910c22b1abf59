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

import functools
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis.exceptions

if TYPE_CHECKING:
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.cluster

from redisbal.errors import BadRedisURL as BadRedisURL
from redisbal.errors import PasswordError as PasswordError
from redisbal.errors import WrongServer as WrongServer

# The clients redisbal takes and makes: one server (plain, TLS, unix socket, Sentinel)
# or a Redis Cluster, blocking or asyncio. Every `client=` parameter is one of these.
RedisClient: TypeAlias = "redis.Redis | redis.cluster.RedisCluster"
AsyncRedisClient: TypeAlias = "redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster"

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


# userinfo: up to the line's last "@", so that a password with a space or an unencoded
# "@" is hidden whole (at worst more than the password is)
_USERINFO_SECRET = re.compile(r"(//[^:/@\n]*:).*@")
_BARE_USERINFO_SECRET = re.compile(r"^([^:/@\s]*:)(?!//).*@")  # "user:pw@host" (no scheme)
# (a query password runs to the next option or the end of the line: one with a space in it
# is hidden whole, and the rest of that line with it)
_QUERY_SECRET = re.compile(r"((?:password|sentinel_password)=)[^&;#\n]*", re.IGNORECASE)


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
            parts = redis_parse_url(url)
        except ValueError as exc:
            detail = str(exc)
            if "@" in url.split("://", 1)[1]:
                # an unencoded "/" or "@" in the password moves part of it into the host
                # or port, and the parser's message quotes those: never echo it
                detail = "bad host, port or db (percent-encode / @ : in a password)"
            raise BadRedisURL(f"bad Redis URL {redact(url)!r}: {detail}") from None
        _check_single(url, scheme, parts)
        return RedisTarget(
            url=url,
            kind="single",
            username=parts.get("username") or None,
            password=parts.get("password") or None,
            tls=scheme == "rediss",
        )
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
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise BadRedisURL(f"bad host:port {item!r} in {redact(url)!r}: a port in 1..65535")
        hosts.append((host.strip("[]"), int(port)))
    opts = {k: v[-1] for k, v in parse_qs(query).items()}
    allowed = _SSL_OPTIONS + (_SENTINEL_OPTIONS if kind == "sentinel" else ()) + ("db",)
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise BadRedisURL(
            f"unknown option {unknown[0]!r} in {redact(url)!r}: a {scheme}:// URL takes "
            f"{', '.join(allowed)}"
        )
    _check_cert_reqs(url, opts.get("ssl_cert_reqs"))
    db_text = opts.pop("db", "0") or "0"
    if not (db_text.isascii() and db_text.isdigit()):
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


_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "sentinel_tls")
_CERT_REQS = ("none", "optional", "required")
_DB_PATH = re.compile(r"/?[0-9]*")


def _check_cert_reqs(url: str, value: object) -> None:
    if value is not None and str(value).lower() not in _CERT_REQS:
        raise BadRedisURL(
            f"bad ssl_cert_reqs {value!r} in {redact(url)!r}: none, optional or required"
        )


def _check_single(url: str, scheme: str, parts: dict[str, Any]) -> None:
    """What redis-py would only find when it connects (or never): a db path that is no
    number (it silently used db 0), a relative unix socket path, an unknown option (a
    TypeError), a bad option value, a timeout that is not positive."""
    rest = url.split("://", 1)[1]
    if scheme == "unix":
        if not str(parts.get("path", "")).startswith("/"):
            raise BadRedisURL(
                f"bad Redis URL {redact(url)!r}: a unix socket needs an absolute path, "
                "e.g. unix:///run/redis/redis.sock"
            )
    elif not _DB_PATH.fullmatch(urlsplit(url).path):
        where = "" if "@" in rest else f" {urlsplit(url).path!r}"
        raise BadRedisURL(
            f"bad Redis URL {redact(url)!r}: the path{where} must be the db number, e.g. /0"
            + (" (percent-encode / @ : in a password)" if "@" in rest else "")
        )
    for name in ("socket_timeout", "socket_connect_timeout"):
        value = parts.get(name)
        if value is not None and not value > 0:
            raise BadRedisURL(f"bad {name} {value!r} in {redact(url)!r}: a number of seconds > 0")
    _check_cert_reqs(url, parts.get("ssl_cert_reqs"))
    from redis.connection import Connection, ConnectionPool

    kw = dict(parts)
    cls = kw.pop("connection_class", Connection)
    for name in inspect.signature(ConnectionPool.__init__).parameters:
        kw.pop(name, None)  # the pool's own (max_connections, ...)
    try:
        cls(**kw)  # builds the connection object: no I/O
    except TypeError as exc:
        m = re.search(r"argument '(\w+)'", str(exc))
        name = m.group(1) if m else "?"
        raise BadRedisURL(f"unknown option {name!r} in {redact(url)!r}") from None
    except redis.exceptions.RedisError as exc:
        raise BadRedisURL(f"bad Redis URL {redact(url)!r}: {redact(str(exc))}") from None


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


# the first byte of a reply that is not RESP, as redis-py's parsers quote it (hiredis,
# then the pure-Python one): "H" starts an HTTP status line, "<" the HTML page that a
# server speaking HTTP/0.9 sends back without one
_REPLY_BYTE = re.compile(r"""got "(.)" as reply type byte|Protocol Error: b['"](.)""", re.S)


# a plain server's answer to SENTINEL (Redis 7 and Valkey quote with ', Redis 6 with `)
_NO_SENTINEL = re.compile(r"unknown command .sentinel.", re.IGNORECASE)


def explain(exc: BaseException, url: str) -> WrongServer | PasswordError | None:
    """The configuration mistake behind a failed connection to ``url``, as one clear
    error (password redacted), or None when there is none to name (an outage, a refusal).
    Looks through the causes too: a cluster client wraps its nodes' errors."""
    e: BaseException | None = exc
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, WrongServer | PasswordError):
            return e
        if isinstance(e, redis.exceptions.InvalidResponse):
            m = _REPLY_BYTE.search(str(e))
            first = (m.group(1) or m.group(2)) if m else ""
            got = "got an HTTP response" if first in ("H", "<") else "got a reply that is not RESP"
            return WrongServer(
                f"{redact(url)} does not speak the Redis protocol ({got}): check the Redis URL"
            )
        if isinstance(e, redis.exceptions.AuthenticationError):
            return _password_error(url, str(e))
        if _NO_SENTINEL.search(str(e)):
            return WrongServer(
                f"{redact(url)} names a server that is not a Sentinel (it does not know the "
                "SENTINEL command): use redis:// for a single server"
            )
        if "cluster support disabled" in str(e).lower():
            return WrongServer(
                f"{redact(url)} is not a Redis Cluster (cluster support is disabled on the "
                "server): use redis:// for a single server"
            )
        e = e.__cause__ or e.__context__
    return None


def _password_error(url: str, reason: str) -> PasswordError:
    try:
        given = parse_url(url).password is not None
    except BadRedisURL:
        given = True  # say "refused" rather than build an example from a bad URL
    if given:
        return PasswordError(
            f"the server at {redact(url)} refused the password ({reason.rstrip('.')}): "
            "check the user name and password in the Redis URL"
        )
    scheme, _, rest = redact(url).partition("://")  # redacts a sentinel_password=
    user, _, hostpart = rest.rpartition("@")
    return PasswordError(
        f"the server requires a password: {scheme}://{user}:PASSWORD@{hostpart} "
        "(percent-encode / @ : in it)"
    )


def _handshake(url: str, asyncio: bool) -> Callable[[Any], Any]:
    """A redis-py ``redis_connect_func``: its own handshake (HELLO, AUTH, SELECT), whose
    failures that are configuration mistakes become clear errors (explain()). It runs
    once per new connection, never per command, and adds no round trip."""
    if asyncio:

        async def checked_async(conn: Any) -> None:
            try:
                await conn.on_connect()
            except redis.exceptions.RedisError as exc:
                raise (explain(exc, url) or exc) from exc

        return checked_async

    def checked(conn: Any) -> None:
        try:
            conn.on_connect()
        except redis.exceptions.RedisError as exc:
            raise (explain(exc, url) or exc) from exc

    return checked


@functools.cache
def _async_cluster_class() -> type:
    """redis-py's asyncio cluster client whose first connection (initialize(), made
    lazily by the first call) names configuration mistakes like the other clients."""
    from redis.asyncio.cluster import RedisCluster

    class CheckedRedisCluster(RedisCluster):
        redisbal_url = ""

        async def initialize(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().initialize(*args, **kwargs)
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
                raise (explain(exc, self.redisbal_url) or exc) from exc

    return CheckedRedisCluster


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in its userinfo (percent-encoded, after the user name
    if it has one), for every scheme. BadRedisURL (the URL redacted) if the URL is bad
    or has a password already: one of the two would be ignored."""
    t = parse_url(url)
    if t.password is not None:
        raise BadRedisURL(
            f"{redact(url)!r} has a password already: give it in the URL or in a file, not both"
        )
    scheme, rest = url.split("://", 1)
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    user = ""
    if "@" in authority:  # a user name and no password: "user@" or "user:@"
        userinfo, _, rest = rest.partition("@")
        user = userinfo.rstrip(":")
    return f"{scheme}://{user}:{quote(password, safe='')}@{rest}"


def make_client(
    url: str, *, asyncio: bool = False, cluster_retries: int | None = None, **kw: Any
) -> Any:
    """A redis-py client (sync or asyncio) for any supported URL. ``cluster_retries``:
    on a Redis Cluster, retry a failed call at most this many times, at once (redis-py's
    own cluster retries sleep about a second between tries); other kinds ignore it."""
    t = parse_url(url)
    if asyncio:
        import redis.asyncio as r
        from redis.asyncio.retry import Retry
        from redis.asyncio.sentinel import Sentinel
    else:
        import redis as r  # type: ignore[no-redef]
        from redis.retry import Retry  # type: ignore[assignment]
        from redis.sentinel import Sentinel  # type: ignore[assignment]
    if t.kind == "cluster" and cluster_retries is not None:
        from redis.backoff import NoBackoff

        kw["retry"] = Retry(NoBackoff(), cluster_retries)
    # single and Sentinel data connections: the checked handshake (unless the caller has one)
    checked = {"redis_connect_func": _handshake(url, asyncio), **kw}
    if t.kind == "single":
        return r.Redis.from_url(url, **checked)
    auth: dict[str, Any] = {"username": t.username, "password": t.password}
    if t.kind == "cluster":
        from redis.cluster import ClusterNode, RedisCluster

        if asyncio:
            from redis.asyncio.cluster import ClusterNode as AClusterNode

            anodes = [AClusterNode(h, p) for h, p in t.hosts]
            aclient = _async_cluster_class()(startup_nodes=anodes, **auth, **_tls_kwargs(t), **kw)
            aclient.redisbal_url = url
            aclient.commands_parser = _cluster_commands(aclient, True)
            return aclient
        nodes: list[Any] = [ClusterNode(h, p) for h, p in t.hosts]
        try:  # the sync client asks for the slot map here, at construction
            client = RedisCluster(startup_nodes=nodes, **auth, **_tls_kwargs(t), **kw)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise (explain(exc, url) or exc) from exc
        client.commands_parser = _cluster_commands(client, False)
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
    pool = _async_sentinel_pool() if asyncio else _sentinel_pool()
    return sentinel.master_for(
        t.service, connection_pool_class=pool, db=t.db, **auth, **_tls_kwargs(t), **checked
    )


@functools.cache
def _sentinel_pool() -> Any:
    """redis-py's Sentinel pool (sync), whose disconnect (a client's close) also closes
    the connections to the sentinels: redis-py leaves those open (one per sentinel
    asked) until they are collected, a socket left behind by every client closed."""
    from redis.sentinel import SentinelConnectionPool

    class Pool(SentinelConnectionPool):
        def disconnect(self, inuse_connections: bool = True) -> None:
            super().disconnect(inuse_connections)
            for s in self.proxy.sentinel_manager.sentinels:
                s.connection_pool.disconnect(inuse_connections)

    return Pool


@functools.cache
def _async_sentinel_pool() -> Any:
    """``_sentinel_pool`` for the asyncio client."""
    from redis.asyncio.sentinel import SentinelConnectionPool

    class Pool(SentinelConnectionPool):
        async def disconnect(self, inuse_connections: bool = True) -> None:
            await super().disconnect(inuse_connections)
            for s in self.sentinel_manager.sentinels:
                await s.connection_pool.disconnect(inuse_connections)

    return Pool


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
                if keys is not None:
                    return keys
                return super().get_keys(redis_conn, *args)  # type: ignore[no-untyped-call]

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


def is_cluster(client: object) -> bool:
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
