# The two commands the README opens with: `make demo` (the main job) and `make test` (the full suite).
# Both create or refresh the project-local .venv first (scripts/ensure-venv.sh; a no-op when up to date).

VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test bench venv clean

venv:
	@VENV=$(VENV) bash scripts/ensure-venv.sh

# The resilient-training demo: 2 CPU ranks, rank 1 SIGKILLs itself mid-run, torchrun restarts the group,
# training resumes from the last committed checkpoint, and the result is checked bitwise against a
# straight-through run. Exits non-zero if it is not bit-identical.
DEMO_DIR ?= .demo-run
demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 --max-restarts=1 \
		examples/resilient_training.py --workdir $(DEMO_DIR)

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info $(DEMO_DIR)
