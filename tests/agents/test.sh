#!/usr/bin/env bash
# The real-agent tier in one command: install the agent CLIs from npm (cached), then run tests/agents:
# Claude Code, Codex CLI and opencode, each driven through multi-turn sessions with tool calls,
# through prefixgate against simulated ranks in scripted-tool mode.
#   tests/agents/test.sh [pytest args...]
# PYTHON: the interpreter with prefixgate installed ('.[test]'); default python3.
# The tier is skipped, loudly, when the npm registry cannot be reached; any other failure fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"

status=0
bash tests/agents/install.sh || status=$?
if [[ $status -eq 3 ]]; then
  echo "=================================================================================" >&2
  echo "SKIPPED the real-agent tier: the npm registry cannot be reached to install the CLIs" >&2
  echo "=================================================================================" >&2
  exit 0
elif [[ $status -ne 0 ]]; then
  exit "$status"
fi
# --confcutdir: the tier needs none of tests/conftest.py's fixtures, and loading it puts tests/ first on
# sys.path, where the test package tests/bench shadows the project's bench (the tier's bench.sim then
# comes from wherever an installed prefixgate points, not from this checkout).
exec timeout 1800 "$PYTHON" -m pytest -m agents tests/agents -q -p no:cacheprovider -n 0 \
  --confcutdir tests/agents "$@"
