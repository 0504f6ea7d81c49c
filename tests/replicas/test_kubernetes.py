"""deploy/kubernetes: every manifest valid against the Kubernetes schemas, and consistent with what
prefixgate itself accepts and serves (its config file, its flags, its probe endpoints)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from proxy.app import create_app
from proxy.cli import serve as serve_cmd
from proxy.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"


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


@pytest.mark.parametrize("resource", resources(), ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_each_manifest_is_valid_against_the_kubernetes_schema(resource: dict[str, Any]) -> None:
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


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
