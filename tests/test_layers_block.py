"""DecoderBlock against the composition of the layer oracles: KDA + plain residual + dense
MLP (Kimi-like) here; MLA + mHC streams + MoE (GLM-like) through the MTP head in
test_layers_mtp.py, which is that block."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_layers_kda import kda_oracle
from test_layers_mla import oracle as mla_oracle_of
from test_layers_moe import moe_params
from test_layers_oracles import (
    cu_seqlens_of,
    f64,
    mhc_oracle,
    moe_oracle,
    random_module,
    rms_norm,
    swiglu_oracle,
)

from glmjax.config import ModelConfig
from glmjax.layers.block import DecoderBlock
from glmjax.layers.kda import KDAState
from glmjax.layers.mhc import HyperConnection
from glmjax.layers.moe import MoE
from glmjax.layers.packing import PackedBatch

NUM_TOKENS = 24


def residual_oracle(residual, config, x, sublayer):
    """Plain: x + F(x); mHC: the stream update around F."""
    if not isinstance(residual, HyperConnection):
        return x + sublayer(x)
    params = {
        name: f64(getattr(residual, name)) for name in ("phi", "alpha", "b_pre", "b_post", "b_res")
    }
    return mhc_oracle(params, x, sublayer, iters=config.mhc_sinkhorn_iters, eps=config.rms_norm_eps)


def ffn_oracle(block, config, x):
    if isinstance(block.mlp, MoE):
        return moe_oracle(
            moe_params(block.mlp),
            x,
            top_k=config.num_experts_per_token,
            scaling=config.routed_scaling_factor,
            limit=config.swiglu_limit,
        )
    mlp = block.mlp
    return swiglu_oracle(
        x, f64(mlp.gate_proj.kernel), f64(mlp.up_proj.kernel), f64(mlp.down_proj.kernel), None
    )


def block_oracle(block, config, residual, mixer):
    """mixer: normed input [T, D] -> output [T, D] (float64)."""
    eps = config.rms_norm_eps
    residual = residual_oracle(
        block.mixer_residual,
        config,
        f64(residual),
        lambda u: mixer(rms_norm(u, f64(block.input_layernorm.weight), eps)),
    )
    return residual_oracle(
        block.mlp_residual,
        config,
        residual,
        lambda u: ffn_oracle(
            block, config, rms_norm(u, f64(block.post_attention_layernorm.weight), eps)
        ),
    )


def packed_mla_oracle(block, config, cu):
    """Mixer oracle: causal MLA per packed sequence, zero on padding rows."""

    def mixer(x):
        out = np.zeros_like(x)
        for n in range(len(cu) - 1):
            if cu[n + 1] > cu[n]:
                out[cu[n] : cu[n + 1]] = mla_oracle_of(block.mixer, config, x[cu[n] : cu[n + 1]])
        return out

    return mixer


def test_kda_block_with_plain_residual_and_dense_mlp(rng):
    config = dataclasses.replace(ModelConfig.preset("tiny"), mhc_streams=None, kda_gate="softplus")
    block = random_module(
        lambda: DecoderBlock(config, "kda", dense_mlp=True, rngs=nnx.Rngs(0)), rng
    )
    cu = cu_seqlens_of([6, 0, 13])
    offsets = np.array([[3, -1], [-1, -1], [13, 1]], np.int32)
    heads, dim = config.kda_num_heads, config.kda_head_dim
    state = KDAState(
        rng.normal(size=(3, heads, dim, dim)).astype(np.float32) * 0.3,
        rng.normal(size=(3, config.conv_channels, 3)).astype(np.float32),
    )
    x = rng.normal(size=(NUM_TOKENS, config.hidden_size)).astype(np.float32)
    batch = PackedBatch(jnp.asarray(cu), None, None, jnp.asarray(offsets))
    out, new_state, snapshots = nnx.jit(lambda b, x, s: b(x, batch, s))(
        block, jnp.asarray(x), KDAState(*map(jnp.asarray, state))
    )
    results = {}

    def mixer(u):
        y, results["state"], results["snaps"] = kda_oracle(
            block.mixer, config, u, cu, state, offsets
        )
        return y

    expected = block_oracle(block, config, x, mixer)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        new_state.recurrent, results["state"].recurrent, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(snapshots.conv, results["snaps"].conv, rtol=1e-5, atol=1e-5)
