#!/usr/bin/env bash
# Create or refresh the project-local .venv used by `make demo`, `make test` and `make bench`.
#
# Installs the pinned constraints (constraints.txt) and the package in editable mode with [dev,bench]
# ([bench]: the peers benchmarks/peers/ compares with, which its smoke test in `make test` runs).
# Re-running is fast: the install is skipped while a stamp holding the SHA-256 of constraints.txt,
# pyproject.toml and this script still matches.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.robustdist-install-stamp"
want=$(cat constraints.txt pyproject.toml scripts/ensure-venv.sh | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "ensure-venv: creating $VENV with $($PYTHON --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV"
fi
echo "ensure-venv: installing pinned dependencies and robustdist[dev,bench] (editable) into $VENV" >&2
rm -f "$stamp"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e ".[dev,bench]"
"$VENV/bin/python" -c "import robustdist, torch; print('ensure-venv: robustdist', robustdist.__version__, 'torch', torch.__version__)" >&2
echo "$want" > "$stamp"
