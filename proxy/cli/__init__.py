"""The ``prefixgate`` command. Each subcommand lives with its package and exposes
``configure_parser(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from proxy.cli.hints import ShortErrorParser, did_you_mean, unknown_flags_message

#: command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("proxy.cli.serve", "run the proxy in front of vLLM ranks"),
    "demo": ("bench.demo", "simulated ranks, prefixgate in front, a short agent workload: see the hits"),
    "bench": ("bench.bench_cmd", "replay agent traces through prefixgate and peer routers, side by side"),
    "sim": ("bench.sim.cli", "run simulated vLLM ranks (prefix cache, KV events, faults)"),
    "tokenize": ("tokenization.cli", "print a request's token and block counts and block hashes"),
    "top": ("proxy.cli.top", "live terminal view of a running prefixgate: hit rates, ranks, sessions"),
    "config-reference": ("proxy.cli.reference", "print the reference of every setting, in Markdown"),
}


def build_parser(only: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The whole command line, or with ``every=False`` only ``only``'s options (the others listed).

    ``main`` builds just the command it runs: each command's module imports its own world (the
    demo and bench load traces and a tokenizer, ~0.6 s), which ``serve`` and ``--help`` never need.
    """
    parser = ShortErrorParser(
        prog="prefixgate",
        description="An OpenAI-compatible proxy that makes coding agents' prompts hit vLLM's prefix cache.",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=ShortErrorParser
    )
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if not every and name != only:
            continue
        module = importlib.import_module(module_name)
        module.configure_parser(command)
        command.set_defaults(handler=module.run, command_parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    command = given[0] if given and given[0] in COMMANDS else None
    parser = build_parser(command, every=False)
    if command is None and given and not given[0].startswith("-"):
        close = did_you_mean(given[0], COMMANDS)
        choices = ", ".join(map(repr, COMMANDS))
        hint = f"; did you mean {close}?" if close else ""
        parser.error(f"argument COMMAND: invalid choice: {given[0]!r} (choose from {choices}){hint}")
    args, unknown = parser.parse_known_args(given)
    if unknown:  # the command's own, not the top level's: its flags are what the user needs
        args.command_parser.error(unknown_flags_message(unknown, args.command_parser))
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
