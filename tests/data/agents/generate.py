# ruff: noqa: E501  (test data: long literal strings read better unbroken)
"""Writes the agent-shaped multi-turn request sequences in this folder (run: python generate.py).

Original text written for prefixgate, shaped like the real agents of ``specs/agent-requests.md``:
where each puts its volatile fields, how its tools look, and the drift it shows between turns. Each
file: ``{"agent", "drift": [...], "turns": [request, ...]}``; turn N+1 re-sends turn N's messages, the
assistant's reply and the new messages, as the agents do. Deterministic: no clock, no randomness.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def fn(
    name: str, description: str, props: dict[str, Any], required: list[str], **extra: Any
) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    params.update(extra)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def tool_turn(call_id: str, name: str, args: dict[str, Any], result: str) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": None, "tool_calls": [call(call_id, name, args)]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def sequence(
    first: list[dict[str, Any]],
    steps: list[list[dict[str, Any]]],
    system_for,
    tools_for,
    model: str,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Turn i: system_for(i) + first + steps[:i] flattened; each step appends to the history."""
    turns = []
    history = list(first)
    for i in range(len(steps) + 1):
        if i:
            history = history + steps[i - 1]
        body: dict[str, Any] = {"model": model, "messages": system_for(i) + history, "stream": True, **extra}
        tools = tools_for(i)
        if tools is not None:
            body["tools"] = tools
        turns.append(body)
    return turns


# --- Codex CLI: static system prompt, environment in a user message, MCP tools in HashMap order ---------
CODEX_SYSTEM = """You are a coding agent running in a terminal on the user's machine. Be precise, safe and helpful.

## How you work
- Read the code before you change it; keep changes small and focused.
- Use the `apply_patch` tool to edit files. A patch looks like this:

*** Begin Patch
*** Update File: src/app.py
@@ def handler():
-    return None
+    return 200

*** End Patch

- Run the tests that cover your change when the sandbox allows it.
- Never commit or create branches unless asked.

## Final answer
Summarise what changed and where, in a few short bullets."""


def codex_tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    # Codex's Chat Completions wire shape: an extra top-level name, `parameters` before `name`.
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return {
        "type": "function",
        "name": name,
        "function": {"parameters": params, "name": name, "description": description, "strict": False},
    }


def codex() -> dict[str, Any]:
    builtins = [
        codex_tool(
            "shell",
            "Runs a shell command and returns its output.",
            {
                "command": {"type": "array", "items": {"type": "string"}, "description": "argv to run"},
                "workdir": s("Working directory."),
                "timeout_ms": {"type": "number", "description": "Timeout in milliseconds."},
            },
            ["command"],
        ),
        codex_tool(
            "update_plan",
            "Updates the task plan.",
            {
                "explanation": s("Why the plan changed."),
                "plan": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "step": s("A step."),
                            "status": s("pending, in_progress or completed"),
                        },
                        "required": ["step", "status"],
                        "additionalProperties": False,
                    },
                },
            },
            ["plan"],
        ),
        codex_tool(
            "apply_patch", "Applies a patch in the apply_patch format.", {"input": s("The patch.")}, ["input"]
        ),
    ]
    mcp = [
        codex_tool("docs__search", "Searches the project docs.", {"query": s("Search terms.")}, ["query"]),
        codex_tool("docs__fetch", "Fetches one docs page.", {"path": s("Page path.")}, ["path"]),
        codex_tool(
            "tracker__open_issue", "Opens an issue.", {"title": s("Title."), "body": s("Body.")}, ["title"]
        ),
    ]
    # HashMap iteration order differs between processes / turns (the regression the table describes).
    mcp_orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 1, 0], [0, 2, 1]]
    env = (
        "<environment_context>\n  <cwd>/home/ana/src/ledger</cwd>\n  <approval_policy>on-request</approval_policy>\n"
        "  <sandbox_mode>workspace-write</sandbox_mode>\n  <network_access>restricted</network_access>\n"
        "  <shell>zsh</shell>\n</environment_context>"
    )
    first = [
        {"role": "user", "content": env},
        {"role": "user", "content": "The CSV export drops the header row. Fix it."},
    ]
    steps = [
        tool_turn(
            "call_1",
            "shell",
            {"command": ["rg", "-n", "write_header", "src"]},
            "src/export.py:41: write_header=False",
        ),
        tool_turn(
            "call_2",
            "shell",
            {"command": ["sed", "-n", "30,60p", "src/export.py"]},
            "def export(rows, out):\n    w = csv.writer(out)\n",
        ),
        tool_turn(
            "call_3",
            "apply_patch",
            {
                "input": "*** Begin Patch\n*** Update File: src/export.py\n@@\n-    write_header=False\n+    write_header=True\n*** End Patch"
            },
            "Done.",
        ),
        [
            {"role": "assistant", "content": "Fixed: the exporter now writes the header row."},
            {"role": "user", "content": "Add a test for it."},
        ],
    ]
    turns = sequence(
        first,
        steps,
        lambda i: [{"role": "system", "content": CODEX_SYSTEM}],
        lambda i: builtins + [mcp[j] for j in mcp_orders[i]],
        "gpt-oss-20b",
        prompt_cache_key="0199a1c2-codex-conv",
    )
    return {
        "agent": "codex",
        "drift": [
            "MCP tools in a different order every turn",
            "wire shape: parameters before name, extra top-level name",
        ],
        "turns": turns,
    }


