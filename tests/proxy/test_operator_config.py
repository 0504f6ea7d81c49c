"""What an operator sees when a setting is wrong (issue 21): one line naming the setting, the value,
what it may be and where it was set, exit 2, never a traceback; the CLI's usage, defaults and port."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from proxy.cli import main
from proxy.config import ConfigError, load_settings
from tests.helpers.gateway import start_gateway
from tests.helpers.wait import wait_until

RANK = "http://127.0.0.1:9"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def error_of(tmp_path: Path, yaml_text: str | None = None, **flags: object) -> str:
    config = None
    if yaml_text is not None:
        config = tmp_path / "prefixgate.yaml"
        config.write_text(yaml_text)
    with pytest.raises(ConfigError) as caught:
        load_settings(config, flags=flags, backend_specs=["a=" + RANK], environ={})
    message = str(caught.value)
    assert "\n" not in message and "Value error" not in message
    return message


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        ({"policy": "fastest"}, ["policy", "'fastest'", "prefix_affinity, session_hash", "from --policy"]),
        ({"log_level": "verbose"}, ["log_level", "'verbose'", "debug", "from --log-level"]),
        ({"event_loop": "tokio"}, ["event_loop", "'tokio'", "'asyncio' or 'uvloop'"]),
        ({"port": 99999}, ["port", "65535", "99999"]),
        ({"redis_url": "localhost:6379"}, ["redis_url", "redis://", "'localhost:6379'"]),
        ({"kv_events": "garbage"}, ["kv_events", "'garbage'", "NAME=tcp://HOST:PORT", "auto"]),
        ({"kv_events": "b=tcp://h:5557"}, ["kv_events", "'b'", "configured: a", "from --kv-events"]),
        ({"target_fraction": 2.5}, ["target_fraction", "2", "2.5", "from --target-fraction"]),
        ({"target_fraction": 0}, ["target_fraction", "0", "from --target-fraction"]),
    ],
)
def test_a_bad_flag_is_named_with_its_value_and_choices(tmp_path, flags, fragments):
    message = error_of(tmp_path, **flags)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("policy: prefix_afinity\n", ["'prefix_afinity'", "choose one of prefix_affinity", "in "]),
        ("tokenization: {kind: hf}\n", ["tokenization.path is required with kind 'hf'", "tiktoken"]),
        ("tokenization: {kind: hf, path: /nowhere}\n", ["'/nowhere' holds no tokenizer.json"]),
        ("tokenization: {kind: sentencepiece}\n", ["tokenization.kind", "'tiktoken', 'hf' or 'backend'"]),
        ("tokenization: {hash_algo: md5}\n", ["tokenization.hash_algo", "sha256", "'md5'"]),
        ("canonical: {rules: {volatile_date: {mode: weekly}}}\n", ["canonical.rules.volatile_date.mode"]),
        ("canonical: {rules: {no_such_rule: {}}}\n", ["canonical.rules.no_such_rule"]),
    ],
)
def test_a_bad_file_value_is_named_with_the_file(tmp_path, text, fragments):
    message = error_of(tmp_path, text)
    for fragment in fragments:
        assert fragment in message, message
    assert str(tmp_path / "prefixgate.yaml") in message


def test_a_budget_past_the_pool_is_accepted_up_to_twice_it():
    """Above 1 the budget seats more sessions than their projected peaks fit: an operator's choice
    (docs/investigations.md, "A budget of the whole pool, or more"), bounded at 2."""
    settings = load_settings(flags={"target_fraction": 1.2}, backend_specs=["a=" + RANK], environ={})
    assert settings.target_fraction == 1.2


def test_an_environment_value_names_its_variable():
    with pytest.raises(ConfigError, match=r"retries: .*'x'.*\(from PREFIXGATE_RETRIES\)"):
        load_settings(environ={"PREFIXGATE_RETRIES": "x", "PREFIXGATE_BACKENDS": RANK})


def test_a_yaml_error_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("port: 8000\nbackends: [\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    message = str(caught.value)
    assert f"{path}, line 3, column 1" in message and "<unicode string>" not in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--policy", "fastest"], "unknown routing policy 'fastest'; choose one of prefix_affinity"),
        (["--log-level", "verbose"], "unknown log level 'verbose'"),
        (["--kv-events", "nonsense"], "kv_events entry 'nonsense'"),
        (["--state", "etcd"], "unknown state backend 'etcd'; choose one of memory, redis"),
    ],
)
def test_serve_exits_2_with_one_line(args, fragment):
    result = serve("--backend", RANK, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("prefixgate: ") and fragment in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_serve_exits_2_for_hf_without_a_path(tmp_path):
    config = tmp_path / "hf.yaml"
    config.write_text(f"backends: [{{name: a, url: '{RANK}'}}]\ntokenization: {{kind: hf}}\n")
    result = serve("--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "tokenization.path is required" in result.stderr


def test_an_unknown_flag_names_the_commands_flag_it_meant(capsys):
    # issue 49: the command's own flag and help, in two lines (no longer its whole usage first)
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--backend", RANK, "--polcy", "round_robin"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and err.count("\n") == 2
    assert (
        "prefixgate serve: error: unrecognized arguments: --polcy round_robin (did you mean --policy" in err
    )
    assert "run 'prefixgate serve --help' for the options" in err


def test_serve_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for fragment in (
        "port to listen on, 0 for one the system picks (the log names it) "
        "(default 8000; env PREFIXGATE_PORT)",
        "(default prefix_affinity; env PREFIXGATE_POLICY)",
        "(default 1.0; env PREFIXGATE_TARGET_FRACTION)",
        "(default 30.0; env PREFIXGATE_ADMISSION_WAIT)",
    ):
        assert fragment in text


def test_a_port_in_use_is_named_with_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve("--backend", RANK, "--port", str(port))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr and "--port" in result.stderr


def test_kv_events_auto_without_sources_warns(rank_servers, caplog):
    ranks = rank_servers.stub(2)  # stub ranks answer 404 at /kv_event_sources
    with caplog.at_level(logging.WARNING, logger="prefixgate.routing"):
        server = start_gateway(ranks, kv_events="auto")
        server.stop()
    warnings = [r.getMessage() for r in caplog.records if r.name == "prefixgate.routing"]
    # one sentence per rank, each naming it: both are up, so vLLM's flags are the likely cause
    for rank in ("stub-0", "stub-1"):
        assert [w for w in warnings if f"rank {rank} is up but reports no KV-event source" in w] == [
            f"kv_events auto: rank {rank} is up but reports no KV-event source (GET /kv_event_sources "
            "answered none; vLLM reports one when started with --kv-events-config and endpoint "
            "tcp://*:0), so it is not mirrored exactly"
        ], warnings


def test_port_0_is_served_on_the_port_the_system_chose_and_the_log_names_it():
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--backend", RANK, "--port", "0", "--log-level", "info"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", "".join(lines))
        assert found, "".join(lines)
        port = int(found.group(1))
        assert port != 0
        # the line comes as the app starts up; the port answers once it has
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200,
            "nothing answered on the port the log named",
            60,
            0.1,
            retry_on=(httpx.TransportError,),
        )
    finally:
        proc.terminate()
        proc.wait(30)
