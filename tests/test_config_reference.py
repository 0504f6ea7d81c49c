"""docs/configuration.md's reference is `prefixgate config-reference`'s output, and that output names
every flag, variable, file key, `tokenization:` key and canonicalization rule there is."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from proxy.canonical.config import CanonicalConfig
from proxy.canonical.rules import REGISTRY
from proxy.cli import main, serve
from proxy.cli.reference import BEGIN, END, generated_block, reference, splice
from proxy.config import OPTIONS, BackendConfig, Settings, load_settings
from tokenization.config import TokenizerConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


def serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    serve.configure_parser(parser)
    return [action.option_strings[0] for action in parser._actions if action.dest != "help"]


def test_the_doc_carries_the_generators_output_unchanged() -> None:
    # on failure: `prefixgate config-reference --write docs/configuration.md`
    assert generated_block(DOC.read_text()) == reference()


def test_the_reference_names_every_flag_variable_and_file_key() -> None:
    text = reference()
    for flag in serve_flags():
        assert re.search(rf"^\| `{re.escape(flag)}`", text, re.M), flag
    for option in OPTIONS:
        assert f"`{option.env}`" in text, option.env
    for variable in ("PREFIXGATE_BACKENDS", "PREFIXGATE_CONFIG", "PREFIXGATE_API_KEYS"):
        assert f"`{variable}`" in text, variable
    for field in Settings.model_fields:
        if field not in ("tokenization", "canonical"):  # sections of their own, below
            assert f"| `{field}` |" in text, field


def test_the_reference_names_every_section_key_and_rule() -> None:
    text = reference()
    backends = text.split("`backends:` entries", 1)[1]
    for key in BackendConfig.model_fields:
        assert f"| `{key}` |" in backends, key
    tokenization = text.split("`tokenization:` section", 1)[1]
    for key in TokenizerConfig.model_fields:
        assert f"| `{key}` |" in tokenization, key
    canonical = text.split("`canonical:` section", 1)[1]
    for rule in REGISTRY.rules:
        assert f"| `{rule.name}` |" in canonical, rule.name
        for setting in rule.settings.model_fields:
            assert f"`{setting}`:" in canonical.split(f"| `{rule.name}` |", 1)[1].split("\n", 1)[0]


def test_the_docs_prose_names_the_canonical_sections_keys() -> None:
    prose = DOC.read_text().split(BEGIN, 1)[0]
    for key in CanonicalConfig.model_fields:
        assert f"`{key}`" in prose, key


def test_the_docs_example_file_is_a_valid_configuration(tmp_path: Path) -> None:
    example = DOC.read_text().split("```yaml", 1)[1].split("```", 1)[0]
    path = tmp_path / "prefixgate.yaml"
    path.write_text(example)
    settings = load_settings(path, environ={})
    assert [b.name for b in settings.backends] == ["gpu0", "gpu1"]
    assert yaml.safe_load(example)["canonical"]["rules"]["volatile_date"] == {"mode": "move"}


def test_the_command_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == reference()


def test_write_replaces_only_the_generated_block(tmp_path: Path) -> None:
    path = tmp_path / "configuration.md"
    path.write_text(f"# Before\n\n{BEGIN}\n| stale |\n{END}\n\nAfter.\n")
    assert main(["config-reference", "--write", str(path)]) == 0
    written = path.read_text()
    assert written.startswith("# Before\n\n") and written.endswith("\n\nAfter.\n")
    assert "| stale |" not in written and generated_block(written) == reference()
    assert splice(written, reference()) == written  # writing again changes nothing


def test_write_refuses_a_file_without_the_markers(tmp_path: Path) -> None:
    path = tmp_path / "other.md"
    path.write_text("# No block here\n")
    assert main(["config-reference", "--write", str(path)]) == 2
    assert path.read_text() == "# No block here\n"
