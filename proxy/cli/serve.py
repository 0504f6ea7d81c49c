"""``prefixgate serve``: run the proxy in front of the configured ranks."""

from __future__ import annotations

import argparse
import errno
import logging
import sys

from proxy.config import OPTIONS, ConfigError, Option, Settings, load_settings

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
            help=f"{option.help} ({default_of(option)}env {option.env})",
        )


def default_of(option: Option) -> str:
    """``default X; `` for the help text: the value ``Settings`` takes when nothing sets it (the
    flags themselves default to None, so that unset flags do not override the file or environment)."""
    default = Settings.model_fields[option.field].default
    if default is None:
        default = option.starts_at
    if default is None or default == "":
        return ""
    return f"default {default}; "


def run(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from proxy.app import create_app
    from proxy.cli.workers import REUSE_PORT, claim_port, run_workers
    from proxy.server import listen, prepare_process, serving_options, tune_collector, uvicorn_config

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
        if settings.workers > 1 and REUSE_PORT:
            listener = claim_port(settings.host, settings.port)
        else:
            listener = listen(settings.host, settings.port)
    except OSError as exc:
        print(f"prefixgate: {cannot_listen(settings.host, settings.port, exc)}", file=sys.stderr)
        return 2
    if settings.port == 0:  # the system chose one: it is the port the log names and every worker binds
        settings = settings.model_copy(update={"port": listener.getsockname()[1]})
    prepare_process()  # before the workers start: they inherit the raised open-files limit
    if settings.workers > 1:
        try:
            return run_workers(settings, listener)
        except ConfigError as exc:
            print(f"prefixgate: {exc}", file=sys.stderr)
            return 2
    try:
        app = create_app(settings)
    except ConfigError as exc:
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 2
    config = uvicorn_config(
        app,
        settings.host,
        settings.port,
        settings.log_level,
        settings.event_loop,
        serving_options(app),
        graceful_shutdown=settings.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    tune_collector()
    # uvicorn says where it listens only when it binds the socket itself
    logging.getLogger("prefixgate").info(
        "listening on http://%s:%d (dashboard: /dashboard, readiness: /ready)", settings.host, settings.port
    )
    server.run(sockets=[listener])
    return 0


def cannot_listen(host: str, port: int, exc: OSError) -> str:
    """Why ``listen`` failed, naming the flag that fixes it."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another prefixgate, a rank or `prefixgate sim`?): "
            "stop it or choose another port with --port"
        )
    if exc.errno == errno.EACCES:
        return f"not allowed to listen on port {port}: choose a port above 1023 with --port"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}: check --host and --port"
