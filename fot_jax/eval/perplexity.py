"""Perplexity against memory size, with FoT memory inference.

For each evaluation document the same span is scored at every memory size: its
last `score_tokens` targets. With memory size M, the M tokens just before the span
are first processed window by window into memory (MemoryInference), then the span
is processed with logits; M = 0 is the local window alone. So the figures for
different M differ only in how much earlier text the memory layers can reach.

doc_mode: `single_doc` (memory holds only the document's own tokens, cleared
between documents). `multi_doc` (memory shared across documents) is for the
evaluation suite to add.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Sequence

import numpy as np

from fot_jax.inference import MemoryInference


def needed_length(memory_tokens: Sequence[int], score_tokens: int) -> int:
  """Stream tokens a document needs to be scored at every memory size (inputs + 1 target)."""
  return max(memory_tokens) + score_tokens + 1


def span_nll(inference: MemoryInference, streams: np.ndarray, memory: int, score_tokens: int) -> np.ndarray:
  """streams [B, L] -> token NLLs [B, score_tokens] of the last score_tokens targets, with `memory`
  tokens of the same streams before the span in memory."""
  b, length = streams.shape
  if length < memory + score_tokens + 1:
    raise ValueError(f"perplexity: documents of {length} tokens are too short for {memory} memory tokens "
                     f"plus {score_tokens} scored")
  span_start = length - 1 - score_tokens  # first input token of the scored span
  mem = inference.new_memory(b)
  if memory:
    inference.process(streams[:, span_start - memory:span_start], mem, want_logits=False)
  logits = inference.process(streams[:, span_start:length - 1], mem)
  targets = streams[:, span_start + 1:]
  logits = logits.astype(np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def perplexity_vs_memory(inference: MemoryInference, docs: List[np.ndarray], memory_tokens: Sequence[int],
                         score_tokens: int, batch: int = 8, doc_mode: str = "single_doc",
                         name: str = "eval") -> Dict[str, list]:
  """docs: token streams, each at least needed_length() long (only their tails are used).

  Returns {'memory_tokens', 'perplexity', 'nll' (mean per token, nats), 'tokens' (scored count)}.
  """
  if doc_mode != "single_doc":
    raise ValueError(f"perplexity.doc_mode: only 'single_doc' is implemented here, got {doc_mode!r}")
  if not docs:
    raise ValueError("perplexity: no evaluation documents long enough")
  need = needed_length(memory_tokens, score_tokens)
  tails = np.stack([np.asarray(d[-need:], np.int32) for d in docs])
  if tails.shape[1] < need:
    raise ValueError(f"perplexity: documents need at least {need} tokens")
  out = {"memory_tokens": [int(m) for m in memory_tokens], "perplexity": [], "nll": [], "tokens": []}
  for m in memory_tokens:
    t0 = time.time()
    nll = np.concatenate([span_nll(inference, tails[i:i + batch, need - (m + score_tokens + 1):], m, score_tokens)
                          for i in range(0, len(tails), batch)])
    mean = float(nll.mean())
    out["nll"].append(mean)
    out["perplexity"].append(math.exp(mean))
    out["tokens"].append(int(nll.size))
    print(f"[{name}] memory {m:>7,} tokens: perplexity {math.exp(mean):.3f} ({nll.size} tokens, "
          f"{time.time() - t0:.0f}s)", flush=True)
  return out
