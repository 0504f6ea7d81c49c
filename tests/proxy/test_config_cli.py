"""Configuration precedence (flags > environment > file) and the ``prefixgate serve`` command."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import httpx
import pytest

from proxy.cli import serve as serve_cmd
from proxy.config import OPTIONS, ConfigError, load_settings
from proxy.server import free_port
from tests.helpers.wait import wait_until


def write(tmp_path, text: str):
    path = tmp_path / "prefixgate.yaml"
    path.write_text(text)
    return path


def test_file_values(tmp_path):
    path = write(
        tmp_path,
        "listen: {host: 127.0.0.2, port: 9001}\n"
        "backends:\n  - {name: a, url: 'http://127.0.0.1:8001/', pool_tokens: 181777}\n"
        "  - {name: b, url: 'http://127.0.0.1:8002', block_size: 32}\n"
        "retries: 2\n",
    )
    settings = load_settings(path, environ={})
    assert (settings.host, settings.port, settings.retries) == ("127.0.0.2", 9001, 2)
    assert [(b.name, b.url, b.pool_tokens, b.block_size) for b in settings.backends] == [
        ("a", "http://127.0.0.1:8001", 181777, None),
        ("b", "http://127.0.0.1:8002", None, 32),
    ]


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    path = write(tmp_path, "port: 9001\nretries: 3\nbackends: [{name: a, url: 'http://127.0.0.1:1'}]\n")
    env = {
        "PREFIXGATE_PORT": "9002",
        "PREFIXGATE_RETRIES": "0",
        "PREFIXGATE_BACKENDS": "x=http://127.0.0.1:2",
    }
    settings = load_settings(path, environ=env)
    assert (settings.port, settings.retries) == (9002, 0)
    assert [b.name for b in settings.backends] == ["x"]
    settings = load_settings(path, flags={"port": 9003}, backend_specs=["http://127.0.0.1:3"], environ=env)
    assert settings.port == 9003 and settings.retries == 0
    assert [(b.name, b.url) for b in settings.backends] == [("rank-0", "http://127.0.0.1:3")]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("backends: [{name: a, url: 'ftp://x'}]", "http(s)"),
        ("backends: [{name: a, url: 'http://x:1'}, {name: a, url: 'http://x:2'}]", "unique"),
        ("port: -1", "port"),
        ("surprise: 1", "surprise"),
        ("- a list", "mapping"),
        ("port: [", "YAML"),
    ],
)
def test_invalid_configuration_is_explained(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_settings(write(tmp_path, text), environ={})


def test_help_documents_every_option():
    serve = argparse.ArgumentParser(prog="prefixgate serve")
    serve_cmd.configure_parser(serve)
    text = serve.format_help()
    for option in OPTIONS:
        assert option.flag in text and option.env in text
    assert "--backend" in text and "--config" in text


def test_serve_without_backends_exits_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")},
    )
    assert result.returncode == 2
    assert "no backends configured" in result.stderr


def test_serve_command_proxies_to_a_rank(rank_servers, tmp_path):
    (rank,) = rank_servers.stub(1)
    port = free_port()
    config = write(tmp_path, f"backends: [{{name: only, url: '{rank.url}'}}]\nport: {port}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def answer() -> httpx.Response | None:
            try:
                return httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "model-0", "messages": [{"role": "user", "content": "hi"}]},
                )
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                return None

        response = wait_until(answer, "prefixgate serve did not start", timeout=30, interval=0.1)
        assert response.status_code == 200
        assert response.headers["x-prefixgate-backend"] == "only"
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (exit by that signal).
    assert proc.returncode in (0, -signal.SIGTERM)
    assert b"Traceback" not in stderr
