#!/usr/bin/env bash
# The main job on a fresh machine: set-up (idempotent), then `splitscope demo`. Extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/splitscope demo "$@"
