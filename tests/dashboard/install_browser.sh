#!/usr/bin/env bash
# The dashboard's browser test drives Debian's chromium through Playwright (tests/dashboard):
# install chromium from Debian when it is missing. Playwright's own browser download is never used.
# Exits non-zero when chromium cannot be installed (the test then fails in CI and says why).
set -euo pipefail
CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
  echo "install_browser: $("$CHROMIUM" --version 2>/dev/null || echo chromium) already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo -n"
else
  SUDO=""
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium
"$CHROMIUM" --version
