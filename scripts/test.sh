#!/usr/bin/env bash
# Run the test suite: scripts/test.sh [--slow | --all] [PYTEST ARGS...]
#
# Creates .venv if missing, installs the project with its test extra (pinned by
# constraints/cpu.txt; skipped when already done), then runs `pytest -n auto` from
# the repository root:
#   scripts/test.sh           the suite (every test but the slow tier)
#   scripts/test.sh --slow    the slow tier: end-to-end runs in subprocesses
#                             (torchrun jobs, the benchmarks' command lines)
#   scripts/test.sh --all     both (what CI runs)
# Extra arguments go to pytest (`scripts/test.sh -n 0 -x tests/models` works: a
# later -n wins). pytest's exit code is this script's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
ensure_venv test
cd "$ROOT"
tier=(-m "not slow")
case "${1:-}" in
    --slow) tier=(-m slow); shift ;;
    --all) tier=(); shift ;;
esac
exec "$VENV_PY" -m pytest -n auto "${tier[@]}" "$@"
