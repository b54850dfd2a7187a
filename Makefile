# The two commands the README opens with: `make demo` (the main job) and `make test` (the full suite);
# `make test-fast` is the edit loop's tier: the tests that start no process.
# Both create or refresh the project-local .venv first (scripts/ensure-venv.sh; a no-op when up to date).

VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Three pytest-xdist workers on the 2-core machine: many tests wait (on timeouts, on stopped ranks) while the others
# use the cores, and three keep both cores busy where two leave them idle a sixth of the run. Ray tests share one
# worker, node-lab tests another (conftest.py). The run ends with its 20 slowest tests.
PYTEST_PARALLEL ?= -n 3 --dist loadgroup

.PHONY: demo demo-multinode test test-fast test-matrix bench bench-peers bench-check venv clean

venv:
	@VENV=$(VENV) bash scripts/ensure-venv.sh

# The resilient-training demo (scripts/demo.py): 2 CPU ranks, rank 1 SIGKILLed mid-run, recovered two ways: torchrun
# restarting every worker, and robustdist run forking only rank 1 again from its warm spare while rank 0 recovers in
# its own process. Prints each one's kill-to-next-step time and checks each bitwise against a run without the fault;
# exits non-zero if either differs. Each run's output (the killed rank's tracebacks) goes to a log in $(DEMO_DIR),
# which the demo empties first (the job itself never deletes it: a restarted attempt must find its checkpoints there).
DEMO_DIR ?= .demo-run
demo: venv
	rm -rf $(DEMO_DIR)
	$(PY) scripts/demo.py --workdir $(DEMO_DIR)

# The same demo across 2 simulated nodes (network namespaces, one torchrun agent each; needs root and
# iproute2): rank 1 on node 1 SIGKILLs itself, both nodes restart, the result is checked bitwise.
demo-multinode: venv
	$(PY) scripts/demo_multinode.py --workdir .demo-multinode

# Byte-compiled once here: a shell with PYTHONDONTWRITEBYTECODE set would have every process the suite starts
# compile robustdist again.
test: venv
	@$(PY) -m compileall -q robustdist tests benchmarks examples > /dev/null
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=20 $(PYTEST_ARGS)

# The tests that start no process (no rank, subprocess, torchrun, Ray or node lab), on the same xdist workers:
# about 3 minutes. A test that starts one without its `processes` marker fails here, naming the marker
# (tests/_process_guard.py). `make test` runs them too.
test-fast: venv
	ROBUSTDIST_TEST_NO_PROCESSES=1 $(PY) -m pytest $(PYTEST_PARALLEL) -m "not processes" $(PYTEST_ARGS)

# The version matrix: the whole suite once per (Python, torch, Ray) lane, each in its own venv under .matrix/,
# then the rendered table (docs/status.md) and data (robustdist/runtime/tested_versions.json). Not part of make
# test: about 25-35 minutes a lane on the 2-core machine. `make test-matrix LANES="newest oldest"` runs only those
# (and does not render). See docs/development.md "The version matrix".
LANES ?=
test-matrix:
	python3 scripts/matrix.py $(LANES) $(if $(LANES),,--render)

# Every benchmark, side by side with the plain torch/Ray way; writes benchmarks/results.json and RESULTS.md.
# `make bench BENCH="bench_bf16 bench_step"` re-runs only those. Timing is not a test: not part of `make test`.
BENCH ?=
bench: venv
	$(PY) benchmarks/run.py $(BENCH)

# The same small DDP job in plain torch, Accelerate, Lightning Fabric, Ray Train, robustdist, and robustdist inside
# Accelerate and inside Fabric, side by side
# (step, save, exact resume, a kill in a save, a stuck rank, NaN, CPU SyncBN); writes benchmarks/peers/results.json
# and its section of RESULTS.md. `make bench-peers PEERS="plain robustdist"` re-runs only those. About 9 minutes.
PEERS ?=
bench-peers: venv
	$(PY) benchmarks/peers/run.py $(PEERS)

# Compare benchmarks/results.json with the targets in benchmarks/targets.py; exit 1 on any miss.
bench-check: venv
	$(PY) benchmarks/check.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info $(DEMO_DIR) .demo-multinode
