# Setup is part of every target: a fresh clone needs nothing but `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean browser peers

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/verispec demo

# llama.cpp as a bench peer (`verispec bench` methods llamacpp, llamacpp-lookup): llama-cpp-python compiled from
# source for this CPU (about 20 minutes on 2 cores), into .venv. Never part of `make test`.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
peers: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check scikit-build-core diskcache
	CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install --disable-pip-version-check \
	  --no-build-isolation --no-deps $(LLAMA_CPP_PYTHON)

# Headless Chromium for the browser checks of the HTML trace: installed with apt-get when absent and we are
# root; never fails the build (the tests then skip, saying why).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: the browser tests of the HTML trace will skip"

# The suite in one pytest-xdist worker per core, each on one torch thread (tests/conftest.py); loadgroup hands
# out one test at a time as a worker frees, which kept the workers busiest, except the tests that start a local
# Ray (group "ray"): one worker runs them all on one Ray, started once, never waiting on another. A plain
# `pytest -q` runs the same tests one after another. The 25 slowest are listed at the end (the suite's budget
# is 10 minutes on a fresh clone: what to trim first).
test: $(STAMP) browser lint
	$(BIN)/python -m pytest -q -n auto --dist loadgroup --durations=25

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
