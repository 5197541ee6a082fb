"""Schedules of the crossbatch spec (d / w / segments) over training steps.

A schedule maps a step to a crossbatch spec ({'d', 'w'} or {'segments'}; see
crossbatch.py). Kinds:

* constant: {'kind': 'constant', 'spec': S}
* stages:   {'kind': 'stages', 'stages': [(0, S0), (450000, S1)]}  switch at steps (d=2 then d=64)
* random:   {'kind': 'random', 'choices': [S0, S1], 'seed': 0}  seeded draw per step ({2, 128})
* metric:   {'kind': 'metric', 'before': S0, 'after': S1, 'metric': 'accuracy',
             'threshold': 0.98, 'window': 10, 'max_step': None}
            switch once the moving average of a training metric over `window`
            steps reaches `threshold` (the paper's "d=1 until 98% accuracy, then
            d=128"); `max_step` optionally forces the switch by that step.

Every kind keeps its state in `state_dict()`, which is saved with checkpoints so a
resumed run follows the same schedule.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Any, Dict, List

from fot_jax import crossbatch

KINDS = ("constant", "stages", "random", "metric")


def _as_dict(x) -> Dict[str, Any]:
  if x is None:
    return {}
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  return dict(x)


class Schedule:
  def __init__(self, config):
    cfg = _as_dict(config)
    self.kind = cfg.get("kind", "constant")
    if self.kind not in KINDS:
      raise ValueError(f"curriculum.kind: must be one of {KINDS}, got {self.kind!r}")
    self.cfg = cfg
    self.switched_at = None  # metric kind
    self.history = collections.deque(maxlen=int(cfg.get("window", 1) or 1))
    specs = self.all_specs()
    packs = {crossbatch.pack_size(s) for s in specs}
    if len(packs) > 1:
      raise ValueError(f"curriculum: every stage must use the same pack size k (windows per slot); "
                       f"got k in {sorted(packs)} from specs {specs}")
    if self.kind == "stages":
      starts = [int(s) for s, _ in cfg["stages"]]
      if not starts or starts[0] != 0 or starts != sorted(starts):
        raise ValueError(f"curriculum.stages: start steps must begin at 0 and increase, got {starts}")
    if self.kind == "random" and not cfg.get("choices"):
      raise ValueError("curriculum.choices: the random kind needs at least one spec")

  def all_specs(self) -> List[dict]:
    c, k = self.cfg, self.kind
    if k == "constant":
      return [_as_dict(c.get("spec"))]
    if k == "stages":
      return [_as_dict(s) for _, s in c["stages"]]
    if k == "random":
      return [_as_dict(s) for s in c.get("choices", [])]
    return [_as_dict(c["before"]), _as_dict(c["after"])]

  @property
  def pack(self) -> int:
    return crossbatch.pack_size(self.all_specs()[0])

  def spec(self, step: int) -> dict:
    c, k = self.cfg, self.kind
    if k == "constant":
      return _as_dict(c.get("spec"))
    if k == "stages":
      current = None
      for start, s in c["stages"]:
        if step >= int(start):
          current = s
      return _as_dict(current)
    if k == "random":
      # A hash of (seed, step) rather than a stateful RNG: resume-safe by construction.
      digest = hashlib.sha256(f"{c.get('seed', 0)}:{step}".encode()).digest()
      choices = c["choices"]
      return _as_dict(choices[int.from_bytes(digest[:8], "little") % len(choices)])
    switched = self.switched_at is not None and step >= self.switched_at
    return _as_dict(c["after"] if switched else c["before"])

  def observe(self, step: int, metrics: Dict[str, float]) -> None:
    """Feed the metrics of `step`; may trigger the metric switch for step + 1."""
    if self.kind != "metric" or self.switched_at is not None:
      return
    name = self.cfg.get("metric", "accuracy")
    if name not in metrics:
      raise ValueError(f"curriculum.metric: training metric {name!r} not produced; "
                       f"available: {sorted(metrics)}")
    self.history.append(float(metrics[name]))
    full = len(self.history) == self.history.maxlen
    reached = full and sum(self.history) / len(self.history) >= float(self.cfg["threshold"])
    max_step = self.cfg.get("max_step")
    if reached or (max_step is not None and step + 1 >= int(max_step)):
      self.switched_at = step + 1

  def state_dict(self) -> dict:
    return {"switched_at": -1 if self.switched_at is None else int(self.switched_at),
            "history": list(self.history)}

  def load_state_dict(self, state: dict) -> None:
    s = int(state.get("switched_at", -1))
    self.switched_at = None if s < 0 else s
    self.history.clear()
    self.history.extend(float(x) for x in state.get("history", []))
