"""The cost model of scripts/bench_scale.py: fitted over its points, what one Redis carries."""

from __future__ import annotations

from typing import Any


def lstsq(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares by the normal equations (a handful of points and terms)."""
    m = len(rows[0])
    if len(rows) < m:
        return None
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(m)] for i in range(m)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(m)]
    for col in range(m):  # Gaussian elimination with partial pivoting
        piv = max(range(col, m), key=lambda r: abs(ata[r][col]))
        if abs(ata[piv][col]) < 1e-12:
            return None
        ata[col], ata[piv] = ata[piv], ata[col]
        aty[col], aty[piv] = aty[piv], aty[col]
        for r in range(m):
            if r != col:
                f = ata[r][col] / ata[col][col]
                ata[r] = [x - f * y for x, y in zip(ata[r], ata[col], strict=True)]
                aty[r] -= f * aty[col]
    return [aty[i] / ata[i][i] for i in range(m)]


def fit_model(points: list[dict[str, Any]]) -> dict[str, Any]:
    """y = c0 + c1*N + c2*N*K for Redis CPU/step, bytes/snapshot and router adoption."""
    pts = [p for p in points if p["deployments"] == 1 and p["redis"]]
    if len({(p["engines"], p["subscribers"]) for p in pts}) < 3:
        return {"note": "needs three or more (N, K) points on one server"}
    rows = [[1.0, p["engines"], p["engines"] * p["subscribers"]] for p in pts]
    model: dict[str, Any] = {"form": "y = c0 + c1*N + c2*N*K"}
    for name, key in (
        ("redis_cpu_ms_per_step", lambda p: p["redis"]["cpu_ms_per_step"]),
        ("snapshot_bytes", lambda p: p["snapshot_bytes"]),
        ("router_adopt_ms", lambda p: p["router_adopt_ms"]),
        ("router_proc_ms", lambda p: p["router_proc_ms"]),
    ):
        model[name] = lstsq(rows, [key(p) for p in pts])
    cpu, size = model["redis_cpu_ms_per_step"], model["snapshot_bytes"]
    if cpu and size:
        cap = []
        for kk in (8, 16, 32, 64):
            per_n_cpu = cpu[1] + cpu[2] * kk  # ms per step per engine
            per_n_bytes = size[1] + size[2] * kk
            cap.append(
                {
                    "subscribers": kk,
                    "engines_one_core": int((1000 / 50 - cpu[0]) / per_n_cpu),
                    "engines_half_core": int((500 / 50 - cpu[0]) / per_n_cpu),
                    "engines_50MBps": int((50e6 / 50 / kk - size[0]) / per_n_bytes),
                }
            )
        model["at_50_steps_per_s"] = cap
        n, kk = 1024, 64
        model["projected_1024x64_at_50"] = {
            "redis_core": 50 * (cpu[0] + cpu[1] * n + cpu[2] * n * kk) / 1000,
            "pubsub_MBps": 50 * kk * (size[0] + size[1] * n + size[2] * n * kk) / 1e6,
        }
    return model


def print_model(model: dict[str, Any]) -> None:
    if "note" in model:
        print(f"cost model: {model['note']}")
        return
    for name in ("redis_cpu_ms_per_step", "snapshot_bytes", "router_adopt_ms", "router_proc_ms"):
        c = model.get(name)
        if c:
            print(f"{name} = {c[0]:.4g} + {c[1]:.4g}*N + {c[2]:.4g}*N*K")
    for row in model.get("at_50_steps_per_s", []):
        print(
            f"at 50 steps/s with K={row['subscribers']}: one Redis core carries "
            f"N={row['engines_one_core']} (half a core: {row['engines_half_core']}); "
            f"50 MB/s of pub/sub: N={row['engines_50MBps']}"
        )
    if "projected_1024x64_at_50" in model:
        pr = model["projected_1024x64_at_50"]
        print(
            f"1024 x 64 at 50 steps/s: {pr['redis_core']:.2f} Redis cores, "
            f"{pr['pubsub_MBps']:.0f} MB/s"
        )
