#!/usr/bin/env bash
# The fast tier on every supported torch release: scripts/test_torch_matrix.sh
#     [--only RELEASE]... [--setup-only] [PYTEST ARGS...]
#
# The releases are TESTED_TORCH in remat_dist/_torch/__init__.py (one entry per
# minor release: a new torch release is one more entry there). For each: a
# virtual environment of its own (made once, reused when present) holding
# torch==RELEASE, pytest and pytest-xdist, plus the test extra's other packages
# (numpy, ruff, transformers) -- except for the release constraints/cpu.txt pins
# (the development release, which scripts/test.sh runs with the test extra): its
# environment is "plain", the declared dependencies and the test runner only, so
# a missing dependency of the package or of the suite cannot hide there (tests
# needing an optional package skip). The checkout goes on
# PYTHONPATH (no install of remat-dist); `pytest -m "not slow"` runs from the
# repository root. One summary table at the end. Exit code: 0 when every release
# passed; otherwise 1 (pytest's exit 5, no test ran, is a failure).
#
# Environment:
#   PYTHON                  interpreter the environments are made with
#                           (default: as scripts/_setup.sh picks it)
#   REMAT_DIST_TORCH_VENVS  where they live (default: ~/.cache/remat_dist/torch-venvs)
#   MATRIX_WORKERS          pytest-xdist workers per release (default: 2)
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
set +e
cd "$ROOT"

# "VERSION KIND" per release, KIND "plain" for the pinned one, else "test".
_releases() {
    "$(_find_python)" - "$ROOT" <<'EOF'
import ast, re, sys
from pathlib import Path
root = Path(sys.argv[1])
tree = ast.parse((root / "remat_dist" / "_torch" / "__init__.py").read_text())
tested = next(
    ast.literal_eval(node.value)
    for node in tree.body
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TESTED_TORCH"
)
pin = re.search(r"^torch==(\S+)", (root / "constraints" / "cpu.txt").read_text(), re.M)
for version in tested:
    print(version, "plain" if pin and pin.group(1) == version else "test")
EOF
}
mapfile -t RELEASES < <(_releases)
if [[ ${#RELEASES[@]} -eq 0 ]]; then
    echo "error: no TESTED_TORCH in remat_dist/_torch/__init__.py" >&2
    exit 1
fi

VENVS="${REMAT_DIST_TORCH_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/remat_dist/torch-venvs}"
WORKERS="${MATRIX_WORKERS:-2}"

only=()
setup_only=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) only+=("$2"); shift 2 ;;
        --setup-only) setup_only=1; shift ;;
        *) break ;;
    esac
done

# The packages of the test extra beyond the runner (from pyproject.toml), pinned
# as constraints/cpu.txt pins them (torch left out: each environment has its own).
_test_extra_packages() {
    "$1" - "$ROOT" <<'EOF'
import re, sys
from pathlib import Path
root = Path(sys.argv[1])
text = (root / "pyproject.toml").read_text()
block = re.search(r"^test\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
pins = {}
for line in (root / "constraints" / "cpu.txt").read_text().splitlines():
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==", line)
    if m:
        pins[m.group(1).lower()] = line.split("#")[0].strip()
for spec in re.findall(r'"([^"]+)"', block):
    name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower()
    if name not in ("pytest", "pytest-xdist", "torch"):
        print(pins.get(name, spec))
EOF
}

# _ensure_env VERSION KIND: print the interpreter of the release's environment,
# making or completing it when needed (installs go to stderr).
_ensure_env() {
    local version="$1" kind="$2" env="$VENVS/torch-$1"
    local py="$env/bin/python" stamp="$env/.remat_dist-matrix-$kind"
    if [[ -x "$py" && -f "$stamp" ]] &&
        "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" \
            >/dev/null 2>&1; then
        echo "$py"
        return 0
    fi
    if [[ ! -x "$py" ]]; then
        mkdir -p "$VENVS"
        "$(_find_python)" -m venv "$env" >&2 || return 1
    fi
    local pkgs=("torch==$version" "pytest>=8" "pytest-xdist>=3")
    if [[ "$kind" == test ]]; then
        mapfile -t extra < <(_test_extra_packages "$py")
        pkgs+=("${extra[@]}")
    fi
    echo "[matrix] installing into $env: ${pkgs[*]}" >&2
    # PIP_CONSTRAINT=/dev/null: a machine-wide pip constraint (one capping torch)
    # must not pick another release than the one this environment is for.
    PIP_CONSTRAINT=/dev/null "$py" -m pip install --quiet --disable-pip-version-check \
        "${pkgs[@]}" >&2 || return 1
    rm -f "$env"/.remat_dist-matrix-*
    touch "$stamp"
    echo "$py"
}

declare -a SUMMARY=()
failed=0
total_start=$SECONDS
for line in "${RELEASES[@]}"; do
    read -r version kind <<<"$line"
    if [[ ${#only[@]} -gt 0 && ! " ${only[*]} " == *" $version "* ]]; then
        continue
    fi
    echo "=== torch $version ($kind): fast tier ==="
    start=$SECONDS
    if ! py="$(_ensure_env "$version" "$kind")"; then
        SUMMARY+=("$(printf '%-8s %-6s %-5s %s' "$version" "$kind" FAIL "environment could not be made")")
        failed=1
        continue
    fi
    setup_s=$((SECONDS - start))
    if [[ $setup_only -eq 1 ]]; then
        SUMMARY+=("$(printf '%-8s %-6s %-5s %s' "$version" "$kind" ok "environment ready: $py (setup $setup_s s)")")
        continue
    fi
    log="$(mktemp)"
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -m "not slow" \
        -n "$WORKERS" -q -p no:cacheprovider -rfE "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    counts="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 | tr -d '=')"
    rm -f "$log"
    status=ok
    if [[ $rc -ne 0 ]]; then
        status=FAIL
        failed=1
        [[ $rc -eq 5 ]] && counts="no test ran (pytest exit 5)"
    fi
    SUMMARY+=("$(printf '%-8s %-6s %-5s %s (setup %d s, total %d s)' "$version" "$kind" \
        "$status" "${counts:-pytest exit $rc}" "$setup_s" $((SECONDS - start)))")
done

echo
echo "=== remat_dist torch matrix: fast tier per release ($((SECONDS - total_start)) s) ==="
printf '%s\n' "${SUMMARY[@]}"
if [[ ${#SUMMARY[@]} -eq 0 ]]; then
    echo "no release matched --only ${only[*]}" >&2
    exit 1
fi
exit "$failed"