# --- Claude Code (converted to chat form): billing line first, <env> with the date, MCP connect -----------
CLAUDE_INTRO = """You are an interactive command-line assistant for software engineering work.
Keep answers short. Prefer editing existing files over creating new ones.
When you reference code, give file_path:line_number."""


def claude_env(date: str) -> str:
    return (
        "Here is useful information about the environment you are running in:\n<env>\n"
        "Working directory: /Users/kim/work/atlas\nIs directory a git repo: Yes\nPlatform: darwin\n"
        f"OS Version: Darwin 24.1.0\nToday's date: {date}\n</env>\n\n"
        "gitStatus: This is the git status at the start of the conversation.\nCurrent branch: fix/retry\n\n"
        "Status:\nM src/retry.ts"
    )


def claude_code() -> dict[str, Any]:
    billing = [
        "x-anthropic-billing-header: cc_version=2.1.30.4c1; cc_entrypoint=cli; cch=5d21e;",
        "x-anthropic-billing-header: cc_version=2.1.30.9ab; cc_entrypoint=cli; cch=08f3c;",
        "x-anthropic-billing-header: cc_version=2.1.30.e07; cc_entrypoint=cli; cch=c4410;",
        "x-anthropic-billing-header: cc_version=2.1.30.31d; cc_entrypoint=cli; cch=7a9b2;",
        "x-anthropic-billing-header: cc_version=2.1.30.b58; cc_entrypoint=cli; cch=e1d07;",
    ]

    def system_for(i: int) -> list[dict[str, Any]]:
        return [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": billing[i]},
                    {"type": "text", "text": CLAUDE_INTRO, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": claude_env("2025-11-03")},
                ],
            }
        ]

    def schema(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        }

    def tool(name: str, desc: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": name, "description": desc, "parameters": schema(props, required)},
        }

    base = [
        tool(
            "Bash",
            "Runs a bash command.",
            {"command": s("The command."), "timeout": {"type": "number"}},
            ["command"],
        ),
        tool(
            "Read",
            "Reads a file.",
            {"file_path": s("Absolute path."), "offset": {"type": "number"}},
            ["file_path"],
        ),
        tool(
            "Edit",
            "Replaces text in a file.",
            {
                "file_path": s("Absolute path."),
                "old_string": s("Text to find."),
                "new_string": s("Replacement."),
            },
            ["file_path", "old_string", "new_string"],
        ),
        tool(
            "Grep",
            "Searches file contents.",
            {"pattern": s("Regex."), "path": s("Where to search.")},
            ["pattern"],
        ),
    ]
    mcp = [
        tool("mcp__linear__list_issues", "Lists issues.", {"team": s("Team key.")}, []),
        tool(
            "mcp__linear__create_issue",
            "Creates an issue.",
            {"title": s("Title."), "team": s("Team key.")},
            ["title"],
        ),
    ]

    def reserialized(t: dict[str, Any]) -> dict[str, Any]:
        # After the MCP reconnect the SDK re-serializes the schema: `$schema` first, `required` last.
        p = t["function"]["parameters"]
        order = ["$schema", "type", "additionalProperties", "properties", "required"]
        return {
            "type": "function",
            "function": {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "parameters": {k: p[k] for k in order},
            },
        }

    def tools_for(i: int) -> list[dict[str, Any]]:
        if i < 2:
            return base
        if i == 2:
            return base + mcp  # MCP server connected mid-session
        # reconnected: other order, other key order
        return [*base, reserialized(mcp[1]), reserialized(mcp[0])]

    first = [{"role": "user", "content": "Retries in src/retry.ts never back off. Please fix."}]
    steps = [
        tool_turn(
            "toolu_01",
            "Grep",
            {"pattern": "retry\\(", "path": "src"},
            "src/retry.ts:12: export async function retry(",
        ),
        tool_turn(
            "toolu_02",
            "Read",
            {"file_path": "/Users/kim/work/atlas/src/retry.ts"},
            "1\texport async function retry(fn, n) {\n2\t  for (;;) {",
        ),
        tool_turn(
            "toolu_03",
            "Edit",
            {
                "file_path": "/Users/kim/work/atlas/src/retry.ts",
                "old_string": "await fn()",
                "new_string": "await sleep(2 ** i * 100); await fn()",
            },
            "Edited.",
        ),
        [
            {"role": "assistant", "content": "Backoff added: 100 ms doubling per attempt."},
            {"role": "user", "content": "File a Linear issue to add jitter later."},
        ],
    ]
    turns = sequence(first, steps, system_for, tools_for, "claude-sonnet-4-5", user="session_7f3a")
    return {
        "agent": "claude_code",
        "drift": [
            "billing header line (cc_version suffix, cch) changes every request",
            "MCP server connects mid-session, then reconnects with other tool order and schema key order",
        ],
        "turns": turns,
    }


