"""``prefixgate COMMAND`` builds only the command it runs: serve never pays for the demo's imports."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from proxy.cli import COMMANDS, build_parser, main

PROBE = """
import contextlib, io, sys
from proxy.cli import main
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
    main({argv!r})
loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'bench')
print(repr((out.getvalue(), loaded)))
"""


def _run(argv: list[str]) -> tuple[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    output, loaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return output, loaded


def test_serve_help_imports_nothing_of_the_demo_or_the_bench() -> None:
    output, loaded = _run(["serve", "--help"])
    assert "--backend" in output
    assert loaded == []


def test_top_level_help_lists_every_command_without_importing_them() -> None:
    output, loaded = _run(["--help"])
    for name, (_, help_text) in COMMANDS.items():
        assert name in output
        assert help_text.split()[0] in output
    assert loaded == []


def test_the_chosen_command_still_gets_its_own_options_and_handler() -> None:
    output, loaded = _run(["demo", "--help"])
    assert "usage: prefixgate demo" in output
    assert "bench.demo" in loaded


def test_an_unknown_command_is_an_error_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["nope"])
    assert exited.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_whole_parser_still_knows_every_command() -> None:
    parser = build_parser()
    for name in COMMANDS:
        args = parser.parse_args([name] + (["--url", "http://127.0.0.1:1"] if name == "top" else []))
        assert callable(args.handler), name
