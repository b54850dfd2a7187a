"""The README, docs/, CHANGELOG, examples and the benchmark page stay true to the code and to each other."""

from __future__ import annotations

import ast
import importlib
import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

import robustdist
from robustdist.config.schema import config_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = ROOT / "benchmarks"
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and figures in code are examples, not claims)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", _prose(path.read_text()), re.M)}


# ---------------------------------------------------------------------------------------------- what is
def test_code_and_docs_say_what_is_not_their_history():
    """History belongs in CHANGELOG.md and measurements in benchmarks/findings.md: no issue numbers or run counts
    in the package or the docs, and docs/status.md is the current state (short), not a log."""
    history = re.compile(r"issue #\d|(?<![\w/])#[1-9]\d\b(?!\w)|\b\d+ of \d+ runs\b|\bseen (?:once|in CI)\b")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for path in [*sorted((ROOT / "robustdist").rglob("*.py")), *sorted(DOCS.rglob("*.md"))]
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if history.search(line) and "pytorch/pytorch" not in line and "PR #" not in line]
    assert not found, "history in code or docs (say what is; history goes to CHANGELOG.md):\n" + "\n".join(found)
    size = len((DOCS / "status.md").read_bytes())
    assert size <= 9 * 1024, f"docs/status.md is {size} bytes; keep it the current state, about 8 KB"


# ---------------------------------------------------------------------------------------------- the README
def test_readme_opens_with_the_two_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_is_short():
    size = len(README.encode())
    assert 6 * 1024 <= size <= 15 * 1024, f"README.md is {size} bytes; keep it between 6 and 15 KB (tables go in docs/)"


def test_readme_failure_table_is_one_short_line_per_mode():
    rows = [line for line in README.splitlines() if line.startswith("| [")]
    assert len(rows) >= 20, "the README lost its failure table"
    long = [row for row in rows if len(row) > 200]
    assert not long, f"README failure-table rows over 200 characters (details go in docs/failure-modes.md): {long}"
    assert all("docs/failure-modes.md#" in row for row in rows)


def test_readme_keeps_its_sections():
    headings = {_slug(h) for h in re.findall(r"^## (.*)$", README, re.M)}
    assert {"quick-start-the-3-line-change", "what-it-handles", "status", "configuration",
            "where-to-go-next"} <= headings


# ---------------------------------------------------------------------------------------------- links
def _links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading #{anchor} in {path.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_snippets_parse(page):
    for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
        ast.parse(block)


@pytest.mark.parametrize("page", [ROOT / "README.md", DOCS / "configuration.md"], ids=["README.md", "configuration.md"])
def test_yaml_snippets_are_valid_configs(page):
    yaml = pytest.importorskip("yaml")
    from robustdist.config.schema import HardenConfig

    blocks = re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.S | re.M)
    assert blocks
    for block in blocks:
        HardenConfig.from_dict(yaml.safe_load(block))


# ---------------------------------------------------------------------------------------------- docs pages
def test_config_reference_matches_the_dataclasses():
    text = (DOCS / "configuration.md").read_text()
    match = re.search(r"<!-- config-reference:start[^>]*-->\n(.*?)\n<!-- config-reference:end -->", text, re.S)
    assert match, "docs/configuration.md lost its config-reference markers"
    assert match.group(1) == config_reference(), (
        "docs/configuration.md's config reference is stale; regenerate the block between the markers with "
        "python -c 'from robustdist.config import config_reference; print(config_reference())'"
    )


def _failure_rows() -> list[list[str]]:
    """Every row of every table in docs/failure-modes.md whose header has a `handled in` column."""
    rows, handled = [], False
    for line in (DOCS / "failure-modes.md").read_text().splitlines():
        if not line.startswith("|"):
            handled = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[-1] == "handled in":
            handled = True
        elif handled and not set(line) <= set("|- "):
            rows.append(cells)
    return rows


def _resolve(ref: str) -> object:
    module, _, attrs = ref.partition(":")
    value: object = importlib.import_module(module)
    for attr in attrs.split("."):
        value = getattr(value, attr)
    return value


def test_failure_modes_name_functions_that_exist():
    rows = _failure_rows()
    assert len(rows) >= 40, f"docs/failure-modes.md has {len(rows)} failure modes with a `handled in` column"
    missing = []
    for cells in rows:
        refs = re.findall(r"`([\w.]+:[\w.]+)`", cells[-1])
        assert refs, f"a failure mode names no module:function: {cells[0]}"
        for ref in refs:
            try:
                _resolve(ref)
            except (ImportError, AttributeError) as e:
                missing.append(f"{ref} ({cells[0]}): {e}")
    assert not missing, f"docs/failure-modes.md names functions that do not exist: {missing}"


def test_failure_mode_rows_are_readable():
    long = [line[:80] for line in (DOCS / "failure-modes.md").read_text().splitlines()
            if line.startswith("|") and len(line) > 300]
    assert not long, f"failure-mode table rows over 300 characters (put the explanation in a note): {long}"


