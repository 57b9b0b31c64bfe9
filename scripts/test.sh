#!/usr/bin/env bash
# Run the test suite (what CI runs): set up first (idempotent), then pytest, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
