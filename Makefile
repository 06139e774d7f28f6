# Works on a bare machine with only python3: everything else lands in .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install check test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The fast lane (at most 90 s on 2 cores): ruff and the in-process tests, tests/unit and
# tests/engine. `make test` runs every lane.
check: install
	scripts/check.sh

test: install
	$(BIN)/ruff check .
	scripts/test.sh

lint: install
	$(BIN)/ruff check .

demo: install
	$(BIN)/cortex demo

bench: install
	$(BIN)/python bench/parser.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
