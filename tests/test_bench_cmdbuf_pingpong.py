"""`bench.cmdbuf_pingpong` on the CPU: both variants timed in every repeat, the two
executables of the second variant really two (each compiled once), and the chain the
same program either way."""

import json

import jax.numpy as jnp
import numpy as np

from bench.cmdbuf_pingpong import chain, main, make_step


def test_quick_run_times_both_variants_in_every_repeat(tmp_path):
    path = tmp_path / "pingpong.json"
    main(["--kernels", "6", "--calls", "20", "--dim", "64", "--repeats", "2", "--out",
          str(path)])
    runs = json.loads(path.read_text())["runs"]
    assert [(r["variant"], r["repeat"]) for r in runs] == [
        ("one executable", 0), ("two in turn", 0), ("one executable", 1), ("two in turn", 1)]
    assert all(r["median_ms"] > 0 and r["mean_ms"] > 0 for r in runs)


def test_two_steps_are_two_executables_of_one_program():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 32, 32)) / 6, jnp.float32)
    a, b = make_step("step_x", 6), make_step("step_y", 6)
    assert "jit_step_x" in a.lower(x, w).as_text() and "jit_step_y" in b.lower(x, w).as_text()
    np.testing.assert_array_equal(np.asarray(a(x, w)), np.asarray(b(x, w)))
    np.testing.assert_allclose(np.asarray(a(x, w)), np.asarray(chain(x, w, kernels=6)),
                               rtol=1e-6)
