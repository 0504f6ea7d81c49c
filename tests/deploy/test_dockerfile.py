"""The Dockerfile, checked without a Docker engine (none can run on this machine: the docker CLI has no
daemon, and the base image comes from Docker Hub, which is out of reach). What the image build does is
reproduced instead: the files its COPY lines bring, built by pip as its RUN line builds them; and what
the image runs (its ENTRYPOINT and CMD, and the compose services built from it) is parsed by the
prefixgate command's own parsers."""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import COMMANDS
from proxy.config import Settings

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (KEYWORD, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def only(keyword: str) -> str:
    (found,) = [rest for kw, rest in instructions() if kw == keyword]
    return found


def copied() -> list[str]:
    """The sources of every COPY (none from another stage)."""
    sources = []
    for keyword, rest in instructions():
        if keyword == "COPY":
            assert not rest.startswith("--from"), rest
            sources.extend(rest.split()[:-1])
    return sources


def parse_command(argv: list[str]) -> argparse.Namespace:
    """``prefixgate ARGV`` parsed by the subcommand's own parser (an unknown flag fails)."""
    command, *flags = argv
    assert command in COMMANDS, f"prefixgate has no subcommand {command!r}"
    parser = argparse.ArgumentParser(prog=f"prefixgate {command}", exit_on_error=False)
    importlib.import_module(COMMANDS[command][0]).configure_parser(parser)
    return parser.parse_args(flags)


def test_every_copy_source_exists_and_every_package_is_copied() -> None:
    sources = copied()
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    assert "pyproject.toml" in sources and PYPROJECT["project"]["readme"] in sources
    includes = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    wanted = {p for p in packages if any(re.fullmatch(i.replace("*", ".*"), p) for i in includes)}
    assert wanted and wanted <= set(sources), wanted - set(sources)


def test_the_build_context_leaves_out_the_local_venv_and_keeps_what_is_copied() -> None:
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".git", ".venv", "**/__pycache__"} <= set(ignored)
    for source in copied():
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source


def test_the_base_image_has_a_python_the_project_supports() -> None:
    base = only("FROM")
    version = re.fullmatch(r"python:(\d+)\.(\d+)[\w.-]*", base)
    assert version is not None, base
    minimum = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minimum is not None
    assert (int(version[1]), int(version[2])) >= (int(minimum[1]), int(minimum[2]))


def test_the_image_runs_prefixgate_serve_on_the_port_it_exposes() -> None:
    entrypoint = json.loads(only("ENTRYPOINT"))
    assert entrypoint == ["prefixgate"] and "prefixgate" in PYPROJECT["project"]["scripts"]
    args = parse_command(json.loads(only("CMD")))
    assert args.host == "0.0.0.0"  # reachable from outside the container
    assert int(only("EXPOSE")) == args.port == Settings().port


COMPOSE_SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


@pytest.mark.parametrize("name", [n for n, s in COMPOSE_SERVICES.items() if s.get("build") == "."])
def test_each_compose_service_built_from_it_runs_a_known_command(name: str) -> None:
    args = parse_command(COMPOSE_SERVICES[name]["command"])
    assert args.port == int(only("EXPOSE"))


@pytest.mark.skipif(shutil.which("git") is None, reason="git lists the repository's files")
def test_pip_builds_the_image_from_exactly_what_it_copies(tmp_path: Path) -> None:
    """The Dockerfile's ``pip install .``, run on the files its COPY lines bring (no dependencies: the
    build and what it packs is what a missing COPY or a package-data pattern would break)."""
    context = tmp_path / "app"
    context.mkdir()
    tracked = subprocess.run(
        ["git", "ls-files", "--", *copied()], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in tracked:
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, context / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("prefixgate-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = set(archive.namelist())
        (entry_points,) = [n for n in packed if n.endswith(".dist-info/entry_points.txt")]
        assert "prefixgate = proxy.cli:main" in archive.read(entry_points).decode()
    data_patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["*"]
    needed = [
        name
        for name in tracked
        if "/" in name and (name.endswith(".py") or any(Path(name).match(p) for p in data_patterns))
    ]
    assert needed and [name for name in needed if name not in packed] == []
