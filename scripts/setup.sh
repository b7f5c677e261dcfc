#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Debian's Prometheus (server + promtool), a venv with the
# CPU build of torch, and splitscope installed editable with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: Prometheus (server + promtool) for the rules and end-to-end tests, Chromium to render
# the HTML report in a test, iproute2 for the slow-link test's network namespaces.
missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    # The Debian package starts a system Prometheus on :9090; our tests start their own on free ports.
    (systemctl stop prometheus || service prometheus stop || pkill -x prometheus) >/dev/null 2>&1 || true
  else
    echo "setup: missing Debian packages (${missing[*]}) and not root: install them first" >&2
    exit 1
  fi
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.splitscope-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # The exact CPU build first: a bare torch requirement would otherwise pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[all,test]"
  touch "$stamp"
fi
