"""The README, CHANGELOG and examples stay true to the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import robustdist
from robustdist.config import config_reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_config_reference_matches_the_dataclasses():
    match = re.search(r"<!-- config-reference:start[^>]*-->\n(.*?)\n<!-- config-reference:end -->", README, re.S)
    assert match, "README lost its config-reference markers"
    assert match.group(1) == config_reference(), (
        "README's config reference is stale; regenerate it with "
        "python -c 'from robustdist.config import config_reference; print(config_reference())'"
    )


def test_changelog_has_this_version():
    assert f"## [{robustdist.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_ci_runs_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script and "make test" in script


def test_examples_run():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "run_ranks_example.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "every rank holds the averaged gradient: [2.0, 2.0]" in out.stdout
