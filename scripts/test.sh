#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (idempotent), then pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-vllm
exec .venv/bin/python -m pytest -q "$@"
