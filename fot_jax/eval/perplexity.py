"""Perplexity against memory size, with FoT memory inference.

For each evaluation document the same span is scored at every memory size: its
last `score_tokens` targets. With memory size M, the M tokens just before the span
are first processed window by window into memory (MemoryInference), then the span
is processed with logits; M = 0 is the local window alone. So the figures for
different M differ only in how much earlier text the memory layers can reach.

doc_mode: `single_doc` (memory holds only the document's own tokens, cleared
between documents). `multi_doc` (memory is never cleared, so earlier documents stay
in it as distractors): before a document's own M tokens, the `distractor_tokens`
tokens of the stream of documents that precede it (the other evaluation documents,
whole, `bos doc eos`, nearest last) go into memory, so memory holds
distractor_tokens + M tokens and the scored span is the same as in single_doc.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from fot_jax.inference import MemoryInference, forward_window, token_nll


def needed_length(memory_tokens: Sequence[int], score_tokens: int) -> int:
  """Stream tokens a document needs to be scored at every memory size (inputs + 1 target)."""
  return max(memory_tokens) + score_tokens + 1


def span_nll(inference: MemoryInference, streams: np.ndarray, memory: int, score_tokens: int,
             distractors: Optional[np.ndarray] = None) -> np.ndarray:
  """streams [B, L] -> token NLLs [B, score_tokens] of the last score_tokens targets, with `memory`
  tokens of the same streams before the span in memory (after `distractors` [B, P], if given),
  processed window by window from scratch."""
  b, length = streams.shape
  if length < memory + score_tokens + 1:
    raise ValueError(f"perplexity: documents of {length} tokens are too short for {memory} memory tokens "
                     f"plus {score_tokens} scored")
  span_start = length - 1 - score_tokens  # first input token of the scored span
  mem = inference.new_memory(b)
  if distractors is not None and distractors.shape[1]:
    inference.process(distractors, mem, want_logits=False)
  if memory:
    inference.process(streams[:, span_start - memory:span_start], mem, want_logits=False)
  logits = inference.process(streams[:, span_start:length - 1], mem)
  return token_nll(logits, streams[:, span_start + 1:])


def one_call_nll(inference, streams: np.ndarray, score_tokens: int) -> np.ndarray:
  """streams [B, L] -> token NLLs [B, score_tokens] of the last score_tokens targets, all L - 1 inputs
  in one `process` call from the first token (a long-context forward, or memory inference whose
  windows start at the stream's first token rather than, as in span_nll, at the scored span)."""
  logits = inference.process(streams[:, :-1], inference.new_memory(len(streams)))
  return token_nll(logits[:, -score_tokens:], streams[:, -score_tokens:])


def shared_context_nll(inference: MemoryInference, streams: np.ndarray, memories: Sequence[int],
                       score_tokens: int) -> Dict[int, np.ndarray]:
  """span_nll for several memory sizes from one pass over the longest context.

  Exact for a model with a single memory layer and memory sizes that are multiples of the
  window: that layer's keys/values come from the layers below it, which never see memory,
  so a window's memory entries are the same whatever the memory size; and with window
  boundaries counted back from the span, the last M tokens are whole windows.
  """
  cfg, t = inference.cfg, inference.window
  b, length = streams.shape
  span_start = length - 1 - score_tokens
  top = max(memories)
  windows = []  # memory-layer (k, v) of each context window, oldest first
  for start in range(span_start - top, span_start, t):
    tok = streams[:, start:start + t]
    _, kv = forward_window(inference.params, jnp.asarray(tok), jnp.ones(tok.shape, bool), None, cfg,
                           inference.mode, inference.topk, inference.chunk, stop_after=cfg.mem_layers[0])
    windows.append(kv)
  out = {}
  for m in memories:
    mem = inference.new_memory(b)
    if m:
      recent = windows[len(windows) - m // t:]
      kv = {layer: tuple(jnp.concatenate([w[layer][i] for w in recent], axis=1) for i in (0, 1))
            for layer in cfg.mem_layers}
      mem.add(kv, jnp.ones((b, m), bool))
    out[m] = token_nll(inference.process(streams[:, span_start:length - 1], mem), streams[:, span_start + 1:])
  return out


def preceding_documents(docs: List[np.ndarray], i: int, tokens: int) -> np.ndarray:
  """The last `tokens` tokens of the stream docs[i+1], docs[i+2], ... (cyclic, never docs[i]),
  nearest last: what a multi_doc memory holds from the documents read before docs[i]."""
  if not tokens:
    return np.zeros(0, np.int32)
  if len(docs) < 2:
    raise ValueError("perplexity: multi_doc needs at least 2 evaluation documents")
  parts, have, j = [], 0, i
  while have < tokens:
    j = (j + 1) % len(docs)
    if j == i:
      j = (j + 1) % len(docs)
    parts.append(np.asarray(docs[j], np.int32))
    have += len(parts[-1])
  stream = np.concatenate(parts[::-1])  # docs[i+1], read just before docs[i], comes last
  return stream[len(stream) - tokens:]


def perplexity_vs_memory(inference: MemoryInference, docs: List[np.ndarray], memory_tokens: Sequence[int],
                         score_tokens: int, batch: int = 8, doc_mode: str = "single_doc",
                         name: str = "eval", distractor_tokens: int = 0) -> Dict[str, list]:
  """docs: token streams, each at least needed_length() long (only their tails are used).

  Returns {'memory_tokens', 'perplexity', 'nll' (mean per token, nats), 'tokens' (scored count)};
  multi_doc adds 'distractor_tokens' (held in memory before each document's own tokens).
  """
  if doc_mode not in ("single_doc", "multi_doc"):
    raise ValueError(f"perplexity.doc_mode: must be 'single_doc' or 'multi_doc', got {doc_mode!r}")
  if not docs:
    raise ValueError("perplexity: no evaluation documents long enough")
  need = needed_length(memory_tokens, score_tokens)
  tails = np.stack([np.asarray(d[-need:], np.int32) for d in docs])
  if tails.shape[1] < need:
    raise ValueError(f"perplexity: documents need at least {need} tokens")
  prev = None
  if doc_mode == "multi_doc":
    prev = np.stack([preceding_documents(docs, i, int(distractor_tokens)) for i in range(len(docs))])
  # The one-pass shortcut holds for single_doc only (distractors would sit before every memory size).
  shared = (prev is None and isinstance(inference, MemoryInference) and len(inference.cfg.mem_layers) == 1
            and all(m % inference.window == 0 for m in memory_tokens))
  t0 = time.time()
  per_memory = {m: [] for m in memory_tokens}
  for i in range(0, len(tails), batch):
    if shared:
      for m, nll in shared_context_nll(inference, tails[i:i + batch], memory_tokens, score_tokens).items():
        per_memory[m].append(nll)
    else:
      for m in memory_tokens:
        per_memory[m].append(span_nll(inference, tails[i:i + batch, need - (m + score_tokens + 1):], m,
                                      score_tokens, None if prev is None else prev[i:i + batch]))
  out = {"memory_tokens": [int(m) for m in memory_tokens], "perplexity": [], "nll": [], "tokens": []}
  if prev is not None:
    out["distractor_tokens"] = int(distractor_tokens)
  for m in memory_tokens:
    nll = np.concatenate(per_memory[m])
    mean = float(nll.mean())
    out["nll"].append(mean)
    out["perplexity"].append(math.exp(mean))
    out["tokens"].append(int(nll.size))
    print(f"[{name}] {doc_mode} memory {m:>7,} tokens: perplexity {math.exp(mean):.3f} ({nll.size} tokens)", flush=True)
  print(f"[{name}] evaluated in {time.time() - t0:.0f}s ({'one shared context pass' if shared else 'a pass per memory size'})",
        flush=True)
  return out
