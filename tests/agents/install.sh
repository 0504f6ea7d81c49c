#!/usr/bin/env bash
# Install the real-agent tier's CLIs from the npm registry into a cache outside the repo, once:
#   @anthropic-ai/claude-code, @openai/codex, opencode-ai at the versions the tier (and the
#   canonicalization rules' formats) were checked with. Later runs reuse the cache.
# Env: PREFIXGATE_AGENTS_DIR overrides the cache (default ~/.cache/prefixgate/agents).
# Exit status: 0 installed; 3 the npm registry cannot be reached (the caller skips the tier); else failed.
set -euo pipefail

DIR="${PREFIXGATE_AGENTS_DIR:-$HOME/.cache/prefixgate/agents}"
PACKAGES="@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33"
STAMP="$DIR/.prefixgate-installed"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PACKAGES" ]] \
  && [[ -x "$DIR/node_modules/.bin/claude" && -x "$DIR/node_modules/.bin/codex" && -x "$DIR/node_modules/.bin/opencode" ]]; then
  echo "agent CLIs ready: $DIR ($PACKAGES)"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  echo "installing Debian's nodejs and npm"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm) >/dev/null
fi

mkdir -p "$DIR"
export npm_config_cache="$DIR/npm-cache" npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false
if ! timeout 60 npm view "@anthropic-ai/claude-code@2.1.332" version >/dev/null 2>&1; then
  echo "the npm registry cannot be reached (npm view @anthropic-ai/claude-code failed)" >&2
  exit 3
fi
cd "$DIR"
[[ -f package.json ]] || echo '{"name": "prefixgate-agents", "private": true}' > package.json
# shellcheck disable=SC2086  # one word per package
# Their install scripts put the per-platform binary (an optional dependency, from the registry too)
# in place; they fetch nothing else.
timeout 900 npm install --no-save --loglevel=error $PACKAGES
for bin in claude codex opencode; do
  "$DIR/node_modules/.bin/$bin" --version >/dev/null
done
echo "$PACKAGES" > "$STAMP"
echo "agent CLIs installed: $DIR ($PACKAGES)"
