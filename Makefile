# Two entry points (see README): `make demo` runs a local swarm, `make check` runs every check.
# Each creates/updates the project virtualenv by itself; re-running is cheap.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo check test lint typecheck bench clean

venv: $(STAMP)

# torch is installed first, pinned to the CPU build: an unpinned torch, or torch==2.13.0 from
# PyPI on Linux, is a multi-GB CUDA build. A local +cpu wheel (pip's find-links) is taken when
# there is one, else PyTorch's CPU index is asked; on Linux, when neither has it (that index
# unreachable), the set-up stops and says so rather than fall back to PyPI's pin (it did, saying
# "CPU build": an outside tester); elsewhere (macOS, whose wheels are CPU-only) the plain pin.
# The interpreter is checked before the venv is made, and the venv's when there is one
# (Python 3.10 ended in "No matching distribution found for torch==2.13.0", which named no
# version; a venv an earlier set-up left made with it then blamed the network: a re-check).
# One shell for the whole recipe, so that:
# - two set-ups at once (two `make demo` in a fresh clone) take turns under a lock (flock,
#   where there is one), and the second finds the work done: pip crashed in one of them;
# - a venv whose creation was interrupted (a python and no pip yet) is made again from
#   scratch: `test -x .venv/bin/python` took it for a finished one, and every later run
#   failed with "No module named pip".
$(STAMP): pyproject.toml
	@set -e; \
	if command -v flock >/dev/null 2>&1; then exec 9>$(VENV).lock; flock 9; fi; \
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then exit 0; fi; \
	echo "setting up $(VENV): torch 2.13.0 (CPU build), then this project"; \
	if [ -x $(BIN)/python ] && ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  echo "$(VENV) holds $$($(BIN)/python --version 2>&1 | head -n 1); swarm needs Python 3.11 or newer:" \
	    "remove it (make clean), then make PYTHON=/path/to/python3.11 ..." >&2; exit 1; \
	fi; \
	if ! $(BIN)/python -m pip --version >/dev/null 2>&1; then \
	  $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	    echo "swarm needs Python 3.11 or newer ('$(PYTHON)':" \
	      "$$(command -v $(PYTHON) >/dev/null && $(PYTHON) --version 2>&1 | head -n 1 || echo not found)):" \
	      "make PYTHON=/path/to/python3.11 ..." >&2; \
	    exit 1; }; \
	  $(PYTHON) -m venv --clear $(VENV); \
	fi; \
	$(BIN)/python -m pip install --quiet --upgrade pip; \
	$(BIN)/python -m pip install --quiet torch==2.13.0+cpu 2>/dev/null \
	  || $(BIN)/python -m pip install --quiet torch==2.13.0+cpu \
	       --index-url https://download.pytorch.org/whl/cpu \
	  || if [ "$$(uname -s)" = Linux ]; then \
	       echo "could not install torch==2.13.0+cpu (no local wheel, and PyTorch's CPU index" \
	         "did not answer): install it into $(VENV) yourself, then run make again; PyPI's" \
	         "torch==2.13.0 is a multi-GB CUDA build on Linux, so it is not taken" >&2; exit 1; \
	     else $(BIN)/python -m pip install --quiet torch==2.13.0; fi; \
	$(BIN)/python -m pip install --quiet -e '.[dev]'; \
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo_swarm.py

lint: $(STAMP)
	$(BIN)/ruff check protocol peer training tests benchmarks examples
	$(BIN)/ruff format --check protocol peer training tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy

# One pytest process per core, at most 4 (each imports torch), idle ones taking tests from
# busy ones (worksteal: the slow end-to-end tests no longer make a long tail): on 2 cores,
# 420 s against 827 s in one process (557 s with xdist's default split), a slow VM.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist worksteal

check: lint typecheck test

bench: $(STAMP)
	$(BIN)/python benchmarks/bootstrap.py
	$(BIN)/python benchmarks/codecs.py
	$(BIN)/python benchmarks/dht.py
	$(BIN)/python benchmarks/allreduce.py

clean:
	rm -rf $(VENV) $(VENV).lock *.egg-info
