"""deploy/helm/prefixgate: linted and rendered by Helm's own Go SDK (helm-python-sdk embeds it: there is
no helm binary in Debian's packages), with its default values and with each set of values under ci/
(every optional feature on, external Redis as Sentinel, Cluster or a Secret, no Redis); every rendered
manifest validated against its schema; and what it renders consistent with what prefixgate accepts
and serves, and with deploy/kubernetes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.app import create_app
from proxy.cli import serve as serve_cmd
from proxy.config import Settings, load_settings
from proxy.stages.identify import DEFAULT_SESSION_HEADERS
from tests.helpers.manifests import (
    KUBERNETES_VERSION,
    k8s_bytes,
    redis_bytes,
    redis_option,
    validate_manifest,
)

# the test extra installs it where it has a wheel (Linux x86_64 and aarch64, macOS arm64, Windows)
helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's Go SDK) has no wheel here")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "prefixgate"
KUBERNETES = ROOT / "deploy" / "kubernetes"
RELEASE = "prefixgate"
VALUE_SETS: dict[str, dict[str, Any]] = {"defaults": {}} | {
    path.stem: yaml.safe_load(path.read_text()) for path in sorted((CHART / "ci").glob("*.yaml"))
}
ALL_FEATURES = "all-features-values"


class _UniqueKeyLoader(yaml.SafeLoader):
    """A loader that refuses a mapping with a key twice (the API server's strict decoding does)."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
    duplicates = {k for k in keys if keys.count(k) > 1}
    if duplicates:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicates}", node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every manifest the chart renders with ``values``, as ``helm template`` would."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name=RELEASE, namespace="llm", is_install=True)
    return [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.load_all(text, Loader=_UniqueKeyLoader)  # a SafeLoader
        if doc
    ]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container_of(workload: dict[str, Any]) -> dict[str, Any]:
    (found,) = workload["spec"]["template"]["spec"]["containers"]
    return found


