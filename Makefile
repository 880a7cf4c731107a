# HARTS developer entry points. Every target below creates .venv on first use (see `venv`).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.harts-installed

.PHONY: venv demo rl test test-fast bench proto clean

venv: $(STAMP)

# Idempotent: re-installs only when the lock file or pyproject.toml changed.
$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

## demo: synthetic agentic rollouts -> planner (in-process, SQLite) -> tree training on the CPU
demo: venv
	$(VENV)/bin/harts demo

## rl: RL on the CPU: warm start, planner, generator and 2 trainer ranks; the reward rises (runs/rl_tiny/rl.png)
rl: venv
	$(VENV)/bin/harts rl --config examples/rl_tiny.toml

## test: the whole suite (unit, exactness, service and 2-rank torchrun integration tests); what CI runs
test: venv
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

## test-fast: everything but the `slow` and `integration` tiers (a few minutes at most on 2 cores)
test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not integration" $(PYTEST_ARGS)

## bench: benchmark suite; writes benchmarks/results/*.md and plots
bench: venv
	$(VENV)/bin/harts bench

## proto: regenerate the Python modules from proto/harts/v1/*.proto
proto: venv
	$(PY) -m proto.generate

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
