"""glmjax: the hybrid KDA / MLA model in Flax NNX."""

from glmjax.config import ModelConfig

__all__ = ["ModelConfig"]
