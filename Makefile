# One command per job: `make test`, `make serve`. Works from a fresh clone with no venv.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where the GPU tests run (the H200 image's own python3; no venv is built there).
GPU_PYTHON ?= python3

# The pyenv shim `python3.12` exists here but fails without PYENV_VERSION, so every
# candidate is tried by running it, not by looking it up.
PYTHON_CANDIDATES := python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) \
	python3.13 $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) python3

.PHONY: venv test test-extended lint serve test-gpu device-wheels deviceless-plugin

venv: $(STAMP)

$(PYTHON):
	@for py in $(PYTHON_CANDIDATES); do \
	  if "$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then \
	    echo "creating $(VENV) with $$py"; \
	    exec "$$py" -m venv "$(VENV)"; \
	  fi; \
	done; \
	echo "error: no Python >= 3.12 found (tried: $(PYTHON_CANDIDATES))" >&2; exit 1

# pip byte-compiles what it installs on one core; compileall on every core does the same
# in ~20 s instead of ~35 s of CI's set-up.
$(STAMP): pyproject.toml constraints.txt | $(PYTHON)
	$(PYTHON) -m pip install --quiet --no-compile -c constraints.txt -e '.[test]'
	$(PYTHON) -m compileall -q -j 0 "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $@

lint: venv
	$(VENV)/bin/ruff check .

# Two pytest workers (pytest-xdist): most tests compile or run on one core, so one worker
# left the CI's second core idle about half the time. --dist loadfile keeps each file in one
# worker, so its module-scoped fixtures (servers, engines) are built once. The 15 slowest
# tests close the log: the suite must stay under CI's 20 minutes on 2 cores. Most of its
# time is XLA compiling small CPU programs: LLVM at -O1 ran a third of the suite 5% faster
# than the default -O2 (both runs side by side); an -O level in the caller's XLA_FLAGS wins.
# The tests marked `extended` (the benchmarks' quick runs, the four-process tests, the
# server on a 4 x 4 mesh, the scanned model on a mesh, the model on the TP2 and one-device
# meshes, a few kernel cases: ~700 s of CPU) do not fit in CI's budget beside the rest:
# `make test-extended` runs them, before every push that touches bench/, the
# multi-process or mesh code, the kernels or what they call.
PYTEST_CPU = XLA_FLAGS="--xla_backend_optimization_level=1 $$XLA_FLAGS" $(PYTHON) -m pytest -q \
	-n 2 --dist loadfile --durations=15
test: lint
	$(PYTEST_CPU) -m "not gpu and not extended"

test-extended: venv
	$(PYTEST_CPU) -m "extended and not gpu"

serve: venv
	$(PYTHON) -m serving.server $(SERVE_ARGS)

test-gpu:
	$(GPU_PYTHON) -m pytest -q -m gpu

# The wheels the H200 image lacks, for the device tool's `carry: [".whl"]`
# (bench/device_wheels.txt; bench/device_calls.sh installs them there).
device-wheels: venv
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
	  -d .whl -r bench/device_wheels.txt

# The CUDA PJRT plugin of the installed jax, unpacked into .cuda-plugin: XLA then compiles
# for an H200 on a machine without one (`python -m bench.launches`).
deviceless-plugin: venv
	version=$$($(PYTHON) -c 'import jax; print(jax.__version__)') && \
	  $(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux_2_27_x86_64 -d .cuda-plugin/wheels \
	  "jax-cuda13-plugin==$$version" "jax-cuda13-pjrt==$$version"
	cd .cuda-plugin && for w in wheels/*.whl; do $(abspath $(PYTHON)) -m zipfile -e "$$w" .; done
