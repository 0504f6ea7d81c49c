"""The real agent CLIs, run offline against a base URL: Claude Code, Codex CLI, opencode.

They come from the npm registry (``tests/agents/install.sh`` puts them under
``~/.cache/prefixgate/agents``, or ``$PREFIXGATE_AGENTS_DIR``). Each run gets a throwaway ``HOME``
(per agent session, so ``--continue`` finds its own history), the agents' switches for no
telemetry, no update checks and no non-essential traffic, ``IS_SANDBOX=1`` when running as root,
and a working directory (opencode reads it from ``$PWD``). Nothing here reaches past the URL given.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

#: Versions whose request formats the canonicalization rules recognise (see each rule's module).
VERSIONS = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.171.0", "opencode-ai": "1.18.33"}
CLAUDE_MODEL = "claude-opus-4-8"
#: Seconds one CLI run may take (a few requests to a simulated rank).
RUN_TIMEOUT_S = 180.0
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "NO_COLOR": "1",
}


def agents_dir() -> Path:
    return Path(os.environ.get("PREFIXGATE_AGENTS_DIR") or Path.home() / ".cache" / "prefixgate" / "agents")


def binary(name: str) -> Path:
    return agents_dir() / "node_modules" / ".bin" / name


def installed() -> list[str]:
    """The CLIs not installed (empty: all three are)."""
    return [name for name in ("claude", "codex", "opencode") if not binary(name).exists()]


class CliFailed(RuntimeError):
    """An agent CLI exited non-zero or timed out."""


@dataclass
class Workspace:
    """One agent session's directories: its ``HOME`` and working directory."""

    root: Path
    home: Path = field(init=False)
    work: Path = field(init=False)

    def __post_init__(self) -> None:
        self.home = self.root / "home"
        self.work = self.root / "work"
        self.home.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)

    def git_init(self) -> None:
        """Make the working directory a git repository with one commit (Claude Code then sends its
        ``gitStatus``); git runs with the workspace's own HOME, so no user configuration applies."""
        (self.work / "notes.txt").write_text("first line\n", encoding="utf-8")
        git = ["git", "-c", "user.email=agent@example.invalid", "-c", "user.name=agent"]
        git += ["-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false"]
        for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
            done = subprocess.run(
                [*git, *args], cwd=self.work, env=self.env(), capture_output=True, text=True
            )
            if done.returncode != 0:
                raise CliFailed(f"git {args[0]} failed in {self.work}: {done.stderr or done.stdout}")

    def edit(self) -> None:
        with (self.work / "notes.txt").open("a", encoding="utf-8") as out:
            out.write("an edit between prompts\n")

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "PWD": str(self.work),
            "LANG": "C.UTF-8",
            "npm_config_cache": str(agents_dir() / "npm-cache"),
            **QUIET,
            **extra,
        }
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env["IS_SANDBOX"] = "1"  # Claude Code refuses --dangerously-skip-permissions as root otherwise
        return env

    def run(self, argv: list[str], env: dict[str, str]) -> str:
        try:
            done = subprocess.run(
                argv,
                cwd=self.work,
                env=env,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise CliFailed(f"{argv[0]} timed out after {RUN_TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0:
            raise CliFailed(
                f"{Path(argv[0]).name} exited {done.returncode}: {done.stderr[-2000:] or done.stdout[-2000:]}"
            )
        return done.stdout


def claude(ws: Workspace, base_url: str, prompt: str, *, resume: bool = False) -> dict[str, object]:
    """``claude -p PROMPT --output-format json`` (``--continue`` to resume the last session)."""
    # The model named, as a user's settings do: left to its default, Claude Code 2.1.197 describes
    # it as "(1M context)" in the Bash tool the first time and without it once it has a HOME.
    argv = [str(binary("claude")), "-p", prompt, "--model", CLAUDE_MODEL, "--output-format", "json"]
    argv.append("--dangerously-skip-permissions")
    if resume:
        argv.append("--continue")
    out = ws.run(argv, ws.env(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY="sk-prefixgate-tier"))
    result: dict[str, object] = json.loads(out)
    if result.get("is_error"):
        raise CliFailed(f"claude reported an error: {out[-2000:]}")
    return result


def codex(ws: Workspace, base_url: str, prompt: str, *, resume: bool = False) -> str:
    """``codex exec PROMPT`` through a custom provider on the Responses API (``exec resume --last``)."""
    config = ws.home / ".codex" / "config.toml"
    if not config.exists():
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            'model = "sim-model"\nmodel_provider = "tier"\n\n[model_providers.tier]\nname = "tier"\n'
            f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "TIER_API_KEY"\n',
            encoding="utf-8",
        )
    flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    head = [str(binary("codex")), "exec", *flags]
    argv = [*head, "resume", "--last", prompt] if resume else [*head, prompt]
    env = ws.env(CODEX_HOME=str(config.parent), TIER_API_KEY="sk-prefixgate-tier")
    return ws.run(argv, env)


def opencode(ws: Workspace, base_url: str, prompt: str, *, resume: bool = False) -> str:
    """``opencode run PROMPT`` through an OpenAI-compatible provider (``--continue`` to resume)."""
    config = ws.home / ".config" / "opencode" / "opencode.json"
    if not config.exists():
        config.parent.mkdir(parents=True, exist_ok=True)
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "tier",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": "sk-prefixgate-tier"},
            "models": {"sim-model": {"name": "sim-model"}},
        }
        settings = {
            "provider": {"tier": provider},
            "model": "tier/sim-model",
            "autoupdate": False,
            "share": "disabled",
        }
        config.write_text(json.dumps(settings), encoding="utf-8")
    argv = [str(binary("opencode")), "run", prompt]
    if resume:
        argv.append("--continue")
    return ws.run(argv, ws.env())
