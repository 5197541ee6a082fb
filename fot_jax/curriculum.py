"""Schedules over training steps: the crossbatch spec (d / w / segments) and the data task.

A schedule maps a step to a crossbatch spec ({'d', 'w'} or {'segments'}; see
crossbatch.py) and, for curricula over tasks, to the name of the data task the step
trains on. Kinds:

* constant: {'kind': 'constant', 'spec': S}
* stages:   {'kind': 'stages', 'stages': [(0, S0), (450000, S1)]}  switch at steps (d=2 then d=64)
* random:   {'kind': 'random', 'choices': [S0, S1], 'seed': 0}  seeded draw per step ({2, 128})
* metric:   {'kind': 'metric', 'before': S0, 'after': S1, 'metric': 'accuracy',
             'threshold': 0.98, 'window': 10, 'max_step': None}
            switch once the moving average of a training metric over `window`
            steps reaches `threshold` (the paper's "d=1 until 98% accuracy, then
            d=128"); `max_step` optionally forces the switch by that step.
* phases:   {'kind': 'phases', 'phases': [P0, P1, ...], 'stop_after_last': True}
            the general form (docs/semantics.md, "Curriculum"); the kinds above are
            special cases of it. A phase is
              {'name': 'copy', 'task': 'copy', 'spec': S,
               'steps': N}                                 # a fixed number of steps, or
              {..., 'metric': 'accuracy', 'threshold': 0.95, 'window': 5,
               'max_steps': N}                             # until the moving average reaches
                                                           # the threshold (at most N steps)
            and a phase with neither runs until `train.steps`. `task` names a data
            task of the run (None: the run's only one). With `stop_after_last`, the run
            ends when its last phase ends (e.g. once the final accuracy is reached).

Phases after the first start when the previous one ends: at a known step for fixed
lengths, at the step after the threshold was reached for metric phases. Every kind
keeps its state in `state_dict()` (the phases' start steps and the metric history),
saved with checkpoints, so a resumed run follows the same schedule.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Any, Dict, List, Optional

from fot_jax import crossbatch

KINDS = ("constant", "stages", "random", "metric", "phases")
PHASE_FIELDS = ("name", "task", "spec", "steps", "metric", "threshold", "window", "max_steps")


def _as_dict(x) -> Dict[str, Any]:
  if x is None:
    return {}
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  return dict(x)


def _phases(kind: str, c: dict) -> List[dict]:
  """Every kind but 'random' as a list of phases."""
  if kind == "constant":
    return [{"spec": _as_dict(c.get("spec"))}]
  if kind == "stages":
    starts = [int(s) for s, _ in c["stages"]]
    if not starts or starts[0] != 0 or starts != sorted(starts):
      raise ValueError(f"curriculum.stages: start steps must begin at 0 and increase, got {starts}")
    ends = starts[1:] + [None]
    return [{"spec": _as_dict(s), "steps": None if e is None else e - b}
            for (b, s), e in zip(zip(starts, [s for _, s in c["stages"]]), ends)]
  if kind == "metric":
    return [{"spec": _as_dict(c["before"]), "metric": c.get("metric", "accuracy"),
             "threshold": c["threshold"], "window": c.get("window", 1), "max_steps": c.get("max_step")},
            {"spec": _as_dict(c["after"])}]
  phases = [_as_dict(p) for p in c.get("phases") or []]
  if not phases:
    raise ValueError("curriculum.phases: the phases kind needs at least one phase")
  for i, p in enumerate(phases):
    unknown = sorted(set(p) - set(PHASE_FIELDS))
    if unknown:
      raise ValueError(f"curriculum.phases[{i}]: unknown field(s) {unknown}; known: {list(PHASE_FIELDS)}")
    if p.get("steps") is not None and p.get("threshold") is not None:
      raise ValueError(f"curriculum.phases[{i}]: give either 'steps' or 'threshold' (+ 'max_steps'), not both")
    for f in ("steps", "max_steps", "window"):
      if p.get(f) is not None and int(p[f]) <= 0:
        raise ValueError(f"curriculum.phases[{i}].{f}: must be positive, got {p[f]}")
    p["spec"] = _as_dict(p.get("spec"))
  return phases


class Schedule:
  def __init__(self, config):
    cfg = _as_dict(config)
    self.kind = cfg.get("kind", "constant")
    if self.kind not in KINDS:
      raise ValueError(f"curriculum.kind: must be one of {KINDS}, got {self.kind!r}")
    self.cfg = cfg
    if self.kind == "random" and not cfg.get("choices"):
      raise ValueError("curriculum.choices: the random kind needs at least one spec")
    self.phases = [] if self.kind == "random" else _phases(self.kind, cfg)
    self.stop_after_last = bool(cfg.get("stop_after_last", False))
    self.starts = [0]  # start step of every phase entered so far
    self.finished_at: Optional[int] = None  # the step after the last phase ended (stop_after_last)
    self.history = collections.deque()
    self._reset_history()
    specs = self.all_specs()
    packs = {crossbatch.pack_size(s) for s in specs}
    if len(packs) > 1:
      raise ValueError(f"curriculum: every stage must use the same pack size k (windows per slot); "
                       f"got k in {sorted(packs)} from specs {specs}")

  def all_specs(self) -> List[dict]:
    if self.kind == "random":
      return [_as_dict(s) for s in self.cfg.get("choices", [])]
    return [p["spec"] for p in self.phases]

  def tasks(self) -> List[Optional[str]]:
    """The data task of every phase (None: the run's default task)."""
    return [p.get("task") for p in self.phases] or [None]

  @property
  def pack(self) -> int:
    return crossbatch.pack_size(self.all_specs()[0])

  @property
  def switched_at(self) -> Optional[int]:
    """The step the second phase started at (the metric kind's switch), if it has."""
    return self.starts[1] if len(self.starts) > 1 else None

  def _length(self, i: int) -> Optional[int]:
    p = self.phases[i]
    n = p.get("steps") if p.get("steps") is not None else p.get("max_steps")
    return None if n is None else int(n)

  def _reset_history(self):
    p = self.phases[len(self.starts) - 1] if self.phases else {}
    self.history = collections.deque(maxlen=int(p.get("window") or 1))

  def _starts_through(self, step: int) -> List[int]:
    """Start steps of the phases up to the one `step` trains in: those entered so far, then
    fixed lengths ahead (a metric phase may still end earlier, once its metrics are observed)."""
    i = max(j for j, s in enumerate(self.starts) if s <= step)
    starts = self.starts[:i + 1]
    while i == len(self.starts) - 1 and len(starts) < len(self.phases):
      n = self._length(len(starts) - 1)
      if n is None or step < starts[-1] + n:
        break
      starts.append(starts[-1] + n)
    return starts

  def phase_index(self, step: int) -> int:
    """The phase that `step` trains in."""
    return len(self._starts_through(step)) - 1 if self.phases else 0

  def task_step(self, step: int) -> int:
    """The index of `step`'s batch in its task's stream: the earlier steps that trained on the
    same task (= step when the schedule names no tasks)."""
    if not self.phases:
      return step
    starts = self._starts_through(step)
    task = self.phases[len(starts) - 1].get("task")
    ends = starts[1:] + [step]
    return sum(e - s for j, (s, e) in enumerate(zip(starts, ends)) if self.phases[j].get("task") == task)

  def phase(self, step: int) -> dict:
    return self.phases[self.phase_index(step)] if self.phases else {}

  def task(self, step: int) -> Optional[str]:
    return self.phase(step).get("task")

  def spec(self, step: int) -> dict:
    if self.kind == "random":
      # A hash of (seed, step) rather than a stateful RNG: resume-safe by construction.
      c = self.cfg
      digest = hashlib.sha256(f"{c.get('seed', 0)}:{step}".encode()).digest()
      choices = c["choices"]
      return _as_dict(choices[int.from_bytes(digest[:8], "little") % len(choices)])
    return self.phase(step)["spec"]

  def finished(self, step: int) -> bool:
    """True once the last phase has ended and the run should stop before `step`."""
    return self.finished_at is not None and step >= self.finished_at

  def observe(self, step: int, metrics: Dict[str, float]) -> None:
    """Feed the metrics of `step` (in step order); may end the current phase after it."""
    if not self.phases or self.finished_at is not None:
      return
    i = self.phase_index(step)
    while len(self.starts) - 1 < i:  # fixed-length phases passed since the last observation
      self.starts.append(self.starts[-1] + self._length(len(self.starts) - 1))
      self._reset_history()
    p = self.phases[i]
    ended = False
    if p.get("threshold") is not None:
      name = p.get("metric", "accuracy")
      if name not in metrics:
        raise ValueError(f"curriculum.metric: training metric {name!r} not produced; "
                         f"available: {sorted(metrics)}")
      self.history.append(float(metrics[name]))
      full = len(self.history) == self.history.maxlen
      ended = full and sum(self.history) / len(self.history) >= float(p["threshold"])
    n = self._length(i)
    ended = ended or (n is not None and step + 1 >= self.starts[i] + n)
    if not ended:
      return
    if i + 1 < len(self.phases):
      self.starts.append(step + 1)
      self._reset_history()
    elif self.stop_after_last:
      self.finished_at = step + 1

  def summary(self) -> List[dict]:
    """The phases entered so far: name, task, spec and their start and end steps."""
    out = []
    for i, s in enumerate(self.starts):
      p = self.phases[i]
      end = self.starts[i + 1] if i + 1 < len(self.starts) else self.finished_at
      out.append({"name": p.get("name", f"phase {i}"), "task": p.get("task"), "spec": p["spec"],
                  "start": s, "end": end})
    return out

  def state_dict(self) -> dict:
    return {"starts": [int(s) for s in self.starts], "history": list(self.history),
            "finished_at": -1 if self.finished_at is None else int(self.finished_at)}

  def load_state_dict(self, state: dict) -> None:
    if "starts" in state:
      self.starts = [int(s) for s in state["starts"]]
    else:  # checkpoints written before phases: the metric kind's switch step
      s = int(state.get("switched_at", -1))
      self.starts = [0] if s < 0 else [0, s]
    f = int(state.get("finished_at", -1))
    self.finished_at = None if f < 0 else f
    self._reset_history()
    self.history.extend(float(x) for x in state.get("history", []))
