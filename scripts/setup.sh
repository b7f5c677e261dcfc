#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Debian's Prometheus (server + promtool), a venv with the
# CPU build of torch, and splitscope installed editable with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
    # The Debian package starts a system Prometheus on :9090; our tests start their own on free ports.
    (systemctl stop prometheus || service prometheus stop || pkill -x prometheus) >/dev/null 2>&1 || true
  else
    echo "setup: promtool/prometheus missing and not root; install Debian's 'prometheus' package" >&2
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
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
