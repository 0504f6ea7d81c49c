"""docker-compose.yml: per profile, two prefixgate replicas behind nginx, wired to Redis and to the
ranks' KV-cache events (checked statically: no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import read_environment
from proxy.stages.identify import DEFAULT_SESSION_HEADERS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def in_profile(profile: str) -> dict[str, Any]:
    return {name: s for name, s in SERVICES.items() if profile in s.get("profiles", [])}


@pytest.mark.parametrize(("profile", "balancer"), [("gpu", "prefixgate"), ("cpu", "prefixgate-cpu")])
def test_two_replicas_behind_nginx_share_redis_and_the_ranks_kv_events(profile: str, balancer: str) -> None:
    services = in_profile(profile)
    replicas = sorted(n for n, s in services.items() if s.get("command", [None])[0] == "serve")
    assert len(replicas) == 2
    lb = services[balancer]
    assert lb["image"].startswith("nginx") and "8000:8000" in lb["ports"]
    (mount,) = lb["volumes"]
    conf = (ROOT / mount.split(":")[0].removeprefix("./")).read_text()
    upstream = re.findall(r"^\s*server\s+([\w-]+):8000", conf, flags=re.M)
    assert sorted(upstream) == replicas  # nginx deals requests to exactly this profile's replicas
    assert "proxy_buffering off" in conf  # streams reach clients chunk by chunk
    # each session's turns reach one replica (the one holding its previous turn's tokens), keyed on
    # every header prefixgate reads a session from; a request with none is dealt at random
    affinity = re.search(r"^map (\S+) \$session_affinity \{", conf, flags=re.M)
    assert affinity is not None and "hash $session_affinity consistent;" in conf
    assert affinity.group(1) == "".join("$http_" + h.replace("-", "_") for h in DEFAULT_SESSION_HEADERS)
    ranks = set()
    for name in replicas:
        settings = read_environment(services[name]["environment"])
        assert settings["redis_url"] == "redis://redis:6379/0" and "redis" in services
        backends = {b["name"]: b["url"].removeprefix("http://").split(":")[0] for b in settings["backends"]}
        feeds = dict(item.split("=", 1) for item in settings["kv_events"].split(","))
        assert feeds.keys() == backends.keys()  # every rank's KV events, at that rank's host
        assert all(feeds[name].startswith(f"tcp://{host}:") for name, host in backends.items())
        ranks |= set(backends.values())
        assert services[name]["healthcheck"]["test"][-1].find("/ready") > 0
    for rank in ranks:  # every rank publishes the KV events the replicas subscribe to
        command = " ".join(services[rank]["command"])
        assert "kv-events" in command or "kv_cache_events" in command, rank


@pytest.mark.parametrize(("profile", "balancer"), [("gpu", "prefixgate"), ("cpu", "prefixgate-cpu")])
def test_each_service_starts_after_what_it_needs_is_healthy(profile: str, balancer: str) -> None:
    services = in_profile(profile)
    replicas = sorted(n for n, s in services.items() if s.get("command", [None])[0] == "serve")
    needs: dict[str, set[str]] = {balancer: set(replicas)}
    for name in replicas:
        settings = read_environment(services[name]["environment"])
        ranks = {b["url"].removeprefix("http://").split(":")[0] for b in settings["backends"]}
        needs[name] = {"redis"} | ranks  # the ranks a replica routes to and the Redis it shares
    for name, wanted in needs.items():
        depends_on = services[name]["depends_on"]
        assert isinstance(depends_on, dict), f"{name}: depends_on without a condition"
        assert wanted <= depends_on.keys(), (name, wanted - depends_on.keys())
        for dependency, condition in depends_on.items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)
            assert profile in SERVICES[dependency]["profiles"]
            check = SERVICES[dependency]["healthcheck"]["test"]
            assert check[0] == "CMD" and len(check) > 1, dependency
    for name in needs.keys() - {balancer}:  # what nginx waits for answers only once ready
        assert "/ready" in services[name]["healthcheck"]["test"][-1]


def test_a_vllm_rank_may_load_its_model_for_minutes_before_its_health_counts() -> None:
    for name in ("vllm-0", "vllm-1"):
        check = SERVICES[name]["healthcheck"]
        assert "/health" in check["test"][-1]
        start_period = re.fullmatch(r"(\d+)m", check["start_period"])
        assert start_period is not None and int(start_period.group(1)) >= 10
