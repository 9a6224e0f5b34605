#!/usr/bin/env bash
# Run the whole test suite: scripts/test.sh [PYTEST ARGS...]
#
# Creates .venv if missing, installs the project with its test extra (pinned by
# constraints/cpu.txt; skipped when already done), then runs `pytest -n auto` from
# the repository root. Extra arguments go to pytest (`scripts/test.sh -n 0 -x
# tests/models` works: a later -n wins). pytest's exit code is this script's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
ensure_venv test
cd "$ROOT"
exec "$VENV_PY" -m pytest -n auto "$@"
