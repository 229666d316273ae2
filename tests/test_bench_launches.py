"""`bench.launches`: the kernel count of optimised HLO text, by hand on a small program and
on one XLA compiles here (the H200 compile itself needs the CUDA plugin: `make
deviceless-plugin`), and the clear exit without the plugin."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from bench.launches import count_launches, h200_device

PROGRAM = """HloModule jit_step

%body (carry: (s32[], f32[4])) -> (s32[], f32[4]) {
  %carry = (s32[], f32[4]{0}) parameter(0)
  %fusion.2 = f32[4]{0} fusion(%gte), kind=kInput, calls=%f2, metadata={op_name="jit(step)/mhc_read/reduce_sum"}
  %pallas_call.1 = f32[4]{0} custom-call(%fusion.2), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %tuple.2 = (s32[], f32[4]{0}) tuple(%add, %pallas_call.1)
}

%cond (carry: (s32[], f32[4])) -> pred[] {
  %carry = (s32[], f32[4]{0}) parameter(0)
  ROOT %fusion.3 = pred[] fusion(%gte.1), kind=kLoop, calls=%f3
}

%branch_0 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %fusion.4 = f32[4]{0} fusion(%x), kind=kLoop, calls=%f4
}

%branch_1 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %fusion.5 = f32[4]{0} fusion(%x), kind=kLoop, calls=%f5
  %fusion.6 = f32[4]{0} fusion(%fusion.5), kind=kLoop, calls=%f6
  ROOT %fusion.7 = f32[4]{0} fusion(%fusion.6), kind=kLoop, calls=%f7
}

ENTRY %main (p: f32[4], caches_mla_0__latent.1: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %caches_mla_0__latent.1 = f32[4]{0} parameter(1)
  %fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%f1, metadata={op_name="jit(step)/decoder_block/add"}
  %tuple = (s32[], f32[4]{0}) tuple(%zero, %fusion.1)
  %while.1 = (s32[], f32[4]) while(%tuple), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"20"}}
  %copy.3 = f32[4]{0} copy(%caches_mla_0__latent.1)
  %conditional.1 = f32[4]{0} conditional(%pred, %copy.3, %copy.3), branch_computations={%branch_0, %branch_1}
  ROOT %bitcast.1 = f32[4]{0} bitcast(%conditional.1)
}
"""


def test_counts_a_program_by_hand():
    found = count_launches(PROGRAM)
    # Each kernel once: the entry's fusion and copy, the loop's three, both branches' four.
    assert found.static == 9
    # A run: 1 + 20 iterations x (2 + 1) + the copy + the larger branch's 3.
    assert found.runtime == 1 + 20 * 3 + 1 + 3
    assert found.loops == [dict(op="while.1", trips=20, launches_an_iteration=3)]
    assert found.by_kind["custom-call:__gpu$xla.gpu.triton"] == 1
    assert found.by_op["fusion:kLoop", "decoder_block/add"] == 1
    assert found.by_op["fusion:kInput", "mhc_read/reduce_sum"] == 1
    assert len(found.cache_copies) == 1


def test_counts_what_xla_compiles():
    def step(x, p):
        x = jax.lax.fori_loop(0, 5, lambda i, m: jnp.sort(m * 2.0 + 1.0, axis=-1), x)
        return jax.lax.cond(p, lambda: jnp.sort(x), lambda: x + 1)

    found = count_launches(jax.jit(step).lower(jnp.zeros((4, 8)), True).compile().as_text())
    (loop,) = found.loops
    assert loop["trips"] == 5 and loop["launches_an_iteration"] >= 1
    assert found.by_kind["sort"] == 2  # the loop's and the branch's, once each
    assert found.runtime >= found.static + 4 * loop["launches_an_iteration"] - 1


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is not None,
                    reason="a PJRT plugin is installed here")
def test_without_the_plugin_it_says_what_to_run():
    with pytest.raises(SystemExit, match="make deviceless-plugin"):
        h200_device()
