"""Typed, validated sections of an experiment's settings: each is read from its dict once, by one
validator whose errors name the field, and what runs below takes the object. Light (no JAX), so
entry points and the study's config checks use it before anything heavy loads.

  OptimSettings  `c.optim` of an experiment, `finetune.optim` of a study: AdamW with a constant or
                 cosine learning-rate schedule (fot_jax.train.make_optimizer builds it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

SCHEDULES = ("constant", "cosine")


def _number(value, where: str, kind=float):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
    raise ValueError(f"{where}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
  return kind(value)


@dataclasses.dataclass(frozen=True)
class OptimSettings:
  """AdamW: lr (peak), warmup_steps (linear from 0), schedule ('constant', or 'cosine' decaying to
  final_lr_fraction x lr at total_steps), weight_decay, clip_norm (0: none), b1, b2."""
  lr: float
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 0
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  clip_norm: float = 0.0
  b1: float = 0.9
  b2: float = 0.95

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "optim") -> "OptimSettings":
    """The one reader of optimiser settings: unknown fields and bad values fail naming `where.FIELD`."""
    if isinstance(d, OptimSettings):
      return d
    d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
      raise ValueError(f"{where}: unknown field(s) {unknown}; known: {known}")
    if "lr" not in d:
      raise ValueError(f"{where}.lr: required (the peak learning rate)")
    out = {}
    for f in dataclasses.fields(cls):
      if f.name in d and f.name != "schedule":
        out[f.name] = _number(d[f.name] if d[f.name] is not None else 0, f"{where}.{f.name}",
                              int if f.name.endswith("_steps") else float)
    schedule = d.get("schedule", "constant")
    if schedule not in SCHEDULES:
      raise ValueError(f"{where}.schedule: must be 'constant' or 'cosine', got {schedule!r}")
    s = cls(schedule=schedule, **out)
    if not s.lr > 0:
      raise ValueError(f"{where}.lr: must be positive, got {s.lr}")
    for name in ("warmup_steps", "total_steps", "final_lr_fraction", "weight_decay", "clip_norm"):
      if getattr(s, name) < 0:
        raise ValueError(f"{where}.{name}: must not be negative, got {getattr(s, name)}")
    for name in ("b1", "b2"):
      if not 0 <= getattr(s, name) < 1:
        raise ValueError(f"{where}.{name}: must be in [0, 1), got {getattr(s, name)}")
    return s
