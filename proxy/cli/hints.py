"""Command-line mistakes told in two lines: the error with a "did you mean" when a flag or command
is close to one that exists, and where the options are listed. argparse's own error first printed
the command's whole usage (38 lines for ``serve``), burying the one line that mattered."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """The choices close to ``word`` (``X`` or ``X or Y``); empty when none is."""
    return " or ".join(difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6))


def unknown_flags_message(unknown: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """What ``parser`` did not recognize, each mistyped flag (with the values after it) followed by
    the flags it is close to."""
    options = [flag for action in parser._actions for flag in action.option_strings]
    groups: list[list[str]] = []
    for arg in unknown:
        if arg.startswith("-") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    parts = []
    for group in groups:
        flag = group[0].split("=", 1)[0]
        close = did_you_mean(flag, options) if flag.startswith("-") else ""
        parts.append(" ".join(group) + (f" (did you mean {close}?)" if close else ""))
    return f"unrecognized arguments: {'; '.join(parts)}"


class ShortErrorParser(argparse.ArgumentParser):
    """A parser whose errors are the message and a pointer to ``--help``, not the usage."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.stderr.write(f"run '{self.prog} --help' for the options\n")
        sys.exit(2)
