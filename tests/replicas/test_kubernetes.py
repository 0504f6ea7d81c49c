"""deploy/kubernetes: every manifest valid against the Kubernetes schemas, and consistent with what
prefixgate itself accepts and serves (its config file, its flags, its probe endpoints), with the vLLM
ranks it ships and with the session headers prefixgate reads."""

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
from proxy.config import load_settings
from proxy.stages.identify import DEFAULT_SESSION_HEADERS
from tests.helpers.manifests import k8s_bytes, redis_bytes, redis_option, validate_manifest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"


def resources() -> list[dict[str, Any]]:
    """Every document the kustomization lists, in its order."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    out: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        out.extend(doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc)
    return out


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def every_manifest() -> list[tuple[str, dict[str, Any]]]:
    """Every document of every manifest in deploy/kubernetes, listed by the kustomization or not."""
    return [
        (path.name, doc)
        for path in sorted(DEPLOY.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


@pytest.mark.parametrize(
    ("path", "resource"), every_manifest(), ids=lambda x: x if isinstance(x, str) else x["kind"]
)
def test_each_manifest_is_valid_against_the_kubernetes_schema(path: str, resource: dict[str, Any]) -> None:
    validate_manifest(resource)


def test_the_kustomization_lists_files_that_exist() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert all((DEPLOY / name).is_file() for name in kustomization["resources"])


def test_the_kustomization_covers_deployment_service_config_redis_and_a_disruption_budget() -> None:
    kinds = {(r["kind"], r["metadata"]["name"]) for r in resources()}
    assert {
        ("Deployment", "prefixgate"),
        ("Service", "prefixgate"),
        ("ConfigMap", "prefixgate-config"),
        ("Deployment", "prefixgate-redis"),
        ("Service", "prefixgate-redis"),
        ("PodDisruptionBudget", "prefixgate"),
    } <= kinds
    deployment = one("Deployment", "prefixgate")
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        one("Service", "prefixgate")["spec"]["selector"],
        one("PodDisruptionBudget", "prefixgate")["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"


def test_the_config_map_is_a_configuration_prefixgate_accepts(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(one("ConfigMap", "prefixgate-config")["data"]["config.yaml"])
    settings = load_settings(config, environ={})
    assert len(settings.backends) >= 2
    assert settings.redis_url is not None and "prefixgate-redis" in settings.redis_url
    assert settings.kv_events == "auto"
    assert settings.host == "0.0.0.0"


def test_the_container_runs_serve_with_flags_it_knows_and_probes_paths_it_serves() -> None:
    (container,) = one("Deployment", "prefixgate")["spec"]["template"]["spec"]["containers"]
    command, *flags = container["args"]
    assert command == "serve"
    parser = argparse.ArgumentParser(prog="prefixgate serve", exit_on_error=False)
    serve_cmd.configure_parser(parser)
    args = parser.parse_args(flags)
    assert args.config == "/etc/prefixgate/config.yaml"
    grace = one("Deployment", "prefixgate")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.shutdown_timeout  # in-flight streams finish before the kubelet kills it
    routes = {getattr(route, "path", None) for route in create_app(load_settings(environ={})).routes}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    mount = container["volumeMounts"][0]
    assert Path(args.config).parent == Path(mount["mountPath"])


def container(kind: str, name: str) -> dict[str, Any]:
    (found,) = one(kind, name)["spec"]["template"]["spec"]["containers"]
    return found


def test_redis_evicts_only_rebuildable_keys_before_its_memory_limit_kills_it() -> None:
    redis = container("Deployment", "prefixgate-redis")
    limit = k8s_bytes(redis["resources"]["limits"]["memory"])
    maxmemory = redis_bytes(redis_option(redis["args"], "maxmemory"))
    # Redis counts only its data: fragmentation, client buffers and Lua come on top of maxmemory
    assert 0 < maxmemory <= 0.8 * limit
    # keys with a TTL (the prefix index, session records, the response map) go; admission's claims,
    # which carry none, stay
    assert redis_option(redis["args"], "maxmemory-policy") == "volatile-lru"


def test_the_ranks_of_the_config_map_are_the_pods_of_the_vllm_stateful_set_it_ships(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(one("ConfigMap", "prefixgate-config")["data"]["config.yaml"])
    settings = load_settings(config, environ={})
    vllm = one("StatefulSet", "vllm")
    service = one("Service", vllm["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert service["spec"]["selector"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    pods = {f"{vllm['metadata']['name']}-{i}.{service['metadata']['name']}" for i in range(2)}
    assert vllm["spec"]["replicas"] == len(settings.backends)
    assert {urlsplit(b.url).hostname for b in settings.backends} == pods
    (rank,) = vllm["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in rank["ports"]}
    assert {urlsplit(b.url).port for b in settings.backends} == {ports["http"]}
    # the rank publishes KV events (and answers replays) on ports its Service exposes
    (events_arg,) = [a for a in rank["args"] if a.startswith("--kv-events-config=")]
    events = json.loads(events_arg.split("=", 1)[1])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    service_ports = {p["port"] for p in service["spec"]["ports"]}
    for key in ("endpoint", "replay_endpoint"):
        assert int(events[key].rsplit(":", 1)[1]) in set(ports.values()) & service_ports
    assert "--enable-prefix-caching" in rank["args"] and "--enable-prompt-tokens-details" in rank["args"]
    assert rank["resources"]["limits"]["nvidia.com/gpu"] == 1
    # a model takes minutes to load: the startup probe, not liveness, waits for it
    startup = rank["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_the_ingress_hashes_each_session_to_one_replica_on_every_session_header() -> None:
    ingress = yaml.safe_load((DEPLOY / "ingress.yaml").read_text())
    annotations = ingress["metadata"]["annotations"]
    key = annotations["nginx.ingress.kubernetes.io/upstream-hash-by"]
    assert key == "".join("$http_" + h.replace("-", "_") for h in DEFAULT_SESSION_HEADERS)
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert (
        int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"])
        > load_settings(environ={}).read_timeout
    )
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    service = one("Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}


def test_the_image_is_the_one_the_kustomization_names() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    image = container("Deployment", "prefixgate")["image"]
    (entry,) = [i for i in kustomization["images"] if i["name"] == image.split(":")[0]]
    assert entry["newTag"] == image.split(":")[1]


def test_the_readme_shows_the_probe_timings_the_deployment_uses() -> None:
    section = (ROOT / "README.md").read_text().split("In Kubernetes, probe the same two endpoints", 1)[1]
    shown = yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])
    deployed = container("Deployment", "prefixgate")
    for probe in ("livenessProbe", "readinessProbe"):
        assert shown[probe]["httpGet"]["path"] == deployed[probe]["httpGet"]["path"]
        for timing in ("periodSeconds", "failureThreshold", "timeoutSeconds", "initialDelaySeconds"):
            assert shown[probe].get(timing) == deployed[probe].get(timing), (probe, timing)
