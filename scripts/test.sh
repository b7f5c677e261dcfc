#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (idempotent), the linter, formatter and type checker,
# then pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-vllm
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q --durations=25 "$@"
