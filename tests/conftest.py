"""Shared fixtures; markers (``gpu``, ``slow``) are registered in pyproject.toml."""

import zlib

import numpy as np
import pytest

from glmjax.sharding import request_cpu_devices

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of SAME_WORKER in one work unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCompiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path, path)

    return SharedCompiles(config, log)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A NumPy generator seeded from the test's node id: fresh inputs per test, reproducible."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` unless JAX's default device is a GPU."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax  # only initialise a backend when a gpu test was collected

    platform = jax.devices()[0].platform
    if platform != "gpu":
        skip = pytest.mark.skip(reason=f"needs a CUDA GPU; jax's default device is {platform}")
        for item in gpu_items:
            item.add_marker(skip)
