# shellcheck shell=bash
# Shared set-up for scripts/*.sh: source it, then call `ensure_venv [EXTRA]`.
#
# Creates .venv with the first Python >= 3.10 found (or $PYTHON) if it is missing,
# and installs the project into it, editable, pinned by constraints/cpu.txt (which
# pins the CPU build of torch: an unpinned torch would pull a multi-GB CUDA build).
# The install is skipped when its stamp is newer than pyproject.toml and every file
# in constraints/, so a second run costs well under a second before the real work.
#
# Environment:
#   PYTHON           interpreter used to create .venv (default: python3.13 ... python3)
#   REMAT_DIST_VENV  where the virtual environment lives (default: <repo>/.venv)

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REMAT_DIST_VENV:-$ROOT/.venv}"
VENV_PY="$VENV/bin/python"

_find_python() {
    local candidates=()
    if [[ -n "${PYTHON:-}" ]]; then
        candidates=("$PYTHON")
    else
        candidates=(python3.13 python3.12 python3.11 python3.10 python3 python)
    fi
    local c
    for c in "${candidates[@]}"; do
        if command -v "$c" >/dev/null 2>&1 &&
            "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
                >/dev/null 2>&1; then
            command -v "$c"
            return 0
        fi
    done
    echo "error: need Python >= 3.10 (tried: ${candidates[*]}); set PYTHON=/path/to/python3" >&2
    return 1
}

_stamp_is_fresh() {
    local stamp="$1" f
    [[ -f "$stamp" ]] || return 1
    for f in "$ROOT/pyproject.toml" "$ROOT"/constraints/*; do
        [[ -e "$f" ]] || continue
        [[ "$stamp" -nt "$f" ]] || return 1
    done
    return 0
}

# ensure_venv [EXTRA]: make sure .venv exists and holds the project (with the
# optional-dependency group EXTRA, e.g. "test").
ensure_venv() {
    local extra="${1:-}"
    local stamp_base="$VENV/.remat_dist-installed"
    local stamp="$stamp_base${extra:+-$extra}"

    if [[ ! -x "$VENV_PY" ]]; then
        local py
        py="$(_find_python)"
        echo "[setup] creating $VENV with $py ($("$py" -V 2>&1))"
        if ! "$py" -m venv "$VENV"; then
            echo "error: '$py -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2
            return 1
        fi
    fi

    # The plain install is covered by any extra's install.
    if _stamp_is_fresh "$stamp"; then
        return 0
    fi
    if [[ -z "$extra" ]]; then
        local s
        for s in "$stamp_base"-*; do
            if [[ -e "$s" ]] && _stamp_is_fresh "$s"; then
                return 0
            fi
        done
    fi

    local target="."
    [[ -n "$extra" ]] && target=".[$extra]"
    echo "[setup] installing remat-dist${extra:+[$extra]} into $VENV (torch pinned by constraints/cpu.txt)"
    (
        cd "$ROOT"
        "$VENV_PY" -m pip install --quiet --disable-pip-version-check \
            -e "$target" -c constraints/cpu.txt
    )
    touch "$stamp"
}
