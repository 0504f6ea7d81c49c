"""What issue 21 found missing from the README and the compose file, kept there or in the docs the README
links: the by-hand quickstart with `prefixgate sim`, sessions and their identification
(docs/agents.md), KV events on the vLLM `serve` line, the test suite's needs and skip reasons
(docs/testing.md), the probes, the Redis URLs (docs/deploying.md)."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import yaml

from bench.sim import cli as sim_cli
from proxy.config import Settings, load_settings
from proxy.stages.identify import DEFAULT_SESSION_HEADERS
from tests.test_readme import readme_commands

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
TESTING = (DOCS / "testing.md").read_text()


def section(title: str, text: str = README) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_test_command_ends_with_failures_and_skip_reasons_and_names_what_the_suite_needs():
    assert readme_commands()[1].endswith("pytest -q -rfEs")  # the failures last: a CI log shows its tail
    assert "(docs/testing.md)" in section("Set up on a fresh machine")
    setup = section("The test command", TESTING)
    assert f"    {readme_commands()[1]}\n" in setup  # the README's command, the one explained there
    assert "`../shared`" in setup and "chromium" in setup and "install_browser.sh" in setup


def test_the_deselected_tiers_and_the_lines_that_run_them_are_named():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = [m.split(":", 1)[0] for m in pyproject["markers"]]
    assert markers == ["vllm", "agents"]
    setup = TESTING
    deselect, parallel = re.fullmatch(r"(-m '[^']*') (.*)", pyproject["addopts"]).groups()
    assert f"`{deselect}`" in setup  # what deselects them, as written there
    assert f"`{parallel}`" in setup and "`-n 0`" in setup  # the parallel run, and how to leave it
    for marker in markers:
        assert f"marked `{marker}` (`tests/{marker}`" in setup, marker
    # each tier's line in .ci/run, word for word
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for script in ("tests/vllm/test.sh", "tests/agents/test.sh"):
        (line,) = [line.strip() for line in ci if script in line and not line.startswith("#")]
        assert f"`{line}`" in " ".join(setup.split()), line


def test_the_by_hand_quickstart_matches_the_sim_and_serve_defaults():
    commands = [line.strip() for line in section("Try it by hand").splitlines() if line.startswith("    ")]
    assert commands[0].startswith(".venv/bin/prefixgate sim --ranks 2")
    parser = argparse.ArgumentParser()
    sim_cli.configure_parser(parser)
    sim_port = parser.parse_args([]).port
    # the ranks the sim starts (BASE+i, named sim-i) are the backends of the serve line
    backends = re.findall(r"--backend (\S+)", commands[1])
    assert backends == [f"sim-{i}=http://127.0.0.1:{sim_port + i}" for i in range(2)]
    serve_port = Settings().port
    requests = [c for c in commands if "/v1/chat/completions" in c]
    assert len(requests) == 1 and f"http://127.0.0.1:{serve_port}/v1/chat/completions" in requests[0]
    assert sim_port != serve_port


def test_sessions_are_explained_with_every_way_they_are_identified():
    assert "(docs/agents.md)" in README
    text = section("Sessions", (DOCS / "agents.md").read_text())
    for header in DEFAULT_SESSION_HEADERS:
        assert f"`{header}`" in text
    for field in ("prompt_cache_key", "metadata.session_id", "metadata.user_id", "`user`"):
        assert field in text
    assert "fingerprint" in text and "`model`" in text


def test_the_vllm_serve_line_subscribes_to_the_ranks_kv_events():
    text = section("Put it in front of a vLLM fleet")
    vllm_endpoint_port = re.search(r'"endpoint":"tcp://\*:(\d+)"', text).group(1)
    serve = text.split("prefixgate serve", 1)[1].split("\n\n", 1)[0]
    spec = re.search(r"--kv-events (\S+)", serve).group(1)
    backends = re.findall(r"--backend (\S+)", serve)
    settings = load_settings(flags={"kv_events": spec}, backend_specs=backends, environ={})
    assert settings.kv_events == spec and all(f":{vllm_endpoint_port}" in s for s in spec.split(","))
    assert "/ready" in text
    deploying = section("Deploying it")
    assert "readinessProbe" in deploying and "livenessProbe" in deploying


def test_compose_probes_readiness_and_wires_kv_events_and_redis():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    # the replicas behind each profile's nginx (tests/replicas/test_compose.py checks the balancing)
    for name in ("prefixgate-a", "prefixgate-b", "prefixgate-cpu-a", "prefixgate-cpu-b"):
        service = services[name]
        assert "/ready" in " ".join(service["healthcheck"]["test"])
        env = service["environment"]
        settings = load_settings(environ={k: str(v) for k, v in env.items()})
        assert settings.kv_events and settings.redis_url == "redis://redis:6379/0"
        assert {s.split("=")[0] for s in settings.kv_events.split(",")} == {b.name for b in settings.backends}


REDIS_URL = re.compile(r"`((?:redis|rediss|unix)(?:\+\w+)?://[^`]*)`")


def test_the_redis_url_is_written_one_way_and_each_form_is_accepted():
    from proxy.state.redis.topology import REDIS_URL_FORMS, REDIS_URLS

    # every redis:// URL the README and the docs show has the user the URL may carry
    texts = [README, *(path.read_text() for path in (ROOT / "docs").glob("*.md"))]
    forms = {url for text in texts for url in REDIS_URL.findall(text) if "host:port" in url}
    assert forms, "no Redis URL form documented"
    for form in forms:
        assert form.split("://", 1)[1].startswith("[[user]:password@]host:port"), form
        assert form in REDIS_URL_FORMS, form  # the same as `prefixgate serve --help` says
    deploying = (DOCS / "deploying.md").read_text()
    assert "`--redis-url`" in README and "(docs/deploying.md)" in README
    for template in REDIS_URLS:
        assert f"`{template}`" in deploying, template
        # the template, filled in, is a URL --redis-url takes
        url = (
            template.replace("[[user]:password@]", "u:p@")
            .replace("[,host:port...]", ",127.0.0.2:26379")
            .replace("host:port", "127.0.0.1:6379")
            .replace("/SERVICE[/db]", "/mymaster/1")
            .replace("/db", "/0")
        )
        assert load_settings(flags={"redis_url": url}, backend_specs=["r=http://127.0.0.1:9"], environ={})
