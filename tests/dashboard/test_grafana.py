"""The Grafana board and the Prometheus scrape config only name metrics that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docs" / "grafana"


def exprs() -> list[str]:
    board = json.loads((GRAFANA / "prefixgate.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def exported_names(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_board_uses_only_prefixgate_metrics_that_exist():
    metrics = Metrics()
    # touch the labelled histograms so their series (and so their _bucket names) render
    metrics.ttfb.labels("x").observe(0.1)
    metrics.duration.labels("x").observe(0.1)
    rendered = metrics.render().decode()
    series = {line.split("{")[0].split(" ")[0] for line in rendered.splitlines() if line and line[0] != "#"}
    families = exported_names(rendered)
    used = {name for expr in exprs() for name in re.findall(r"\bprefixgate_\w+", expr)}
    assert used, "the board names no prefixgate metric"
    for name in used:
        assert name in series or name in families, f"{name} is not a prefixgate metric"
    # the subjects all have a panel
    for needed in (
        "prefixgate_fleet_hit_rate",
        "prefixgate_cached_tokens_total",
        "prefixgate_rank_working_set_tokens",
        "prefixgate_admission_rejected_total",
        "prefixgate_admission_queue_depth",
        "prefixgate_canonical_rewrites_total",
        "prefixgate_prefix_breaks_total",
        "prefixgate_time_to_first_byte_seconds_bucket",
        "prefixgate_request_duration_seconds_bucket",
    ):
        assert needed in used, needed


def test_board_uses_only_vllm_metrics_a_rank_exports(rank_servers):
    (rank,) = rank_servers.sim(1)
    text = httpx.get(rank.url + "/metrics", timeout=10.0, trust_env=False).text
    series = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    used = {name for expr in exprs() for name in re.findall(r"\bvllm:\w+", expr)}
    assert used
    assert used <= series, used - series


def test_every_panel_has_the_templated_datasource_and_a_unique_id():
    board = json.loads((GRAFANA / "prefixgate.json").read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert p["targets"]
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert provisioned["datasources"][0]["uid"] == board["templating"]["list"][0]["current"]["value"]


def test_prometheus_scrapes_prefixgate_and_the_ranks_of_the_compose_file():
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in config["scrape_configs"]
    }
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = set(compose["services"])
    assert {"prometheus", "grafana"} <= services
    for job in ("prefixgate", "vllm"):
        for target in targets[job]:
            assert target.split(":")[0] in services, target


def test_compose_file_is_valid():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed")
    for profile in ("cpu", "gpu"):
        result = subprocess.run(
            ["docker-compose", "--profile", profile, "config", "-q"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
