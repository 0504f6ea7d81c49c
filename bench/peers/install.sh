#!/usr/bin/env bash
# Install the peer routers the benchmark compares against into a virtualenv OUTSIDE the repository,
# cached between runs: sglang-router (SGLang model gateway) and vllm-router (vllm-project/router).
#
#   bench/peers/install.sh [DIR]      (default: $PREFIXGATE_PEERS_DIR or ~/.cache/prefixgate/peers)
#
# Idempotent: a venv that already has both pinned versions is left alone.
set -euo pipefail

DIR="${1:-${PREFIXGATE_PEERS_DIR:-$HOME/.cache/prefixgate/peers}}"
SGLANG_ROUTER="sglang-router==0.3.2"
VLLM_ROUTER="vllm-router==0.1.17"
PYTHON="${PYTHON:-python3}"

if [ -x "$DIR/bin/python" ] && "$DIR/bin/pip" freeze 2>/dev/null | grep -qx "${SGLANG_ROUTER}" \
    && "$DIR/bin/pip" freeze 2>/dev/null | grep -qx "${VLLM_ROUTER}"; then
    echo "peers already installed in $DIR"
    exit 0
fi
mkdir -p "$(dirname "$DIR")"
"$PYTHON" -m venv "$DIR"
"$DIR/bin/pip" install --quiet --disable-pip-version-check "$SGLANG_ROUTER" "$VLLM_ROUTER"
echo "installed $SGLANG_ROUTER and $VLLM_ROUTER into $DIR"
