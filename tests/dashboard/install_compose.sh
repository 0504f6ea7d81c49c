#!/usr/bin/env bash
# tests/dashboard/test_grafana.py checks docker-compose.yml with `docker-compose config` (no Docker
# daemon needed): install Debian's docker-compose when it is missing. Exits non-zero when it cannot be
# installed.
set -euo pipefail
if command -v docker-compose >/dev/null 2>&1; then
  echo "install_compose: $(docker-compose version --short 2>/dev/null || echo docker-compose) already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; else SUDO=""; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends docker-compose
docker-compose version --short
