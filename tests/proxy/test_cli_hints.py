"""A mistyped flag or command is told in two lines with a "did you mean", not after the command's
whole usage (issue 49: 38 lines of usage before the error for ``serve``)."""

from __future__ import annotations

import pytest

from proxy.cli import main


def error_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


def test_a_mistyped_flag_gets_the_flag_it_meant_and_a_pointer_to_help(capsys):
    lines = error_lines(["serve", "--bakend", "sim-0=http://127.0.0.1:8001"], capsys)
    assert lines == [
        "prefixgate serve: error: unrecognized arguments: --bakend sim-0=http://127.0.0.1:8001 "
        "(did you mean --backend?)",
        "run 'prefixgate serve --help' for the options",
    ]


def test_each_mistyped_flag_is_told_and_a_far_one_gets_no_guess(capsys):
    (line, pointer) = error_lines(["serve", "--redis-ulr=redis://127.0.0.1:6379/0", "--zzzzzz"], capsys)
    assert "--redis-ulr=redis://127.0.0.1:6379/0 (did you mean --redis-url" in line
    assert line.endswith("; --zzzzzz")  # nothing close: no guess
    assert pointer == "run 'prefixgate serve --help' for the options"


def test_another_commands_flags_are_its_own(capsys):
    (line, pointer) = error_lines(["top", "--onec"], capsys)
    assert line == "prefixgate top: error: unrecognized arguments: --onec (did you mean --once?)"
    assert pointer == "run 'prefixgate top --help' for the options"


def test_argparse_errors_are_short_too(capsys):
    lines = error_lines(["serve", "--port", "eighty"], capsys)
    assert lines == [
        "prefixgate serve: error: argument --port: invalid int value: 'eighty'",
        "run 'prefixgate serve --help' for the options",
    ]


def test_a_mistyped_command_gets_the_command_it_meant(capsys):
    (line, pointer) = error_lines(["serv", "--backend", "http://127.0.0.1:8001"], capsys)
    assert line.startswith(
        "prefixgate: error: argument COMMAND: invalid choice: 'serv' (choose from 'serve',"
    )
    assert line.endswith("; did you mean serve?")
    assert pointer == "run 'prefixgate --help' for the options"
