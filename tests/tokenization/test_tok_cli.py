"""``prefixgate tokenize`` (tokenization/cli.py), called in-process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenization import cli
from tokenization.block_hash import make_hasher
from tokenization.tiktoken_tokenizer import encode, render

BODY = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Explain caching " * 10},
    ],
}


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    return cli.run(parser.parse_args(argv))


def test_json_output_uses_the_config_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(BODY))
    config = tmp_path / "prefixgate.yaml"
    config.write_text(
        "listen: 1\ntokenization:\n  block_size: 8\n  hash_algo: sha256_cbor\n  hash_seed: '0'\n"
    )
    assert _run(["--config", str(config), "--input", str(request), "--json", "--tokens"]) == 0
    out = json.loads(capsys.readouterr().out)
    tokens = encode(render(BODY["messages"]))
    assert out["tokens"] == tokens and out["num_tokens"] == len(tokens) and out["block_size"] == 8
    want = make_hasher("sha256_cbor", 8, "0").hash_blocks(tokens)
    assert out["block_hashes"] == [h.hex() for h in want] and out["num_blocks"] == len(tokens) // 8
    assert out["parts"][0] == ["system", 0, out["parts"][1][1]]


def test_text_output_and_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt": "hello " * 40}))
    assert _run(["--input", str(request)]) == 0
    out = capsys.readouterr().out
    n = len(encode("hello " * 40))
    assert f"tokens: {n}\n" in out and f"blocks: {n // 16} (block size 16, sha256)" in out


@pytest.mark.parametrize(
    ("content", "config", "message"),
    [
        ("not json", None, "prefixgate tokenize"),
        ('{"messages": "x"}', None, "messages"),
        ("{}", "tokenization:\n  hash_algo: md5\n", "hash_algo"),
    ],
)
def test_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, config: str | None, message: str
) -> None:
    request = tmp_path / "request.json"
    request.write_text(content)
    argv = ["--input", str(request)]
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "c.yaml")]
    assert _run(argv) == 2
    assert message in capsys.readouterr().err


def test_the_request_file_may_be_named_without_a_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt": "hello " * 40}))
    assert _run([str(request)]) == 0
    n = len(encode("hello " * 40))
    assert f"tokens: {n}\n" in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text("{}")
    assert _run([str(request), "--input", str(other)]) == 2
    assert "two request files given" in capsys.readouterr().err
