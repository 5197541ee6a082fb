"""Training beside a long memory written without gradient (train.memory).

Crossbatch gives a memory layer a few thousand tokens of other windows to tell apart; at inference
the same layer reads a memory of 64K-128K tokens, whose top-k holds entries no training step ever
showed it (the window starts of a hundred windows of filler, look-alike sentences far from any
fact). With train.memory every row of a step also reads a long haystack (the data's
`memory_tokens(step)`: filler or real prose, no fact, so nothing in it contradicts a document) as
inference would: written window by window into memory by the model being trained, each window's
memory layers reading the memory before it (top-k), without gradient (LongLLaMA's memory is written
the same way at inference); the step's memory layers read its top-k per query under one softmax
with their local window and crossbatch contexts, and the gradient reaches their queries (the
memory's keys and values are constants, like the Memorizing Transformer's).

Writing costs a forward pass over the haystack up to the last memory layer, so it is redone every
`refresh` steps, from the haystack of the step where that period began (memory a few steps stale,
like the Memorizing Transformer's). A resumed run writes its first memory from that same step's
haystack with the restored parameters (an uninterrupted run used those of the period's first step).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import jax
import numpy as np

from fot_jax.inference import MemoryInference
from fot_jax.model.config import ModelConfig
from fot_jax.model.memory import MemoryBlock
from fot_jax.settings import MemorySettings

# train.memory's keys scored this many at a time, in the training step's reads and in the write (a
# [rows, heads, T, chunk] block of scores each). In the write it also lets the exact top-k skip the
# buffer's chunks that hold no entry yet: inference's default chunk (65,536) made a 64K write score
# every window against the whole buffer in one [heads, 512, 65,536] block (benchmarks/memory_write).
MEMORY_CHUNK = 4096


def write_memory(cfg: ModelConfig, params, tokens: np.ndarray, settings: MemorySettings,
                 capacity: Optional[int] = None, chunk: int = MEMORY_CHUNK) -> Dict[int, List[MemoryBlock]]:
  """tokens [M] -> {memory layer: [MemoryBlock]} (one row, [1, M, KV, D]): the haystack run window by
  window through the layers up to the last memory layer, each window reading the memory before it.
  capacity: the entries allocated at once (default the haystack's length: one buffer, one compile);
  less grows by doubling, as inference's memory does; chunk: the keys scored at a time (MEMORY_CHUNK;
  benchmarks/memory_write compares capacities and chunks)."""
  reader = MemoryInference(cfg, params, settings.window, mode="topk", topk=settings.topk, chunk=chunk)
  memory = reader.new_memory(1, capacity=len(tokens) if capacity is None else capacity)
  reader.process(np.asarray(tokens, np.int32)[None], memory, want_logits=False, stop_after=max(cfg.mem_layers))
  return memory.blocks()


class FarMemory:
  """The memory a training step reads: written every settings.refresh steps (write_memory), then
  kept; `placed` puts it where the step reads it (replicated over the mesh)."""

  def __init__(self, cfg: ModelConfig, settings: MemorySettings, placed: Callable = lambda x: x):
    if jax.process_count() > 1:
      raise ValueError("train.memory: one process only (each host would write the memory itself)")
    self.cfg, self.settings, self.placed = cfg, settings, placed
    self.period: Optional[tuple] = None  # (the data source, the period's first step) of the memory held
    self.blocks = None
    self.writes, self.seconds = 0, 0.0

  def for_step(self, step: int, params, feed, name: str = "train"):
    """The memory of `step`: written now (from feed.memory_tokens of the period's first step) when
    a new period begins, the step's data source changes (a new phase) or none was written yet; None
    when the step's data makes no memory haystack (that step reads none)."""
    period = step - step % self.settings.refresh
    if self.period != (id(feed), period):
      tokens = feed.memory_tokens(period) if hasattr(feed, "memory_tokens") else None
      self.period, self.blocks = (id(feed), period), None
      if tokens is None:
        return None
      t0 = time.time()
      self.blocks = self.placed(write_memory(self.cfg, params, tokens, self.settings))
      jax.block_until_ready(self.blocks)
      seconds = time.time() - t0
      self.seconds += seconds
      self.writes += 1
      if jax.process_index() == 0:
        print(f"[{name}] step {step + 1}: memory of {len(tokens):,} tokens written in {seconds:.1f}s (windows "
              f"of {self.settings.window}, top-{self.settings.topk} reads)", flush=True)
    return self.blocks
