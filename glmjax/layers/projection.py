"""The projection every layer uses: a bias-free `nnx.Linear` in the config's dtypes."""

from __future__ import annotations

from flax import nnx

from glmjax.config import ModelConfig


def projection(config: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs,
               out_dtype=None) -> nnx.Linear:
    """[..., d_in] -> [..., d_out] in `out_dtype` (default: the config's dtype; the matmul
    accumulates in fp32 either way); kernel [d_in, d_out] (torch's weight transposed)."""
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=config.dtype,
                      param_dtype=config.param_dtype, preferred_element_type=out_dtype,
                      rngs=rngs)
