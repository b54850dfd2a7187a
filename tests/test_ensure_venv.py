"""``scripts/ensure-venv.sh`` (what ``make`` runs first) against a venv whose install did not finish: a stand-in
venv whose ``bin/python`` records each pip call and installs nothing but the entry points a forced reinstall of
their package would write."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ensure-venv.sh"

pytestmark = [pytest.mark.processes, pytest.mark.timeout(60)]

# A python that answers the script's calls: "-m pip install ..." (logged; a forced reinstall of torch or of the
# project writes its entry point, unless FAKE_BROKEN_PIP is set) and the closing import check.
_PYTHON = """#!/usr/bin/env bash
venv="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$1 $2 $3" = "-m pip --version" ]; then
    [ -z "${FAKE_NO_PIP:-}" ] || [ -f "$venv/made" ]
    exit $?
fi
if [ "$1 $2" = "-m pip" ]; then
    echo "${@:3}" >> "$venv/pip.log"
    if [ -z "${FAKE_BROKEN_PIP:-}" ] && [[ " $* " == *" --force-reinstall "* ]]; then
        [[ " $* " == *" torch "* || " $* " == *" .[dev,bench] "* ]] && install -m 755 /dev/null "$venv/bin/torchrun"
        [[ " $* " == *" -e . "* || " $* " == *" .[dev,bench] "* ]] && install -m 755 /dev/null "$venv/bin/robustdist"
    fi
    exit 0
fi
echo "import check"
"""


# The interpreter a venv is made with: "-m venv --clear DIR" makes DIR a stand-in venv as above (logged).
_MAKER = """#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m venv --clear" ]; then
    rm -rf "$4"/* "$4"/.robustdist-*; mkdir -p "$4/bin"; cp "$(dirname "$0")/python-template" "$4/bin/python"
    chmod +x "$4/bin/python"
    touch "$4/made"; echo "venv" >> "$4/pip.log"
    exit 0
fi
echo "Python 3.11 (stand-in)"
"""


def _venv(tmp_path: Path, *, stamped: bool, unfinished: bool, scripts: tuple[str, ...]) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    for name in scripts:
        (venv / "bin" / name).write_text("#!/bin/sh\n")
        (venv / "bin" / name).chmod(0o755)
    if stamped:
        want = hashlib.sha256(b"".join((ROOT / p).read_bytes() for p in (
            "constraints.txt", "pyproject.toml", "scripts/ensure-venv.sh"))).hexdigest()
        (venv / ".robustdist-install-stamp").write_text(want + "\n")
    if unfinished:
        (venv / ".robustdist-install-unfinished").touch()
    return venv


def _ensure(venv: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "VENV": str(venv), **env}, capture_output=True,
                          text=True, timeout=30)


def _pip_calls(venv: Path) -> list[str]:
    log = venv / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_stamped_venv_without_torchrun_has_torch_reinstalled(tmp_path):
    venv = _venv(tmp_path, stamped=True, unfinished=False, scripts=("robustdist",))
    done = _ensure(venv)
    assert done.returncode == 0, done.stderr
    assert "ensure-venv: " + str(venv) + "/bin/torchrun is missing; reinstalling torch" in done.stderr
    assert (venv / "bin" / "torchrun").exists() and (venv / ".robustdist-install-stamp").exists()
    assert _pip_calls(venv)[-1] == "install --quiet --disable-pip-version-check -c constraints.txt " \
                                   "--force-reinstall --no-deps torch"
    assert not (venv / ".robustdist-install-unfinished").exists()
    again = _ensure(venv)  # complete and stamped: nothing to do
    assert again.returncode == 0 and len(_pip_calls(venv)) == 2 and again.stderr == ""


def test_an_install_that_did_not_finish_is_redone_with_every_package(tmp_path):
    venv = _venv(tmp_path, stamped=False, unfinished=True, scripts=("robustdist", "torchrun"))
    done = _ensure(venv)
    assert done.returncode == 0, done.stderr
    assert "the last install into " + str(venv) + " did not finish; reinstalling every package" in done.stderr
    assert _pip_calls(venv) == ["install --quiet --disable-pip-version-check -c constraints.txt --force-reinstall -e "
                                ".[dev,bench]"]
    assert not (venv / ".robustdist-install-unfinished").exists() and (venv / ".robustdist-install-stamp").exists()


def test_an_entry_point_a_reinstall_does_not_bring_back_is_named_and_nothing_is_stamped(tmp_path):
    venv = _venv(tmp_path, stamped=True, unfinished=False, scripts=())
    done = _ensure(venv, FAKE_BROKEN_PIP="1")
    assert done.returncode == 1
    assert ("ensure-venv: torchrun robustdist still missing from " + str(venv) + "/bin after reinstalling; expected "
            "pip to install them. Fix: rm -rf " + str(venv) + " and run make again.") in done.stderr
    assert not (venv / ".robustdist-install-stamp").exists()
    assert (venv / ".robustdist-install-unfinished").exists()  # the next make reinstalls every package


def test_a_venv_whose_creation_was_interrupted_is_made_again(tmp_path):
    """``python -m venv`` interrupted during ensurepip: bin/python exists, pip does not. The venv is made again
    (--clear), then installed."""
    venv = _venv(tmp_path, stamped=False, unfinished=False, scripts=())
    maker = tmp_path / "maker"
    maker.mkdir()
    (maker / "python-template").write_text(_PYTHON)
    (maker / "python3").write_text(_MAKER)
    (maker / "python3").chmod(0o755)
    done = _ensure(venv, FAKE_NO_PIP="1", PYTHON=str(maker / "python3"))
    assert done.returncode == 0, done.stderr
    assert "ensure-venv: creating " + str(venv) + " with Python 3.11 (stand-in)" in done.stderr
    calls = _pip_calls(venv)
    assert calls[0] == "venv" and calls[1].endswith("-c constraints.txt -e .[dev,bench]"), calls
    assert (venv / ".robustdist-install-stamp").exists() and not (venv / ".robustdist-install-unfinished").exists()


def test_a_failing_import_check_leaves_the_install_unfinished(tmp_path):
    venv = _venv(tmp_path, stamped=False, unfinished=False, scripts=("robustdist", "torchrun"))
    python = venv / "bin" / "python"
    python.write_text(python.read_text().replace('echo "import check"', 'echo "ImportError: torch" >&2; exit 1'))
    done = _ensure(venv)
    assert done.returncode == 1 and "ImportError: torch" in done.stderr
    assert (venv / ".robustdist-install-unfinished").exists() and not (venv / ".robustdist-install-stamp").exists()
