"""Shared fixtures; markers (``gpu``, ``slow``) are registered in pyproject.toml."""

import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest

from glmjax.sharding import request_cpu_devices

# The servers, prefills and benchmarks the tests start keep their persistent compilation
# cache (`glmjax.compile_cache`, under $XDG_CACHE_HOME) in one folder per run that the run's
# processes share (xdist's workers inherit the variable): never the user's own cache, and
# no run reads an earlier run's programs. The process that made the folder removes it.
# Triton's kernel cache too (the AOT tests compile with the official Triton compiler, which
# would otherwise write ~60 MB a run into ~/.triton).
RUN_CACHE = "GLMJAX_TEST_RUN_CACHE"
OWNS_RUN_CACHE = RUN_CACHE not in os.environ
if OWNS_RUN_CACHE:
    os.environ[RUN_CACHE] = tempfile.mkdtemp(prefix="glmjax-tests-")
os.environ["XDG_CACHE_HOME"] = os.environ[RUN_CACHE]
os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ[RUN_CACHE], "triton")

# tests/test_sharding.py runs meshes of up to 8 devices. On a CPU those are host devices,
# whose count JAX fixes when its first backend starts: ask for them before any test runs.
NUM_CPU_DEVICES = 8
request_cpu_devices(NUM_CPU_DEVICES)

# `make test` runs two workers (pytest-xdist, --dist loadfile), each taking whole files.
# These files run the programs another file compiles (the same jitted functions and
# shapes, cached by JAX within a process), so they go to that file's worker: elsewhere
# they would compile everything again.
SAME_WORKER = {
    "tests/test_engine_faults.py": "tests/test_engine.py",
    "tests/test_speculative.py": "tests/test_engine.py",
    "tests/test_mixed.py": "tests/test_model.py",
}


# The files that take longest on the two-core CI box (CPU seconds per file under `make
# test`), longest first: they start first, so the run does not end on one of them while
# the other worker idles. xdist would otherwise queue files by their number of tests, which
# puts these few-test, long files last. test_server starts early too: its server fills the
# run's compilation cache that the other tiny-preset servers (`tests/tiny_server.py`), in
# files queued after it, read.
LONGEST_FIRST = (
    "tests/test_engine.py",
    "tests/test_kda_kernel.py",
    "tests/test_sharding.py",
    "tests/test_layer_scan.py",
    "tests/test_model.py",
    "tests/test_aot.py",
    "tests/test_server.py",
    "tests/test_offline_prefill.py",
    "tests/test_bench_startup.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of SAME_WORKER in one work unit, in collection order
    (`pytest_collection_modifyitems` puts LONGEST_FIRST first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCompiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path, path)

    config.option.loadscopereorder = False
    return SharedCompiles(config, log)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A NumPy generator seeded from the test's node id: fresh inputs per test, reproducible."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's files first (each file's tests keep their order); skip tests marked
    ``gpu`` unless JAX's default device is a GPU."""
    def rank(item) -> int:
        path = SAME_WORKER.get(f"tests/{item.path.name}", f"tests/{item.path.name}")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax  # only initialise a backend when a gpu test was collected

    platform = jax.devices()[0].platform
    if platform != "gpu":
        skip = pytest.mark.skip(reason=f"needs a CUDA GPU; jax's default device is {platform}")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if OWNS_RUN_CACHE:
        shutil.rmtree(os.environ[RUN_CACHE], ignore_errors=True)
