# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench-smoke clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[engine,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hybridcache demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench-smoke: $(STAMP)
	$(BIN)/hybridcache bench kv-match --smoke

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