# --- Cline (native tools): SYSTEM INFORMATION in the system prompt, time to the second per user message --
CLINE_SYSTEM = """You are Cline, a software engineer with broad knowledge of languages and frameworks.

====

TOOL USE

Use one tool per message and wait for its result before the next step.

====

RULES

- The current working directory is /home/lee/projects/shop; you cannot cd elsewhere.
- Do not ask for more information than you need.

====

SYSTEM INFORMATION

Operating System: Linux 6.8
IDE: Visual Studio Code
Default Shell: /bin/bash
Home Directory: /home/lee
Current Working Directory: /home/lee/projects/shop

====

OBJECTIVE

Work through the task step by step and finish with attempt_completion."""


def cline_env(when: str) -> str:
    return (
        "<environment_details>\n# Visual Studio Code Visible Files\nsrc/cart.ts\n\n"
        f"# Current Time\n{when} (Europe/Berlin, UTC+1:00)\n\n# Context Window Usage\n18,204 / 200K tokens used (9%)\n"
        "</environment_details>"
    )


def cline() -> dict[str, Any]:
    tools = [
        fn(
            "execute_command",
            "Runs a CLI command in /home/lee/projects/shop.",
            {"command": s("The command."), "requires_approval": {"type": "boolean"}},
            ["command", "requires_approval"],
        ),
        fn(
            "read_file",
            "Reads a file relative to /home/lee/projects/shop.",
            {"path": s("File path.")},
            ["path"],
        ),
        fn(
            "replace_in_file",
            "Applies SEARCH/REPLACE blocks to a file.",
            {"path": s("File path."), "diff": s("The blocks.")},
            ["path", "diff"],
        ),
        fn("attempt_completion", "Presents the result.", {"result": s("What was done.")}, ["result"]),
    ]
    mcp = [
        fn("a81c3f20mcp0search_docs", "docs-server: Searches docs.", {"q": s("Query.")}, ["q"]),
        fn("a81c3f20mcp0get_page", "docs-server: Gets a page.", {"url": s("Page URL.")}, ["url"]),
    ]

    def tools_for(i: int) -> list[dict[str, Any]]:
        return tools + (mcp if i < 3 else mcp[::-1])  # MCP hub rediscovered the server: other order

    def user(text: str, when: str) -> dict[str, Any]:
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": f"<task>\n{text}\n</task>" if "Fix" in text else text},
                {"type": "text", "text": cline_env(when)},
            ],
        }

    first = [user("Fix the cart total rounding.", "11/3/2025, 9:14:07 AM")]
    steps = [
        [
            *tool_turn(
                "c1",
                "read_file",
                {"path": "src/cart.ts"},
                "export const total = (xs) => xs.reduce((a, b) => a + b, 0)",
            ),
            user("[read_file] Result above.", "11/3/2025, 9:14:19 AM"),
        ],
        [
            *tool_turn(
                "c2",
                "replace_in_file",
                {
                    "path": "src/cart.ts",
                    "diff": "------- SEARCH\n, 0)\n=======\n, 0) / 100 * 100\n+++++++ REPLACE",
                },
                "Applied.",
            ),
            user("[replace_in_file] Applied.", "11/3/2025, 9:15:02 AM"),
        ],
        [
            *tool_turn(
                "c3", "execute_command", {"command": "npm test", "requires_approval": False}, "12 passing"
            ),
            user("[execute_command] Done.", "11/3/2025, 9:15:48 AM"),
        ],
        tool_turn("c4", "attempt_completion", {"result": "Rounded totals to cents."}, "ok"),
    ]
    turns = sequence(
        first, steps, lambda i: [{"role": "system", "content": CLINE_SYSTEM}], tools_for, "claude-4-5-sonnet"
    )
    return {
        "agent": "cline",
        "drift": [
            "current time to the second in every new user message (user side, left alone)",
            "MCP tools rediscovered in another order",
        ],
        "turns": turns,
    }


