# quantdyn — set-up is two commands on a fresh machine:
#   make demo   creates .venv, installs, runs the embedded-default study
#   make test   creates .venv, installs, runs the whole test suite
# TORCH_SPEC pins the CPU build for machines without a GPU; a GPU user sets e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[test,eval]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/quantdyn demo

test: $(STAMP)
	$(VENV)/bin/pytest -q --timeout=900

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

bench: $(STAMP)
	for b in bench/*.py; do $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .cache runs results report demo
