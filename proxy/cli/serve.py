"""``prefixgate serve``: run the proxy in front of the configured ranks."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, cast

from proxy.config import OPTIONS, ConfigError, load_settings

DESCRIPTION = """\
Run prefixgate, an OpenAI-compatible proxy, in front of vLLM ranks.

Settings come from (in rising precedence) the YAML --config file, PREFIXGATE_* environment
variables (PREFIXGATE_BACKENDS=name=url,name=url; PREFIXGATE_PORT=...; one per option below),
and these flags.
"""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--backend",
        action="append",
        metavar="[NAME=]URL",
        help="a vLLM rank, e.g. http://127.0.0.1:8001 or gpu0=http://10.0.0.5:8000 "
        "(repeat for each rank; replaces the config file's backends; env PREFIXGATE_BACKENDS)",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file (env PREFIXGATE_CONFIG)")
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="a client API key, labelled key-0, key-1, ... (repeatable; requests then need one; "
        "env PREFIXGATE_API_KEYS comma-separated; prefer --api-keys-file, flags show in ps)",
    )
    for option in OPTIONS:
        if option.type is bool:
            parser.add_argument(
                option.flag,
                dest=option.field,
                action="store_true",
                default=None,
                help=f"{option.help} (env {option.env})",
            )
            continue
        parser.add_argument(
            option.flag,
            dest=option.field,
            type=option.type,
            default=None,
            metavar=option.field.upper(),
            help=f"{option.help} (env {option.env})",
        )


def run(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from proxy.app import create_app
    from proxy.server import prepare_process, serving_options, uvicorn_config

    config_file = args.config or os.environ.get("PREFIXGATE_CONFIG")
    flags = {option.field: getattr(args, option.field) for option in OPTIONS}
    try:
        settings = load_settings(config_file, flags, args.backend, api_keys=args.api_key)
    except ConfigError as exc:
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 2
    if not settings.backends:
        print(
            "prefixgate: no backends configured: pass --backend URL (repeatable), "
            "set PREFIXGATE_BACKENDS or list them under 'backends:' in --config",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = create_app(settings)
    except ConfigError as exc:
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 2
    prepare_process()
    config = uvicorn_config(
        app, settings.host, settings.port, settings.log_level, settings.event_loop, serving_options(app)
    )
    # SIGTERM: uvicorn stops listening, lets in-flight requests (streams too) finish up to this
    # deadline, then cancels them and runs the app's shutdown
    # (uvicorn annotates it int; it is a number of seconds handed to asyncio.wait_for, so a float works)
    config.timeout_graceful_shutdown = cast(Any, settings.shutdown_timeout)
    server = uvicorn.Server(config)
    server.run()
    return 0