# --- opencode: two system messages, <env> with toDateString, midnight mid-session, MCP order after restart ---
OPENCODE_STATIC = """You are opencode, an agent that helps users with software engineering tasks in their terminal.

Be concise. Use the tools to read and change code; verify with the project's tests.
Follow the conventions you find in the codebase."""


def opencode_env(date: str) -> str:
    return (
        "Here is some useful information about the environment you are running in:\n<env>\n"
        "  Working directory: /srv/app\n  Is directory a git repo: yes\n  Platform: linux\n"
        f"  Today's date: {date}\n</env>\n<project>\n  app/\n\tmain.py\n\tdb.py\ntests/\n\ttest_db.py\n</project>"
    )


def opencode() -> dict[str, Any]:
    def tool(name: str, desc: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": desc,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": required,
                    "additionalProperties": False,
                    "$schema": "http://json-schema.org/draft-07/schema#",
                },
            },
        }

    tools = [
        tool(
            "bash", "Runs a command.", {"command": s("Command."), "timeout": {"type": "number"}}, ["command"]
        ),
        tool(
            "edit",
            "Edits a file.",
            {"filePath": s("Path."), "oldString": s("Old."), "newString": s("New.")},
            ["filePath", "oldString", "newString"],
        ),
        tool("read", "Reads a file.", {"filePath": s("Path.")}, ["filePath"]),
    ]
    mcp = [
        tool("pg_query", "Runs a read-only SQL query.", {"sql": s("SQL.")}, ["sql"]),
        tool("pg_schema", "Shows a table schema.", {"table": s("Table.")}, ["table"]),
    ]
    dates = ["Mon Nov 03 2025", "Mon Nov 03 2025", "Mon Nov 03 2025", "Tue Nov 04 2025", "Tue Nov 04 2025"]

    def system_for(i: int) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": OPENCODE_STATIC},
            {"role": "system", "content": opencode_env(dates[i])},
        ]

    def tools_for(i: int) -> list[dict[str, Any]]:
        return tools + (mcp if i < 2 else mcp[::-1])  # restarted: MCP discovery order changed

    first = [{"role": "user", "content": "Why does tests/test_db.py hang?"}]
    steps = [
        tool_turn(
            "t1", "read", {"filePath": "/srv/app/tests/test_db.py"}, "def test_conn(db):\n    db.connect()"
        ),
        tool_turn(
            "t2", "bash", {"command": "pytest -x tests/test_db.py --timeout 5"}, "Timeout in db.connect"
        ),
        [
            {"role": "assistant", "content": "db.connect() waits for a server that the tests never start."},
            {"role": "user", "content": "Make the fixture start one."},
        ],
        tool_turn(
            "t3",
            "edit",
            {"filePath": "/srv/app/tests/conftest.py", "oldString": "", "newString": "import pytest\n"},
            "ok",
        ),
    ]
    turns = sequence(first, steps, system_for, tools_for, "qwen3-coder")
    return {
        "agent": "opencode",
        "drift": [
            "Today's date in the second system message; midnight passes before turn 3",
            "MCP tools in another order after a restart (turn 2)",
        ],
        "turns": turns,
    }


# --- OpenHands: static system, workspace context in the first user message, MCP tools re-added ----------
OPENHANDS_SYSTEM = """You are an autonomous software agent. You solve tasks in a sandboxed workspace by running commands and editing files.

<EFFICIENCY>
Combine related commands; avoid re-reading files you already have.
</EFFICIENCY>

<TROUBLESHOOTING>
If a command fails twice the same way, step back and look for the cause before retrying.
</TROUBLESHOOTING>"""


