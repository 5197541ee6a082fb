"""Effective context length: the longest tested length such that it and every shorter
tested length meet the threshold. A dip at a shorter length ends it there, even if
longer lengths recover (a model that fails at 4K but passes at 8K has not shown 8K)."""
from __future__ import annotations

from typing import Optional, Sequence


def effective_length(lengths: Sequence[int], scores: Sequence[float], threshold: float,
                     higher_is_better: bool = True) -> Optional[int]:
  """-> the effective length, or None when even the shortest tested length fails."""
  if len(lengths) != len(scores):
    raise ValueError(f"effective_length: {len(lengths)} lengths but {len(scores)} scores")
  best = None
  for length, score in sorted(zip(lengths, scores)):
    ok = score >= threshold if higher_is_better else score <= threshold
    if not ok:
      break
    best = int(length)
  return best
