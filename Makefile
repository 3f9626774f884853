# Setup is part of every target: a fresh clone needs nothing but `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/verispec demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