def openhands() -> dict[str, Any]:
    tools = [
        fn(
            "execute_bash",
            "Runs a bash command in the sandbox.",
            {
                "command": s("The command."),
                "is_input": s("Whether this is input to a running process.", enum=["true", "false"]),
            },
            ["command"],
        ),
        fn("think", "Writes down a thought.", {"thought": s("The thought.")}, ["thought"]),
        fn(
            "str_replace_editor",
            "Views and edits files under /workspace.",
            {
                "command": s("view, create or str_replace", enum=["view", "create", "str_replace"]),
                "path": s("Absolute path, e.g. `/workspace/file.py`."),
            },
            ["command", "path"],
        ),
        fn("finish", "Ends the task.", {"message": s("Final message.")}, ["message"]),
    ]
    fetch = fn("fetch", "Fetches a URL.", {"url": s("The URL.")}, ["url"])

    def tools_for(i: int) -> list[dict[str, Any]]:
        return tools + ([fetch] if i < 2 else [fetch, fetch])  # MCP reconnect appended the tool again

    ctx = (
        '<REPOSITORY_INFO>\nRepository acme/widgets is cloned to widgets in the working directory, branch "main".\n'
        "</REPOSITORY_INFO>\n\n<RUNTIME_INFORMATION>\nThe current working directory is /workspace\n"
        "Hosts: http://localhost:51234 (port 51234)\nToday's date is 2025-11-03 (UTC).\n</RUNTIME_INFORMATION>"
    )
    first = [
        {"role": "user", "content": "Bump the widget API version and update the changelog."},
        {"role": "user", "content": ctx},
    ]
    steps = [
        tool_turn(
            "oh1",
            "execute_bash",
            {"command": "grep -rn API_VERSION widgets"},
            "widgets/version.py:1:API_VERSION = 3",
        ),
        tool_turn(
            "oh2",
            "str_replace_editor",
            {"command": "str_replace", "path": "/workspace/widgets/widgets/version.py"},
            "Edited.",
        ),
        tool_turn(
            "oh3", "fetch", {"url": "https://example.invalid/changelog-format"}, "Keep a Changelog 1.1"
        ),
        tool_turn("oh4", "finish", {"message": "Bumped to 4 and added a changelog entry."}, "ok"),
    ]
    turns = sequence(
        first,
        steps,
        lambda i: [{"role": "system", "content": OPENHANDS_SYSTEM}],
        tools_for,
        "claude-sonnet-4-5",
    )
    return {
        "agent": "openhands",
        "drift": [
            "workspace context (date, ports) in the first user message (user side, left alone)",
            "the MCP fetch tool is sent twice after a reconnect",
        ],
        "turns": turns,
    }


# --- Aider: no tools, platform and date in the system prompt, repo map before the history ----------------
def aider_system(date: str) -> str:
    return (
        "Act as an expert software developer. Always use best practices when coding.  \r\n"
        "Describe each change with a *SEARCH/REPLACE block* per the examples below.  \r\n\r\n"
        "```python\nmathweb/flask/app.py\n<<<<<<< SEARCH\nfrom flask import Flask\n=======\nimport math\n"
        "from flask import Flask\n>>>>>>> REPLACE\n```\r\n\r\n"
        f"- Platform: Linux-6.8.0-x86_64-with-glibc2.39\r\n- Shell: SHELL=/bin/bash\r\n- Language: English\r\n"
        f"- Current date: {date}\r\n"
    )


def aider() -> dict[str, Any]:
    repo_map = [
        {
            "role": "user",
            "content": "Here are summaries of some files in my git repo:\n\nsrc/calc.py:\n  def add(a, b)\n  def div(a, b)",
        },
        {"role": "assistant", "content": "Ok, I won't try and edit those files without asking first."},
    ]
    dates = ["2025-11-03", "2025-11-03", "2025-11-04", "2025-11-04"]
    steps = [
        [
            {
                "role": "assistant",
                "content": "src/calc.py\n```python\n<<<<<<< SEARCH\n    return a / b\n=======\n    if b == 0:\n        raise ZeroDivisionError\n    return a / b\n>>>>>>> REPLACE\n```",
            },
            {"role": "user", "content": "Now add a docstring to div."},
        ],
        [{"role": "assistant", "content": "Added."}, {"role": "user", "content": "Run the tests."}],
        [{"role": "assistant", "content": "All green."}, {"role": "user", "content": "Commit message?"}],
    ]
    first = [*repo_map, {"role": "user", "content": "div should reject zero."}]
    turns = sequence(
        first,
        steps,
        lambda i: [{"role": "system", "content": aider_system(dates[i])}],
        lambda i: None,
        "deepseek-chat",
    )
    return {
        "agent": "aider",
        "drift": [
            "Current date in the system prompt; midnight passes before turn 2",
            "CRLF line ends and trailing spaces in the system prompt",
        ],
        "turns": turns,
    }


def main() -> None:
    for build in (codex, claude_code, cline, opencode, openhands, aider):
        data = build()
        path = HERE / f"{data['agent']}.json"
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(path.name, len(data["turns"]), "turns")


if __name__ == "__main__":
    main()
