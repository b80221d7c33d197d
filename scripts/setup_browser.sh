#!/usr/bin/env bash
# Installs Debian's chromium (for the browser test of the serve playground) if /usr/bin/chromium is
# missing. Never fails: when it cannot install, it says why and exits 0, and the browser test skips.
set -u
CHROMIUM=/usr/bin/chromium
[ -x "$CHROMIUM" ] && exit 0

why() { echo "setup_browser: chromium not installed: $*" >&2; exit 0; }

command -v apt-get >/dev/null 2>&1 || why "apt-get not available (not a Debian-based system)"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || why "not root and no passwordless sudo"
  SUDO=(sudo -n)
fi

export DEBIAN_FRONTEND=noninteractive
apt=("${SUDO[@]}" apt-get -q -y -o Dpkg::Use-Pty=0)
if ! apt-cache show chromium >/dev/null 2>&1; then
  "${apt[@]}" update >/dev/null 2>&1 || why "apt-get update failed"
fi
if ! "${apt[@]}" install --no-install-recommends chromium >/dev/null 2>&1; then
  # The package lists may be stale; refresh them once and retry.
  "${apt[@]}" update >/dev/null 2>&1 || why "apt-get update failed"
  "${apt[@]}" install --no-install-recommends chromium >/dev/null 2>&1 || why "apt-get install chromium failed"
fi
[ -x "$CHROMIUM" ] || why "package installed but $CHROMIUM is missing"
echo "setup_browser: installed $("$CHROMIUM" --version 2>/dev/null || echo chromium)"
