"""The optimizer and which parameters train: make_optimizer (optim config -> optax AdamW chain) and
`train.trainable` (resolve_trainable: regexes and group names -> Trainable; count_trainable).

Kept apart from the step and the loop (no orbax, no model apply here): fot_jax.configs calls
resolve_trainable to validate a config before anything is traced.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Dict, Optional, Tuple

import jax
import optax
from flax import traverse_util

from fot_jax.model.config import ModelConfig
from fot_jax.model.init import init_params
from fot_jax.settings import OptimSettings


def make_optimizer(opt) -> optax.GradientTransformation:
  """opt: an OptimSettings, or a dict of its fields (read by OptimSettings.from_dict)."""
  opt = OptimSettings.from_dict(opt)
  lr, warmup = opt.lr, opt.warmup_steps
  if opt.schedule == "constant":
    sched = optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)],
                                 [max(warmup, 1)]) if warmup else optax.constant_schedule(lr)
  else:  # cosine
    warm = max(warmup, 1)  # optax needs a warmup of at least one step and a decay after it
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(opt.total_steps, warm + 1),
                                               end_value=lr * opt.final_lr_fraction)
  chain = []
  if opt.clip_norm:
    chain.append(optax.clip_by_global_norm(opt.clip_norm))
  chain.append(optax.adamw(sched, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay))
  return optax.chain(*chain)


# `train.trainable` names for groups that depend on the model config (expanded to regexes).
TRAINABLE_GROUPS = {
    "memory_attention": "the attention (q/k/v/o and any memory-only parameters) of the memory layers",
    "memory_layers": "every parameter of the memory layers (attention, MLP, norms)",
}


@dataclasses.dataclass(frozen=True)
class Trainable:
  """The parameters a run updates: regexes, each fully matching '/'-joined parameter paths
  ('layers_8/self_attn/q_proj/kernel'). Frozen parameters get no gradient (the step
  differentiates the trainable subtree only, so no weight gradients and no backward pass below
  the lowest trainable layer), no optimizer state and no update: they stay bit-identical."""
  patterns: Tuple[str, ...]

  def matches(self, path: str) -> bool:
    return any(re.fullmatch(p, path) for p in self.patterns)

  def select(self, tree):
    """The trainable leaves of a parameter tree (boxed or not), as a nested dict."""
    flat = traverse_util.flatten_dict(tree, sep="/")
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if self.matches(k)}, sep="/")

  def merge(self, full, sub):
    """`full` with the trainable leaves taken from `sub` (same structure as `full`)."""
    flat = traverse_util.flatten_dict(full, sep="/")
    flat.update(traverse_util.flatten_dict(sub, sep="/"))
    return traverse_util.unflatten_dict(flat, sep="/")


@functools.lru_cache(maxsize=8)  # one trace of the model's init per config: resolve + count at start-up
def parameter_paths(cfg: ModelConfig) -> Dict[str, int]:
  """{'/'-joined parameter path: size} of a model config (abstract: nothing is allocated; callers
  must not mutate the returned dict, which is shared)."""
  shapes = jax.eval_shape(lambda: init_params(cfg, 0))
  return {k: math.prod(v.shape) for k, v in traverse_util.flatten_dict(shapes, sep="/").items()}


def resolve_trainable(spec, cfg: ModelConfig, field: str = "train.trainable") -> Optional[Trainable]:
  """`train.trainable` -> Trainable, or None (every parameter trains). spec: None, 'all', or a
  string / list of regexes over parameter paths and group names (TRAINABLE_GROUPS). A pattern
  that matches no parameter is an error naming it."""
  if spec is None or spec == "all" or (not isinstance(spec, str) and len(spec) == 0):
    return None
  items = [spec] if isinstance(spec, str) else [str(x) for x in spec]
  layers = "|".join(str(i) for i in cfg.mem_layers)
  patterns = []
  for item in items:
    if item == "all":
      return None
    if item in TRAINABLE_GROUPS:
      if not cfg.mem_layers:
        raise ValueError(f"{field}: {item!r} needs memory layers (model.mem_layers is empty)")
      item = f"layers_({layers})/self_attn/.*" if item == "memory_attention" else f"layers_({layers})/.*"
    try:
      re.compile(item)
    except re.error as e:
      raise ValueError(f"{field}: {item!r} is not a regular expression ({e})") from None
    patterns.append(item)
  paths = parameter_paths(cfg)
  for p, item in zip(patterns, items):
    if not any(re.fullmatch(p, k) for k in paths):
      raise ValueError(f"{field}: {item!r} matches no parameter (paths look like "
                       f"{sorted(paths)[:3]}...; groups: {sorted(TRAINABLE_GROUPS)})")
  return Trainable(tuple(patterns))


def count_trainable(cfg: ModelConfig, trainable: Optional[Trainable]) -> Tuple[int, int]:
  """(trainable parameters, all parameters) of a model config."""
  paths = parameter_paths(cfg)
  total = sum(paths.values())
  return (total if trainable is None else sum(n for k, n in paths.items() if trainable.matches(k))), total
