#!/usr/bin/env bash
# The replica tests put real prefixgate replicas behind HAProxy (tests/helpers/balancer.py): install
# Debian's haproxy when it is missing. Exits non-zero when it cannot be installed.
set -euo pipefail
if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then
  echo "install_balancer: $(/usr/sbin/haproxy -v 2>/dev/null | head -1 || echo haproxy) already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; else SUDO=""; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q haproxy
# sed reads the whole output: head would close the pipe early and haproxy die of SIGPIPE (141)
/usr/sbin/haproxy -v | sed -n 1p
