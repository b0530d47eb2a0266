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

.PHONY: install demo test test-fast test-isa bench clean

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

# The numerics tests (fixtures from the reference, Hessians, quantizer invariants) again under other MKL
# code paths: a fixture that holds on one instruction set only then fails on every machine, not just on some.
# MKL_ENABLE_INSTRUCTIONS caps the ISA on Intel CPUs; MKL_CBWR=COMPATIBLE changes the GEMM rounding on AMD too.
test-isa: $(STAMP)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(VENV)/bin/pytest -q -m numerics -p no:cacheprovider
	MKL_ENABLE_INSTRUCTIONS=AVX2 $(VENV)/bin/pytest -q -m numerics -p no:cacheprovider
	MKL_CBWR=COMPATIBLE $(VENV)/bin/pytest -q -m numerics -p no:cacheprovider

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

# Every benchmark in bench/ (not the cross-checks: `make crosscheck`), one JSON per run in
# bench/results/<machine>-<date>.json. Quick mode by default (minutes on a CPU); `make bench BENCH_MODE=`
# runs the full benchmarks, BENCH_ONLY=train_throughput,gptq_speed a subset.
BENCH_MODE ?= --quick
BENCH_ONLY ?=
bench: $(STAMP)
	$(VENV)/bin/python bench/common.py $(BENCH_MODE) $(if $(BENCH_ONLY),--only $(BENCH_ONLY))

clean:
	rm -rf $(VENV) .cache runs results report demo

# Cross-checks against the tools people use (BENCHMARKS.md, "Cross-checks"). GPTQModel pins numpy==2.2.6,
# so the crosscheck extra gets its own venv; it also runs the export tests that load GPTQ checkpoints
# through transformers + GPTQModel (skipped in the main venv). llm-compressor pins transformers <= 5.17:
# a third venv for the AWQ cross-check.
XVENV ?= .cache/venv-crosscheck
AVENV ?= .cache/venv-crosscheck-awq
.PHONY: crosscheck
crosscheck:
	test -x $(XVENV)/bin/python || $(PYTHON) -m venv $(XVENV)
	$(XVENV)/bin/pip install -q --upgrade pip setuptools
	$(XVENV)/bin/pip install -q $(TORCH_SPEC)
	$(XVENV)/bin/pip install -q -e '.[test,eval,crosscheck]'
	GPTQMODEL_CPU_WORKERS=2 $(XVENV)/bin/pytest -q -p no:cacheprovider tests/test_export.py
	GPTQMODEL_CPU_WORKERS=2 $(XVENV)/bin/python bench/crosscheck_gptqmodel.py
	test -x $(AVENV)/bin/python || $(PYTHON) -m venv $(AVENV)
	$(AVENV)/bin/pip install -q --upgrade pip setuptools
	$(AVENV)/bin/pip install -q $(TORCH_SPEC)
	$(AVENV)/bin/pip install -q -e '.[crosscheck-awq]'
	$(AVENV)/bin/python bench/crosscheck_awq.py
