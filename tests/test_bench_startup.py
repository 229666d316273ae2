"""`python -m bench.startup --quick` on the CPU: a cold start precompiles every program,
a start with the cache it filled reads them instead, and the JSON says so (`extended`).
In CI: `glmjax.compile_cache` lets a second process read what the first compiled, and
`compile_cache.enabled` turns the cache on for a block of a running process."""

import json

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("httpx")  # bench.startup polls the server through it

from test_precompile import printed_count  # noqa: E402

from bench.startup import main, parse_args  # noqa: E402
from glmjax import compile_cache  # noqa: E402


@pytest.mark.parametrize("runs", ["warm", "warm,cold", "lazy,warm", "cold,hot", ""])
def test_runs_a_warm_start_cannot_follow_are_refused(runs):
    with pytest.raises(SystemExit):
        parse_args(["--runs", runs])


def test_a_warm_run_alone_needs_a_filled_cache_and_a_cold_one_an_empty_one(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--runs", "warm", "--cache-dir", str(tmp_path)])
    (tmp_path / "entry").write_text("")
    assert parse_args(["--runs", "warm", "--cache-dir", str(tmp_path)]).runs == ["warm"]
    with pytest.raises(SystemExit):
        parse_args(["--runs", "cold,warm", "--cache-dir", str(tmp_path)])


def test_default_output_is_named_after_the_preset():
    assert parse_args(["--server-args", "--preset kimi-linear-48b"]).json.name == (
        "startup_kimi-linear-48b.json")
    assert parse_args(["--quick"]).json.name == "startup_tiny.json"


# Enables the cache in argv[1], compiles one program, prints the cache hits JAX counted.
COMPILE_ONCE = """
import sys
from pathlib import Path
import jax
import jax.numpy as jnp
from glmjax import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda name, **_: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else 0)
compile_cache.enable(Path(sys.argv[1]))
jax.jit(lambda x: jnp.sin(x) @ x)(jnp.ones((16, 16))).block_until_ready()
print(len(hits))
"""


def test_a_second_process_reads_the_programs_the_first_compiled(tmp_path):
    assert printed_count(COMPILE_ONCE, str(tmp_path / "xla")) == 0
    entries = {p.name for p in (tmp_path / "xla").iterdir()}
    assert any(name.startswith("jit__lambda") for name in entries), entries
    assert printed_count(COMPILE_ONCE, str(tmp_path / "xla")) >= 1


def test_the_cache_is_on_inside_enabled_only(tmp_path):
    """In this process, whose compiles began without the cache: a program compiled inside
    the block is written, one compiled after it is not, and JAX's settings are back."""
    before = jax.config.jax_compilation_cache_dir
    with compile_cache.enabled(tmp_path):
        jax.jit(lambda x: jnp.cos(x) + 1)(jnp.ones(7)).block_until_ready()
    inside = {p.name for p in tmp_path.iterdir()}
    assert any(name.startswith("jit__lambda") for name in inside), inside
    jax.jit(lambda x: jnp.tan(x) * 3)(jnp.ones(5)).block_until_ready()
    assert {p.name for p in tmp_path.iterdir()} == inside
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.extended  # ~50-100 s on two busy cores: two server starts, one compiling
def test_quick_cold_then_warm_start(tmp_path):
    path = tmp_path / "startup.json"
    main(["--quick", "--runs", "cold,warm", "--cache-dir", str(tmp_path / "xla"),
          "--json", str(path)])
    result = json.loads(path.read_text())

    cold, warm = result["runs"]["cold"], result["runs"]["warm"]
    assert result["device"] == "cpu" and result["server_args"][:2] == ["--preset", "tiny"]
    # --single-bucket: prefill, decode, the row gather, the sampler's 6 variants, the two
    # copies, the staging of the decode batch in its pinned buffers (which feeds the
    # placeholder tokens) and the copy of the decode's status (serving.pinned).
    assert cold["precompiled_programs"] == warm["precompiled_programs"] == 13
    assert 0 < cold["server_ready_after_s"] < cold["ready_s"]
    # The warm start reads the executables the cold one wrote (cold: ~40 s, warm: ~6 s).
    assert warm["precompile_s"] < 0.5 * cold["precompile_s"]
    assert any((tmp_path / "xla").iterdir())
    assert cold["cache_hits"] == 0 and warm["cache_hits"] >= 7
    assert cold["backend_s_summed"] > 0 and warm["lowering_s_summed"] > 0


def test_a_server_not_ready_in_time_is_recorded_and_stopped(tmp_path):
    path = tmp_path / "startup.json"
    main(["--quick", "--runs", "cold", "--start-timeout", "1", "--cache-dir",
          str(tmp_path / "xla"), "--json", str(path)])
    (cold,) = json.loads(path.read_text())["runs"].values()

    assert cold["ready_s"] is None and "did not start" in cold["error"]
