#!/usr/bin/env bash
# Run the test suite (what CI runs): set up first (idempotent), then pytest, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers, a test file each at a time (module fixtures such as a Triton server stay in one worker), heaviest
# files first (tests/conftest.py orders them). Most of a test's time is one busy core, so two workers nearly halve
# the wall time on a 2-core machine. `-n 0` runs serially (later options win): bash scripts/test.sh -n 0 tests/x.py
exec .venv/bin/python -m pytest -n "${LLMC_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
