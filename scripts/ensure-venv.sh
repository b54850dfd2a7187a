#!/usr/bin/env bash
# Create or refresh the project-local .venv used by `make demo`, `make test` and `make bench`.
#
# Installs the pinned constraints (constraints.txt) and the package in editable mode with [dev,bench]
# ([bench]: the peers benchmarks/peers/ compares with, which its smoke test in `make test` runs).
# Re-running is fast: the install is skipped while a stamp holding the SHA-256 of constraints.txt,
# pyproject.toml and this script still matches.
#
# An install that did not finish (interrupted, killed, or failed: the venv's creation, pip, the closing import
# check) leaves a marker: the next run reinstalls every package (pip takes a package whose files it wrote only in
# part for installed), and a venv without a working pip is made again. Before stamping, the commands the
# project runs from the venv (torchrun, robustdist) must exist; a missing one has its package reinstalled, and if
# it is still missing the script fails naming it.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.robustdist-install-stamp"
unfinished="$VENV/.robustdist-install-unfinished"
want=$(cat constraints.txt pyproject.toml scripts/ensure-venv.sh | sha256sum | cut -d' ' -f1)

# The commands the project runs from the venv, each with the package that installs it.
entry_points() {
    echo "torchrun torch"
    echo "robustdist -e ."
}

missing_entry_points() {
    local script package
    while read -r script package; do
        [ -x "$VENV/bin/$script" ] || echo "$script $package"
    done < <(entry_points)
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ] && [ ! -f "$unfinished" ] \
        && [ -z "$(missing_entry_points)" ]; then
    exit 0
fi

pip_install() {
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt "$@" < /dev/null
}

again=0
[ -f "$unfinished" ] && again=1
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version > /dev/null 2>&1; then
    echo "ensure-venv: creating $VENV with $($PYTHON --version 2>&1)" >&2
    mkdir -p "$VENV"
    touch "$unfinished"  # from here until the end: an interruption is seen by the next run
    "$PYTHON" -m venv --clear "$VENV"
    touch "$unfinished"  # --clear emptied the directory
fi

rm -f "$stamp"
if [ "$again" = 1 ]; then
    echo "ensure-venv: the last install into $VENV did not finish; reinstalling every package" >&2
    pip_install --force-reinstall -e ".[dev,bench]"
else
    echo "ensure-venv: installing pinned dependencies and robustdist[dev,bench] (editable) into $VENV" >&2
    touch "$unfinished"
    pip_install -e ".[dev,bench]"
fi
missing=$(missing_entry_points)
if [ -n "$missing" ]; then
    while read -r script package; do
        echo "ensure-venv: $VENV/bin/$script is missing; reinstalling $package" >&2
        # shellcheck disable=SC2086  # "-e ." is two words
        pip_install --force-reinstall --no-deps $package
    done <<< "$missing"
    missing=$(missing_entry_points)
    if [ -n "$missing" ]; then
        echo "ensure-venv: $(echo "$missing" | cut -d' ' -f1 | xargs) still missing from $VENV/bin after reinstalling;" \
            "expected pip to install them. Fix: rm -rf $VENV and run make again." >&2
        exit 1
    fi
fi
"$VENV/bin/python" -c "import robustdist, torch; print('ensure-venv: robustdist', robustdist.__version__, 'torch', torch.__version__)" >&2
rm -f "$unfinished"
echo "$want" > "$stamp"
