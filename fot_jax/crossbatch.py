"""Crossbatch plans: which rows of a training batch each row's memory layers see.

A batch has B rows in packs of k consecutive rows; pack s holds the k consecutive
windows of batch slot s (row = s * k + j for pack position j). A plan is

  sources:  int32[B, N]  row indices of extra contexts, -1 for none
  positive: bool[B, N]   True where the source is the row's own slot (same stream)

Two notations build plans (docs/semantics.md):

* analysis (d, w): k = w + 1; the last window of each slot sees the w earlier
  windows of its own slot (positives) and the same w windows of d - 1 other slots.
* segments: one (p, n) per pack position j: the p most recent earlier windows of
  the row's slot, and n windows of other slots.

Negatives (both notations) are the earlier windows (positions < j) of the other
slots, enumerated nearest slot first (s+1, s+2, ... mod S) and, within a slot,
latest window first. So analysis (d, w) is the segments plan with (w, (d-1)*w)
at the last position and (0, 0) elsewhere.

Each row's live sources come first, so `pack_widths` (one width per pack
position, known on the host) tells the attention how many plan columns each
pack position needs: rows are grouped by it and pay only for their own extra
contexts (model/attention.py).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Plan:
  sources: np.ndarray  # int32 [B, N]
  positive: np.ndarray  # bool [B, N]
  pack: int = 1  # rows per pack (k): row = slot * k + pack position

  @property
  def num_sources(self) -> int:
    return self.sources.shape[1]

  @property
  def widths(self) -> Tuple[int, ...]:
    return pack_widths(self.sources, self.pack)

  def as_tuple(self, grouped: bool = True):
    """The model's `plan` argument: (sources, positive, widths); grouped=False leaves the
    widths out, so every row attends to all N columns (masked), as a traced plan does."""
    if grouped:
      return (self.sources, self.positive, self.widths)
    return (self.sources, self.positive)


def pack_widths(sources, pack: int) -> Tuple[int, ...]:
  """Per pack position j: how many leading plan columns hold every live source of the rows
  at j (1 + the last live column), over all slots (and any leading axes, e.g. stacked
  plans [accum, (groups,) rows, N]). A static tuple: the attention runs each width's rows
  at that width instead of every row at N."""
  sources = np.asarray(sources)
  rows, n = sources.shape[-2:]
  if pack <= 0 or rows % pack:
    _fail("pack", f"{rows} plan rows are not whole packs of {pack}")
  if n == 0:
    return (0,) * pack
  live = sources >= 0
  last = np.where(live.any(-1), n - np.argmax(live[..., ::-1], -1), 0)
  return tuple(int(x) for x in last.reshape(-1, pack).max(0))


def _fail(field: str, msg: str):
  raise ValueError(f"crossbatch.{field}: {msg}")


def segments_plan(batch_size: int, segments: Sequence[Tuple[int, int]]) -> Plan:
  """Plan from one (positives, negatives) pair per pack position."""
  segments = [tuple(int(x) for x in s) for s in segments]
  k = len(segments)
  if k == 0:
    _fail("segments", "needs at least one (positives, negatives) pair")
  if batch_size <= 0 or batch_size % k:
    _fail("segments", f"batch size {batch_size} is not a multiple of the pack size k={k} "
          f"(one pair per window of a slot)")
  slots = batch_size // k
  for j, (p, n) in enumerate(segments):
    if p < 0 or n < 0:
      _fail("segments", f"position {j}: counts must be >= 0, got ({p}, {n})")
    if p > j:
      _fail("segments", f"position {j}: {p} positives but only {j} earlier windows in the slot")
    if n > j * (slots - 1):
      _fail("segments", f"position {j}: {n} negatives but other slots hold only "
            f"{j * (slots - 1)} earlier windows ({slots - 1} other slots x {j} windows)")
  width = max(p + n for p, n in segments)
  sources = np.full((batch_size, max(width, 0)), -1, np.int32)
  positive = np.zeros((batch_size, max(width, 0)), bool)
  for s in range(slots):
    for j, (p, n) in enumerate(segments):
      row = s * k + j
      own = [s * k + (j - 1 - r) for r in range(p)]
      others = [((s + o) % slots) * k + (j - 1 - r) for o in range(1, slots) for r in range(j)][:n]
      sources[row, :p + n] = own + others
      positive[row, :p] = True
  return Plan(sources, positive, k)


def analysis_segments(d: int, w: int) -> list:
  """The segments equivalent of the analysis notation (d, w)."""
  if w < 0:
    _fail("w", f"must be >= 0, got {w}")
  if d < 1:
    _fail("d", f"must be >= 1, got {d}")
  return [(0, 0)] * w + [(w, (d - 1) * w)]


def analysis_plan(batch_size: int, d: int, w: int) -> Plan:
  segments = analysis_segments(d, w)  # validates d and w first
  k = w + 1
  if batch_size % k:
    _fail("w", f"batch size {batch_size} is not a multiple of the pack size k = w + 1 = {k}")
  slots = batch_size // k
  if d > slots:
    _fail("d", f"d={d} needs {d} slots (1 positive + {d - 1} negative) but the batch has {slots} "
          f"(batch size {batch_size} / k={k})")
  return segments_plan(batch_size, segments)


def empty_plan(batch_size: int) -> Plan:
  return Plan(np.full((batch_size, 0), -1, np.int32), np.zeros((batch_size, 0), bool))


def scored_rows(batch_size: int, pack: int, loss_on: str) -> np.ndarray:
  """bool [B]: which rows contribute to the loss ('all' rows or the 'last' window of each slot)."""
  if loss_on == "all":
    return np.ones(batch_size, bool)
  if loss_on == "last":
    return (np.arange(batch_size) % pack) == pack - 1
  _fail("loss_on", f"must be 'all' or 'last', got {loss_on!r}")


def plan_from_spec(batch_size: int, spec: dict) -> Plan:
  """spec: {'d': int, 'w': int} (analysis) or {'segments': [(p, n), ...]}; {} or None: no crossbatch
  (nor for a recurrent-memory spec, {'memory': ...}: fot_jax/recurrent.py)."""
  if not spec or spec.get("memory") is not None:
    return empty_plan(batch_size)
  if "segments" in spec and spec["segments"] is not None:
    return segments_plan(batch_size, spec["segments"])
  if "d" not in spec or "w" not in spec:
    _fail("spec", f"needs either 'segments' or both 'd' and 'w', got keys {sorted(spec)}")
  return analysis_plan(batch_size, int(spec["d"]), int(spec["w"]))


def pack_size(spec: dict) -> int:
  if not spec:
    return 1
  if spec.get("memory") is not None:  # recurrent memory (fot_jax/recurrent.py): a slot's windows per step
    return int(spec.get("windows", 1))
  if spec.get("segments") is not None:
    return len(spec["segments"])
  return int(spec["w"]) + 1