# ---------------------------------------------------------------------------------------------- measured numbers
# A measured figure: decimal seconds, any ms/us, a ratio such as "1.9x", a throughput, a decimal percentage.
# Whole seconds and minutes are left alone: they are defaults and bounds (1800 s, 30 min), not measurements.
MEASURED = re.compile(r"\b\d+\.\d+\s?(?:s|x)\b|\b\d+(?:\.\d+)?\s?(?:ms|us|µs)\b|\b\d+(?:\.\d+)?x\b"
                      r"|\b\d+(?:\.\d+)?\s?[KMGT]i?B/s\b|\b\d+\.\d+%|\btook \d")
OWNED_DOCSTRINGS = [ROOT / "robustdist" / f"{name}.py" for name in (
    "bf16", "parallel/syncbn", "parallel/consistency", "ray/actor", "ray/memory", "parallel/state_dict",
    "runtime/topology", "doctor", "runtime/netenv", "runtime/agreement", "testing/ranks", "cli")] + sorted(
    (ROOT / "robustdist").glob("*/__init__.py")) + sorted((ROOT / "examples").glob("*.py"))


def _without_generated(text: str) -> str:
    """The text outside the README's goodput block, which benchmarks/run.py generates from results.json (a test
    below holds it to that)."""
    return re.sub(r"<!-- goodput-table:start.*?<!-- goodput-table:end -->", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_hold_no_measured_numbers(page):
    found = MEASURED.findall(_without_generated(page.read_text()))
    assert not found, (f"{page.relative_to(ROOT)} states measured figures {found}; they belong in "
                       "benchmarks/RESULTS.md (generated) or benchmarks/findings.md (analysis): link there")


@pytest.mark.parametrize("path", OWNED_DOCSTRINGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_docstrings_hold_no_measured_numbers(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found = MEASURED.findall(doc)
    assert not found, f"{path.relative_to(ROOT)}'s module docstring states measured figures {found}"


# ---------------------------------------------------------------------------------------------- README vs bench-check
def _bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        import check
        import run
        import targets
    finally:
        sys.path.remove(str(BENCH))
    return check, run, targets


def test_readme_and_docs_state_no_count_of_missed_targets():
    count = r"(?:\d+|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen)"
    pattern = re.compile(rf"\b{count}\s+(?:\S+\s+){{0,4}}targets?\b", re.I)
    for page in PAGES:
        found = pattern.findall(_prose(page.read_text()))
        assert not found, (f"{page.relative_to(ROOT)} counts benchmark targets ({found}); link "
                           "benchmarks/RESULTS.md, whose summary is generated by the function bench-check uses")


def test_results_page_states_what_bench_check_computes():
    check, _, targets = _bench_modules()
    out = io.StringIO()
    with redirect_stdout(out):
        code = check.main([str(BENCH / "results.json")])
    printed = out.getvalue().strip().splitlines()[-1]
    verdicts = targets.evaluate(json.loads((BENCH / "results.json").read_text())["benchmarks"])
    assert printed == targets.summary(verdicts) and code == (1 if targets.missed(verdicts) else 0)
    page = (BENCH / "RESULTS.md").read_text()
    stated = re.search(r"\*\*(make bench-check: (?:(\d+) target\(s\) missed|every target met))\*\*", page)
    assert stated, "benchmarks/RESULTS.md lost its summary line; re-render it: python benchmarks/run.py --render"
    assert stated.group(1) == printed, (f"benchmarks/RESULTS.md says {stated.group(1)!r} but make bench-check prints "
                                        f"{printed!r}; re-render it: python benchmarks/run.py --render")
    assert int(stated.group(2) or 0) == targets.missed(verdicts)


def test_readme_goodput_table_is_generated_from_the_committed_results():
    _, run, _ = _bench_modules()
    text = (ROOT / "README.md").read_text()
    block = text[text.index(run.GOODPUT_START) + len(run.GOODPUT_START):text.index(run.GOODPUT_END)]
    expected = run.goodput_table(json.loads((BENCH / "results.json").read_text()))
    assert block.strip() == expected.strip(), "README's goodput table is stale: run python benchmarks/run.py --render"
    assert "| robustdist, + in-memory tier |" in block, "benchmark P9 has not been recorded in results.json"


def test_results_page_is_rendered_from_the_committed_results():
    _, run, _ = _bench_modules()
    rendered = run.render(json.loads((BENCH / "results.json").read_text()))
    assert (BENCH / "RESULTS.md").read_text() == rendered, (
        "benchmarks/RESULTS.md is not what results.json and findings.md render to; "
        "run python benchmarks/run.py --render")


# ---------------------------------------------------------------------------------------------- the rest
def test_changelog_has_this_version():
    assert f"## [{robustdist.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_ci_runs_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script and "make test" in script


@pytest.mark.processes
def test_examples_run():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "run_ranks_example.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "every rank holds the averaged gradient: [2.0, 2.0]" in out.stdout
