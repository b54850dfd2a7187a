# The two commands the README opens with: `make demo` (the main job) and `make test` (the full suite).
# Both create or refresh the project-local .venv first (scripts/ensure-venv.sh; a no-op when up to date).

VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test bench venv clean

venv:
	@VENV=$(VENV) bash scripts/ensure-venv.sh

# Until the resilient-training demo lands: the doctor on 2 local ranks (its checks plus the cross-rank table).
demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 -m robustdist doctor

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
