"""The flags of the tiny-preset servers the CPU tests start (test_server,
test_server_hardening, test_load, test_fuzz, test_tokenizer): one batch shape, a small
pool. One set for all of them, so that every start after the first reads the compiled
programs from the run's persistent compilation cache (``tests/conftest.py`` gives the run
one folder) instead of compiling them again: a cold start costs ~40 s of CPU, a warm one
~10. test_server_hardening builds its server in the test process and reads the same
cache while it compiles (`glmjax.compile_cache.enabled`)."""

import jax

MAX_MODEL_LEN = 512
TINY_SERVER_ARGS = [
    "--preset", "tiny",
    "--block-size", "64",
    "--max-num-batched-tokens", "128",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--single-bucket",
    "--max-num-seqs", "4",
    "--num-kv-blocks", "48",
    "--num-state-slots", "32",
    "--log-level", "warning",
    # No effect on a CPU but on JAX's cache keys (it adds a GPU flag to XLA_FLAGS, which
    # the keys include): test_server_hardening's engine, built in the test process, would
    # find none of the servers' programs.
    "--no-pin-temporaries",
]  # fmt: skip


def tiny_server_env() -> dict[str, str]:
    """The servers' environment: the CPU, with as many host devices as the test processes
    have (`tests/conftest.py`). JAX keys its cache on the host's device count too, so
    with another count test_server_hardening could not read what the servers compiled."""
    return {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(jax.config.jax_num_cpu_devices)}
