# Set-up and the two entry points of the README. Everything installs into $(VENV).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.k3-installed
EVAL_STAMP := $(VENV)/.k3-eval-installed

.PHONY: demo test test-slow test-kernels test-gguf lint format bench docs install clean

# torch==2.13.0 is the CPU wheel these machines carry; installing it first keeps pip from
# resolving `torch>=2.6` to a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# the tests also cover the lm-evaluation-harness adapter: k3[eval] (about 600 MB, a minute to install)
$(EVAL_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,eval]'
	touch $(EVAL_STAMP)

# The main job: train the default model (kimi-k3-tiny) on Shakespeare for a bounded time, report
# validation bits per byte, then generate from a prompt.
DEMO_MINUTES ?= 13
demo: $(STAMP)
	$(VENV)/bin/k3 train --time-budget $(DEMO_MINUTES) --out runs/demo
	$(VENV)/bin/k3 generate --checkpoint runs/demo --prompt "ROMEO:" --max-new-tokens 300

# the default suite, over both cores (pytest-xdist), the 15 slowest tests named at the end (so that one
# that grows shows); the tests marked slow (processes and fresh interpreters) run with test-slow, one at a time
TEST_WORKERS ?= 2
test: $(EVAL_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not kernels and not gguf" --durations=15

test-slow: $(EVAL_STAMP)
	$(PY) -m pytest -q -m slow

# fla's Triton kernels behind k3's ops, run on CPU tensors by Triton's interpreter (tests/kernels): the
# k3[cuda] extra (fla-core, triton: a CPU wheel, no GPU driver) into the same venv; about a minute
KERNELS_STAMP := $(VENV)/.k3-kernels-installed
$(KERNELS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,cuda]'
	touch $(KERNELS_STAMP)

test-kernels: $(KERNELS_STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m kernels tests/kernels

# llama.cpp beside k3 (tests/gguf): llama-cpp-python, which vendors llama.cpp, built from its sdist for this
# CPU (about 5-25 minutes on 2 cores the first time; pip caches the wheel, so later installs take seconds),
# and the same sdist unpacked for llama.cpp's own converter, convert_hf_to_gguf.py
LLAMA_VERSION    ?= 0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
LLAMA_STAMP  := $(VENV)/.k3-llama-$(LLAMA_VERSION)-installed
LLAMA_SOURCE := build/llama-cpp-python-$(LLAMA_VERSION)/vendor/llama.cpp
$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip install -q \
	  --no-binary llama-cpp-python 'llama-cpp-python==$(LLAMA_VERSION)' -e '.[dev,llama]'
	touch $(LLAMA_STAMP)

$(LLAMA_SOURCE)/convert_hf_to_gguf.py:
	@mkdir -p build/sdist
	$(PY) -m pip download -q --no-deps --no-binary :all: 'llama-cpp-python==$(LLAMA_VERSION)' -d build/sdist
	tar -xzf build/sdist/llama_cpp_python-$(LLAMA_VERSION).tar.gz -C build
	mv build/llama_cpp_python-$(LLAMA_VERSION) build/llama-cpp-python-$(LLAMA_VERSION)
	touch $@

test-gguf: $(LLAMA_STAMP) $(LLAMA_SOURCE)/convert_hf_to_gguf.py
	K3_LLAMA_CPP_SOURCE=$(abspath $(LLAMA_SOURCE)) $(PY) -m pytest -q -m gguf tests/gguf

# ruff (pyproject.toml's [tool.ruff]: line length 120, rules E, F, W, I): lint checks without changing a
# file (CI runs it first); format rewrites the files to the formatter's style and applies the safe fixes
RUFF := $(VENV)/bin/ruff
lint: $(STAMP)
	$(RUFF) check .
	$(RUFF) format --check .

format: $(STAMP)
	$(RUFF) format .
	$(RUFF) check --fix .

# The documentation site: the README (its home page), docs/*.md and the API reference from the
# docstrings (mkdocs-material + mkdocstrings: mkdocs.yml), into build/site/index.html. --strict fails on
# any warning; so does any line of the build's output that is not an INFO line (griffe's, mkdocstrings'
# or a theme's), printed first.
DOCS_STAMP := $(VENV)/.k3-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	@mkdir -p build
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site > build/docs.log 2>&1; \
	  status=$$?; cat build/docs.log; \
	  if [ $$status -ne 0 ] || grep -v -e '^INFO ' -e '^ *$$' build/docs.log > /dev/null; then \
	    echo "make docs: the build above failed or printed a warning (build/docs.log)" >&2; exit 1; fi

bench: $(STAMP)
	$(VENV)/bin/k3 bench ops
	$(VENV)/bin/k3 bench train

clean:
	rm -rf $(VENV) build *.egg-info runs
