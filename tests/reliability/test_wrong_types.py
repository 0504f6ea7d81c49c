"""Fields of the wrong type (finding 7): a list or an object where the API wants a string is the
client's error, answered 400 in the API's error shape (or served, when the field does not matter to
a rank), never a 500 from a ``TypeError`` deep in the renderer, and the connection stays usable."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.reliability.conftest import SIM_MODEL

WRONG = [["system"], {"role": "system"}]


def assert_client_error_or_served(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error, dict) and isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize("role", WRONG, ids=["list", "object"])
def test_a_role_of_the_wrong_type(rank_servers, gateway, role: Any) -> None:
    (rank,) = rank_servers.sim(1)
    proxy = gateway([rank])
    messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for path in ("/v1/chat/completions", "/v1/messages"):
            body = {"model": SIM_MODEL, "max_tokens": 4, "messages": messages}
            assert_client_error_or_served(client.post(path, json=body))
        # the same connection then serves a well-formed request
        ok = client.post("/v1/chat/completions", json={**body, "messages": messages[1:]})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("wrong", WRONG, ids=["list", "object"])
def test_a_responses_item_role_or_part_type_of_the_wrong_type(rank_servers, gateway, wrong: Any) -> None:
    (rank,) = rank_servers.sim(1)
    proxy = gateway([rank])
    items = [
        {"role": "user", "content": [{"type": wrong, "text": "hi"}]},
        {"role": wrong, "content": [{"type": "input_text", "text": "hi"}]},
    ]
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for item in items:
            response = client.post(
                "/v1/responses", json={"model": SIM_MODEL, "max_output_tokens": 4, "input": [item]}
            )
            assert_client_error_or_served(response)
        well_formed = {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ok = client.post(
            "/v1/responses", json={"model": SIM_MODEL, "max_output_tokens": 4, "input": [well_formed]}
        )
        assert ok.status_code == 200, ok.text
