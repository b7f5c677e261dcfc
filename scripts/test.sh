#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (idempotent), the linter, formatter and type checker,
# then pytest. Extra args go to one pytest run instead of the two phases below.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-vllm
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
# Two phases. The unit tests share both cores (pytest-xdist), and so do the slow or live tests that time
# nothing (the wheel, a real Prometheus fed a synthetic exposition); the tests that time servers or engines
# (`serial`) then run one at a time, because they measure latency and throughput and would disturb each
# other (markers in tests/conftest.py). `loadscope` hands each module to one worker, so a module's shared
# fixture (a server, a wheel) is built once, not once per worker.
.venv/bin/python -m pytest -q -n 2 --dist loadscope -m "not serial" --durations=10
exec .venv/bin/python -m pytest -q -m "serial" --durations=25
