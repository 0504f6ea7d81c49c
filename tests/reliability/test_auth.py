"""Client API keys, the admin token, upstream credentials and body logging, over real HTTP."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from proxy.config import ConfigError
from proxy.ops.auth import KeyRing, bearer_token, read_keys_file
from tests.reliability.conftest import assert_openai_error, chat

KEYS_YAML = """\
keys:
  - {key: sk-alice-0123456789, label: alice, max_sessions: 4}
  - {key: sk-bob-9876543210, label: bob}
"""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_YAML)
    return str(path)


def test_without_keys_everything_stays_open_and_the_client_auth_is_forwarded(rank_servers, gateway):
    (stub,) = rank_servers.stub(1)
    rank = stub.behavior
    proxy = gateway([stub])
    response = httpx.post(proxy.url + "/v1/chat/completions", json=chat(), headers=auth("sk-client"))
    assert response.status_code == 200
    assert rank.received[-1]["headers"]["authorization"] == "Bearer sk-client"
    assert httpx.get(proxy.url + "/metrics").status_code == 200


def test_keys_file_gates_requests_with_401_openai_errors(rank_servers, gateway, keys_file):
    (stub,) = rank_servers.stub(1)
    rank = stub.behavior
    proxy = gateway([stub], api_keys_file=keys_file)
    url = proxy.url + "/v1/chat/completions"
    for headers in (
        {},
        auth("sk-alice-012345678"),
        auth("sk-alice-0123456789x"),
        {"Authorization": "Basic x"},
    ):
        response = httpx.post(url, json=chat(), headers=headers)
        error = assert_openai_error(response, 401)
        assert error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert rank.received == []  # nothing reached the rank
    for key in ("sk-alice-0123456789", "sk-bob-9876543210"):
        assert httpx.post(url, json=chat(), headers=auth(key)).status_code == 200
        assert httpx.get(proxy.url + "/v1/models", headers=auth(key)).status_code == 200
    assert_openai_error(httpx.get(proxy.url + "/v1/models"), 401)
    assert httpx.get(proxy.url + "/health").status_code == 200  # probes need no key
    # the client's key is not forwarded to the rank
    assert all("authorization" not in r["headers"] for r in rank.received)


def test_metrics_and_logs_carry_the_label_never_the_key(rank_servers, gateway, keys_file, caplog):
    (stub,) = rank_servers.stub(1)
    proxy = gateway([stub], api_keys_file=keys_file)
    with caplog.at_level(logging.DEBUG):
        httpx.post(proxy.url + "/v1/chat/completions", json=chat(), headers=auth("sk-alice-0123456789"))
        httpx.post(proxy.url + "/v1/chat/completions", json=chat(), headers=auth("sk-wrong"))
        metrics = httpx.get(proxy.url + "/metrics", headers=auth("sk-bob-9876543210")).text
    assert 'prefixgate_client_requests_total{client="alice"} 1.0' in metrics
    assert 'prefixgate_auth_rejections_total{reason="invalid"} 1.0' in metrics
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "alice" in logged
    for secret in ("sk-alice-0123456789", "sk-bob-9876543210", "sk-wrong"):
        assert secret not in logged and secret not in metrics


def test_label_and_session_cap_reach_the_request_state(keys_file):
    from proxy.ops.auth import AuthMiddleware

    ring = KeyRing(read_keys_file(keys_file))
    seen: dict = {}

    async def app(scope, receive, send):
        seen.update(scope["state"], headers=dict(scope["headers"]))

    import asyncio

    middleware = AuthMiddleware(app, ring)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", b"Bearer sk-alice-0123456789"), (b"x-other", b"1")],
    }
    asyncio.run(middleware(scope, None, None))
    assert seen["client_label"] == "alice" and seen["client"].max_sessions == 4
    assert seen["is_admin"] is False
    assert seen["headers"] == {b"x-other": b"1"}  # the client's key is gone before the pipeline


def test_admin_token_guards_metrics_and_admin_paths_only(rank_servers, gateway, keys_file):
    (stub,) = rank_servers.stub(1)
    proxy = gateway([stub], api_keys_file=keys_file, admin_token="admin-secret")
    alice = auth("sk-alice-0123456789")
    assert_openai_error(httpx.get(proxy.url + "/metrics"), 401)
    assert_openai_error(httpx.get(proxy.url + "/metrics", headers=alice), 401)  # client keys are not admin
    assert httpx.get(proxy.url + "/metrics", headers=auth("admin-secret")).status_code == 200
    # the admin token is no client key
    assert_openai_error(
        httpx.post(proxy.url + "/v1/chat/completions", json=chat(), headers=auth("admin-secret")), 401
    )
    # /admin/*: the admin token, or a client key (the admin API then shows that client its own sessions)
    assert_openai_error(httpx.get(proxy.url + "/admin/sessions"), 401)
    assert httpx.get(proxy.url + "/admin/sessions", headers=alice).status_code != 401
    assert httpx.get(proxy.url + "/admin/sessions", headers=auth("admin-secret")).status_code != 401


def test_admin_token_without_client_keys(rank_servers, gateway):
    (stub,) = rank_servers.stub(1)
    proxy = gateway([stub], admin_token="admin-secret")
    assert httpx.post(proxy.url + "/v1/chat/completions", json=chat()).status_code == 200
    assert_openai_error(httpx.get(proxy.url + "/metrics"), 401)
    assert_openai_error(httpx.get(proxy.url + "/admin/x", headers=auth("nope")), 401)
    assert httpx.get(proxy.url + "/metrics", headers=auth("admin-secret")).status_code == 200


def test_upstream_key_replaces_the_clients_unless_forwarding_is_asked(rank_servers, gateway):
    (stub,) = rank_servers.stub(1)
    rank = stub.behavior
    plain = gateway([stub], upstream_api_key="rank-secret")
    forwarding = gateway([stub], upstream_api_key="rank-secret", forward_client_auth=True)
    httpx.post(plain.url + "/v1/chat/completions", json=chat(), headers=auth("sk-client"))
    assert rank.received[-1]["headers"]["authorization"] == "Bearer rank-secret"
    httpx.post(plain.url + "/v1/chat/completions", json=chat())
    assert rank.received[-1]["headers"]["authorization"] == "Bearer rank-secret"
    httpx.post(forwarding.url + "/v1/chat/completions", json=chat(), headers=auth("sk-client"))
    assert rank.received[-1]["headers"]["authorization"] == "Bearer sk-client"
    httpx.post(forwarding.url + "/v1/chat/completions", json=chat())
    assert rank.received[-1]["headers"]["authorization"] == "Bearer rank-secret"


def test_repeatable_api_key_flag_and_forward_client_auth(rank_servers, gateway):
    (stub,) = rank_servers.stub(1)
    rank = stub.behavior
    proxy = gateway([stub], api_keys=["k-one", "k-two"], forward_client_auth=True)
    assert_openai_error(httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}), 401)
    response = httpx.post(
        proxy.url + "/v1/completions", json={"model": "m", "prompt": "x"}, headers=auth("k-two")
    )
    assert response.status_code == 200
    assert rank.received[-1]["headers"]["authorization"] == "Bearer k-two"


def test_bodies_are_logged_only_with_log_bodies(rank_servers, gateway, caplog):
    (stub,) = rank_servers.stub(1)
    quiet = gateway([stub], log_level="debug")
    loud = gateway([stub], log_bodies=True)
    secret_prompt = "the launch code is 0451"
    with caplog.at_level(logging.DEBUG):
        for stream in (False, True):
            httpx.post(quiet.url + "/v1/chat/completions", json=chat(secret_prompt, stream=stream))
    assert not any(secret_prompt in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prefixgate.bodies"):
        httpx.post(loud.url + "/v1/chat/completions", json=chat(secret_prompt, stream=True))
    (record,) = [r for r in caplog.records if r.name == "prefixgate.bodies"]
    assert secret_prompt in record.getMessage() and "data: [DONE]" in record.getMessage()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- {key: a}", "'label'"),
        ("- {key: '', label: x}", "'key'"),
        ("- {key: a, label: x, max_sessions: 0}", "max_sessions"),
        ("- {key: a, label: x, role: admin}", "unknown fields"),
        ("- {key: a, label: x}\n- {key: a, label: y}", "same as the key"),
        ("key: a", "must hold a list"),
        ("[{", "neither YAML nor JSON"),
    ],
)
def test_bad_keys_files_are_refused_with_a_clear_message(tmp_path, text, fragment):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        KeyRing(read_keys_file(path))


def test_keys_file_may_be_json(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "k1", "label": "ci", "max_sessions": 2}]))
    ring = KeyRing(read_keys_file(path))
    found = ring.match(b"k1")
    assert found is not None and found.label == "ci" and found.max_sessions == 2
    assert ring.match(b"k2") is None and ring.get("ci") is found


def test_bearer_token_parsing():
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"authorization", b"bearer  abc ")]) == b"abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([(b"authorization", b"Bearer ")]) is None
    assert bearer_token([(b"x-api-key", b"abc")]) is None
