"""``redisbal demo --compare POLICY``: the demo, then the same again with a baseline.

Every run uses the same Redis, seed and schedule (so the same requests with the same
output lengths, sent at the same offsets) and a fresh deployment name; only the
routing policy differs. Then one table says what users would feel under each policy
(TTFT p50/p99, end-to-end p99, goodput) with load imbalance as a diagnostic, and a
line says what "better" means and by how much the default policy was better, or not.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from redisbal.keys import check_name
from redisbal.ops.table import render_table
from redisbal.sim.demo import Demo, DemoOptions, Echo, _fmt, stops_as_ctrl_c
from redisbal.sim.embedded import RedisServer

# What one run each cannot tell apart, as a fraction of TTFT p99: policies that are
# alike in a scenario (redisbal, vllm-latest and round-robin with bursts on lockstep
# engines) differed by up to 22 % between runs of one seed on a loaded 2-core machine.
NOISE = 0.25


def _rel(base: float | None, new: float | None) -> float | None:
    """(base - new) / base: how much lower new is, as a fraction of base."""
    if base is None or new is None or base <= 0:
        return None
    return (base - new) / base


def compare_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """One row per policy from its run's ``results["overall"]``."""
    out = [
        (
            "policy",
            "TTFT p50",
            "TTFT p99",
            "e2e p99",
            "goodput",
            "load imbalance (diagnostic)",
        )
    ]
    for policy, o in rows:
        out.append(
            (
                policy,
                _fmt(o.get("ttft_p50_ms"), ".1f") + " ms",
                _fmt(o.get("ttft_p99_ms"), ".1f") + " ms",
                _fmt(o.get("e2e_p99_ms"), ".1f") + " ms",
                _fmt(o.get("goodput_rps")) + " req/s",
                _fmt(o.get("load_imbalance")),
            )
        )
    return render_table(out)


def verdict(
    rows: list[tuple[str, dict[str, Any]]], slo_ttft_ms: float | None, noise: float = NOISE
) -> list[str]:
    """What "better" means, then for each baseline by how much the first row (the
    default policy) was better (a lower TTFT p99 beyond noise, and no less goodput), or
    that the difference is within noise, or mixed (the goodput says otherwise)."""
    slo = f"{slo_ttft_ms:g} ms" if slo_ttft_ms is not None else "the objective"
    lines = [
        f"better = lower TTFT p99 (the slowest 1 % of first tokens) and more goodput "
        f"(requests/s whose first token came within {slo}).",
        f"One run each on one seed: TTFT p99 differences under {noise * 100:.0f} % are "
        "run-to-run noise.",
    ]
    name, first = rows[0]
    for policy, o in rows[1:]:
        rel = _rel(o.get("ttft_p99_ms"), first.get("ttft_p99_ms"))
        good_a, good_b = first.get("goodput_rps"), o.get("goodput_rps")
        goodput = (
            f"; goodput {_fmt(good_a)} vs {_fmt(good_b)} req/s"
            if good_a is not None and good_b is not None
            else ""
        )
        figures = (
            f"TTFT p99 {_fmt(first.get('ttft_p99_ms'), '.0f')} vs "
            f"{_fmt(o.get('ttft_p99_ms'), '.0f')} ms{goodput}"
        )
        if rel is None:
            lines.append(f"{name} vs {policy}: no TTFT figures to compare")
            continue
        if abs(rel) < noise:
            lines.append(f"{name} vs {policy}: within noise ({figures})")
            continue
        # the policy with the lower TTFT p99, by how much, and the other
        ahead, pct, other = (name, rel, policy) if rel > 0 else (policy, -rel / (1 - rel), name)
        good_ahead, good_other = (good_a, good_b) if ahead == name else (good_b, good_a)
        if good_ahead is not None and good_other is not None and good_other > good_ahead:
            # better means both: a lower p99 with less goodput is no verdict
            lines.append(f"{name} vs {policy}: mixed, {ahead}'s TTFT p99 {pct * 100:.0f} % "
                         f"lower, {other}'s goodput higher ({figures})")  # fmt: skip
        else:
            lines.append(f"{name} vs {policy}: {ahead} better, TTFT p99 {pct * 100:.0f} % "
                         f"lower ({figures})")  # fmt: skip
    return lines


class Comparison:
    """The default run and each baseline's, on one Redis, then the table."""

    def __init__(
        self, opts: DemoOptions, baselines: list[str], echo: Echo, demo_cls: type[Demo] = Demo
    ) -> None:
        self.opts = opts
        self.baselines = baselines
        self.echo = echo
        self.demo_cls = demo_cls
        self.logdir = Path(tempfile.mkdtemp(prefix="redisbal-demo-"))
        self.server: RedisServer | None = None
        self.keep = opts.keep_logs

    def cleanup(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.keep:
            self.echo(f"logs: {self.logdir}")
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def _start_redis(self) -> str:
        if self.opts.redis_url:
            return self.opts.redis_url
        self.server = RedisServer(workdir=str(self.logdir / "redis"))
        Path(self.server.dir).mkdir(exist_ok=True)
        self.server.start()
        v = ".".join(map(str, self.server.version))
        self.echo(f"started redis-server {v} ({self.server.binary}) on {self.server.url}")
        return str(self.server.url)

    def _runs(self) -> int:
        o = self.opts
        url = self._start_redis()
        policies = [o.policy, *self.baselines]
        rows: list[tuple[str, dict[str, Any]]] = []
        for i, policy in enumerate(policies):
            dep = o.deployment if i == 0 else check_name(f"{o.deployment}-{i}", "deployment")
            self.echo(
                f"\n== run {i + 1} of {len(policies)}: policy {policy}"
                + (" (the default)" if i == 0 else " (baseline)")
                + (f", deployment {dep}" if i else "")
            )
            run_opts = dataclasses.replace(o, redis_url=url, deployment=dep, policy=policy)
            demo = self.demo_cls(run_opts, self.echo, logdir_parent=self.logdir, brief=i > 0)
            code = demo.run()
            if code:
                self.keep = self.keep or code != 130
                return code
            rows.append((policy, demo.results.get("overall", {})))
        self.echo("\nsame seed, same schedule, one run each:")
        self.echo(compare_table(rows))
        for line in verdict(rows, o.slo_ttft_ms):
            self.echo(line)
        return 0

    def run(self) -> int:
        t0 = time.monotonic()
        atexit.register(self.cleanup)
        with stops_as_ctrl_c():
            try:
                code = self._runs()
            except KeyboardInterrupt:
                self.echo("\ninterrupted: stopping every process the demo started", err=True)
                code = 130
            finally:
                with contextlib.suppress(Exception):
                    self.cleanup()
                atexit.unregister(self.cleanup)
        if code == 0:
            self.echo(
                f"demo finished in {time.monotonic() - t0:.1f} s "
                f"({1 + len(self.baselines)} runs); all its processes stopped"
            )
        return code
