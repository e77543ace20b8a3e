#!/usr/bin/env bash
# Installs Debian's Chromium for the browser test of the tutorials (tests/tutorials/test_browser.py).
# Playwright drives /usr/bin/chromium through executable_path; it never downloads a browser.
# Does nothing when Chromium is already there; without root it says what to run and succeeds,
# and the browser test then skips itself.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[install-browser] $CHROMIUM is missing; run 'sudo apt-get install -y chromium' for the browser test" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[install-browser] no apt-get here; install Chromium at $CHROMIUM for the browser test" >&2
  exit 0
fi
echo "[install-browser] installing Debian's chromium (for the tutorials' browser test)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
