"""The projection every layer uses: a bias-free `nnx.Linear` in the config's dtypes."""

from __future__ import annotations

from flax import nnx

from glmjax.config import ModelConfig


def projection(config: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs) -> nnx.Linear:
    """[..., d_in] -> [..., d_out]; kernel [d_in, d_out] (torch's weight transposed)."""
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=config.dtype,
                      param_dtype=config.param_dtype, rngs=rngs)