def settings_of(docs: list[dict[str, Any]], tmp_path: Path) -> Settings:
    """The settings prefixgate reads from the rendered ConfigMap (and its environment's literals)."""
    config = tmp_path / "config.yaml"
    config.write_text(find(docs, "ConfigMap", RELEASE)["data"]["config.yaml"])
    return load_settings(config, environ={})


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_lints_with_no_warning(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == []
    # severity 1 is information (an icon is recommended); 2 a warning, 3 an error
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_manifest_is_valid_against_its_schema(name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert {"ConfigMap", "Deployment", "Service"} <= {d["kind"] for d in docs}
    for doc in docs:
        validate_manifest(doc)


def test_every_optional_feature_renders_its_objects() -> None:
    docs = render(VALUE_SETS[ALL_FEATURES])
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("StatefulSet", f"{RELEASE}-vllm"),
        ("Service", f"{RELEASE}-vllm"),
        ("Deployment", f"{RELEASE}-redis"),
        ("ServiceMonitor", RELEASE),
        ("ServiceMonitor", f"{RELEASE}-vllm"),
        ("ConfigMap", f"{RELEASE}-dashboard"),
        ("Ingress", RELEASE),
        ("PodDisruptionBudget", RELEASE),
    } <= kinds
    defaults = {(d["kind"], d["metadata"]["name"]) for d in render({})}
    assert not {"StatefulSet", "ServiceMonitor", "Ingress"} & {kind for kind, _ in defaults}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_prefixgate_accepts_the_configuration_the_chart_writes(name: str, tmp_path: Path) -> None:
    values = VALUE_SETS[name]
    docs = render(values)
    settings = settings_of(docs, tmp_path)
    assert settings.host == "0.0.0.0" and len(settings.backends) >= 2
    redis = values.get("redis", {})
    env = {e["name"]: e for e in container_of(find(docs, "Deployment", RELEASE)).get("env", [])}
    match redis.get("mode", "internal"):
        case "internal":
            assert settings.redis_url == f"redis://{RELEASE}-redis:6379/0"
            assert find(docs, "Service", f"{RELEASE}-redis")["spec"]["ports"][0]["port"] == 6379
        case "external" if "urlSecret" in redis:
            assert settings.redis_url is None
            secret = env["PREFIXGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
            assert secret == redis["urlSecret"]
        case "external":
            assert settings.redis_url == redis["url"]
        case "none":
            assert settings.redis_url is None
    events = values.get("kvEvents", {})
    if events.get("mode") == "off":
        assert settings.kv_events is None
    elif events.get("endpoints"):
        specs = dict(item.split("=", 1) for item in (settings.kv_events or "").split(","))
        assert specs == events["endpoints"]
    elif not values.get("vllm", {}).get("enabled"):
        assert settings.kv_events == "auto"
    for key, value in values.get("config", {}).items():
        assert getattr(settings, key) == value


def test_the_in_chart_vllm_ranks_are_the_backends_and_publish_the_kv_events_subscribed_to(
    tmp_path: Path,
) -> None:
    values = VALUE_SETS[ALL_FEATURES]
    docs = render(values)
    settings = settings_of(docs, tmp_path)
    vllm = find(docs, "StatefulSet", f"{RELEASE}-vllm")
    service = find(docs, "Service", vllm["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and vllm["spec"]["podManagementPolicy"] == "Parallel"
    assert service["spec"]["selector"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    replicas = vllm["spec"]["replicas"]
    assert replicas == values["vllm"]["replicas"] == len(settings.backends)
    hosts = [f"{vllm['metadata']['name']}-{i}.{service['metadata']['name']}" for i in range(replicas)]
    assert [urlsplit(b.url).hostname for b in settings.backends] == hosts
    rank = container_of(vllm)
    ports = {p["name"]: p["containerPort"] for p in rank["ports"]}
    assert {urlsplit(b.url).port for b in settings.backends} == {ports["http"]}
    (events_arg,) = [a for a in rank["args"] if a.startswith("--kv-events-config=")]
    published = json.loads(events_arg.split("=", 1)[1])
    assert published["enable_kv_cache_events"] is True
    publish_port = int(published["endpoint"].rsplit(":", 1)[1])
    replay_port = int(published["replay_endpoint"].rsplit(":", 1)[1])
    # each backend's events are subscribed to at its own pod, on the ports the rank publishes on
    specs = dict(item.split("=", 1) for item in (settings.kv_events or "").split(","))
    for backend, host in zip(settings.backends, hosts, strict=True):
        assert specs[backend.name] == f"tcp://{host}:{publish_port}|tcp://{host}:{replay_port}"
    assert {publish_port, replay_port} <= {p["port"] for p in service["spec"]["ports"]}
    assert rank["resources"]["limits"]["nvidia.com/gpu"] == values["vllm"]["gpusPerRank"]
    assert values["vllm"]["extraArgs"] == rank["args"][-len(values["vllm"]["extraArgs"]) :]
    claim = vllm["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == values["vllm"]["cache"]["size"]
    startup = rank["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model loads for minutes


@pytest.mark.parametrize("name", ["defaults", ALL_FEATURES])
def test_the_in_chart_redis_evicts_only_rebuildable_keys_before_its_limit(name: str) -> None:
    redis = container_of(find(render(VALUE_SETS[name]), "Deployment", f"{RELEASE}-redis"))
    limit = k8s_bytes(redis["resources"]["limits"]["memory"])
    maxmemory = redis_bytes(redis_option(redis["args"], "maxmemory"))
    assert 0 < maxmemory <= 0.8 * limit
    assert redis_option(redis["args"], "maxmemory-policy") == "volatile-lru"


def test_the_replicas_run_serve_with_flags_it_knows_and_probe_what_it_serves() -> None:
    docs = render(VALUE_SETS[ALL_FEATURES])
    deployment = find(docs, "Deployment", RELEASE)
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    command, *flags = container["args"]
    assert command == "serve"
    parser = argparse.ArgumentParser(prog="prefixgate serve", exit_on_error=False)
    serve_cmd.configure_parser(parser)
    args = parser.parse_args(flags)
    assert Path(args.config).parent == Path(container["volumeMounts"][0]["mountPath"])
    assert pod["terminationGracePeriodSeconds"] > float(args.shutdown_timeout)
    routes = {getattr(route, "path", None) for route in create_app(load_settings(environ={})).routes}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    assert deployment["spec"]["replicas"] == VALUE_SETS[ALL_FEATURES]["replicaCount"]
    service = find(docs, "Service", RELEASE)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    token = VALUE_SETS[ALL_FEATURES]["adminTokenSecret"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["PREFIXGATE_ADMIN_TOKEN"] == token
    (endpoint,) = find(docs, "ServiceMonitor", RELEASE)["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["authorization"]["credentials"] == token


def test_the_probes_are_those_of_deploy_kubernetes() -> None:
    chart = container_of(find(render({}), "Deployment", RELEASE))
    manifest = yaml.safe_load((KUBERNETES / "prefixgate.yaml").read_text().split("\n---\n")[0])
    plain = container_of(manifest)
    for probe in ("readinessProbe", "livenessProbe"):
        assert chart[probe] == plain[probe]


def test_the_ingress_hashes_each_session_to_one_replica_on_every_session_header() -> None:
    with helm.Chart.load(CHART) as chart:
        assert tuple(chart.values["ingress"]["sessionHeaders"]) == DEFAULT_SESSION_HEADERS
    ingress = find(render(VALUE_SETS[ALL_FEATURES]), "Ingress", RELEASE)
    key = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert key == "".join("$http_" + h.replace("-", "_") for h in DEFAULT_SESSION_HEADERS)
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == VALUE_SETS[ALL_FEATURES]["ingress"]["host"]
    assert rule["http"]["paths"][0]["backend"]["service"]["name"] == RELEASE


def test_the_dashboard_config_map_is_the_dashboard_of_docs_grafana() -> None:
    board = find(render(VALUE_SETS[ALL_FEATURES]), "ConfigMap", f"{RELEASE}-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((ROOT / "docs" / "grafana" / "prefixgate.json").read_text())
    assert json.loads(board["data"]["prefixgate.json"]) == shipped


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ranks": []}, "no ranks"),
        ({"kvEvents": {"mode": "endpoints"}}, "kvEvents.endpoints"),
        ({"redis": {"mode": "external"}}, "redis.url"),
    ],
)
def test_values_that_cannot_work_fail_with_what_to_set(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


@pytest.mark.parametrize(
    "values",
    [
        {"redis": {"mode": "sentinel"}},
        {"redis": {"url": "http://redis:6379"}},
        {"redis": {"maxmemoryPercent": 100}},
        {"kvEvents": {"mode": "on"}},
        {"ranks": [{"name": "a", "url": "vllm-0:8000"}]},
    ],
)
def test_the_values_schema_refuses_what_prefixgate_would_refuse(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
