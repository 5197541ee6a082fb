"""A model's parameters: initialised, or only their shapes (nothing allocated)."""
from __future__ import annotations

from typing import Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel


def init_params(cfg: ModelConfig, seed: int, seq_len: int = 8, boxed: bool = False):
  """Parameters; `boxed` keeps flax's logical-axis metadata (for sharding specs)."""
  model = LlamaModel(cfg)
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, seq_len), jnp.int32))["params"]
  return params if boxed else nn.meta.unbox(params)


def param_shapes(cfg: ModelConfig) -> Dict[Tuple[str, ...], Tuple[int, ...]]:
  """{param path: shape} of the model, without allocating it."""
  tree = jax.eval_shape(lambda: init_params(cfg, 0))
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}
