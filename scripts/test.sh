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
# Two phases. The unit tests share both cores (pytest-xdist); the tests that start whole servers, engines
# or a real Prometheus then run one at a time, because they measure latency and throughput and would
# disturb each other (markers in tests/conftest.py).
.venv/bin/python -m pytest -q -n 2 -m "not slow and not live" --durations=10
exec .venv/bin/python -m pytest -q -m "slow or live" --durations=25
