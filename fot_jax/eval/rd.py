"""Positive attention mass r_d against the number of documents in memory (FoT paper, Figure 3).

For each held-out document, its last window is the query window and the `context_windows`
windows before it are its positives. With d documents in memory, the memory layers'
memory holds those positives and the same windows of d - 1 other documents (the next
ones in the evaluation order, cyclically): exactly the analysis plan `(d, w)` of
training, but through the inference memory (dense). r_d is the attention mass on the
positives divided by the mass on all of memory (the local window is left out), averaged
over heads and queries of the memory layers. A model that cannot tell its own document
from the others sits at 1/d; FoT should sit well above it.

Context windows are encoded each on its own (their memory keys see no memory), as the
earlier windows of a training pack are.
"""
from __future__ import annotations

import functools
import time
from typing import Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.inference import forward_window
from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MemoryBlock

DEFAULT_DS = (1, 2, 4, 8, 16, 32, 64)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
def _rd_sums(params, tokens, memories, cfg, chunk):
  """Query windows with positive-marked memory -> (sum of r_d over queries, query count)."""
  _, aux = LlamaModel(cfg).apply({"params": params}, tokens, memories=memories, mem_mode="dense",
                                 mem_chunk=chunk, stop_after=max(cfg.mem_layers))
  return aux["rd_num"], aux["rd_den"]


def encode_context(cfg: ModelConfig, params, windows: np.ndarray, chunk: int, batch: int = 32):
  """windows [N, T] -> {layer: (keys [N, T, KV, D], values)}: each window's memory keys/values alone."""
  out: Dict[int, List] = {layer: ([], []) for layer in cfg.mem_layers}
  for s in range(0, len(windows), batch):
    tok = jnp.asarray(windows[s:s + batch])
    _, kv = forward_window(params, tok, jnp.ones(tok.shape, bool), None, cfg, "dense", 1, chunk,
                           stop_after=max(cfg.mem_layers))
    for layer in cfg.mem_layers:
      out[layer][0].append(np.asarray(kv[layer][0]))
      out[layer][1].append(np.asarray(kv[layer][1]))
  return {layer: (np.concatenate(k), np.concatenate(v)) for layer, (k, v) in out.items()}


def positive_attention_mass(cfg: ModelConfig, params, docs: Sequence[np.ndarray], window: int,
                            ds: Sequence[int] = DEFAULT_DS, context_windows: int = 1, batch: int = 8,
                            chunk: int = 4096, name: str = "") -> dict:
  """docs: token arrays of at least (context_windows + 1) * window tokens (their tails are used).

  Returns {'d': [...], 'r_d': [...], 'inverse_d': [...], 'queries': [...] (count per d), 'n_docs'}.
  """
  if not cfg.mem_layers:
    raise ValueError("rd: the model has no memory layers (model.mem_layers is empty)")
  w, t, n = int(context_windows), int(window), len(docs)
  need = (w + 1) * t
  short = [len(d) for d in docs if len(d) < need]
  if short:
    raise ValueError(f"rd: {len(short)} documents are shorter than (context_windows + 1) * window = {need} tokens")
  if max(ds) > n:
    raise ValueError(f"rd: d up to {max(ds)} needs at least that many documents, got {n}")
  tails = np.stack([np.asarray(d[-need:], np.int32) for d in docs])
  queries = tails[:, w * t:]
  ctx = encode_context(cfg, params, tails[:, :w * t].reshape(n * w, t), chunk)
  ctx = {layer: (k.reshape(n, w * t, *k.shape[2:]), v.reshape(n, w * t, *v.shape[2:]))
         for layer, (k, v) in ctx.items()}
  out = {"d": [], "r_d": [], "inverse_d": [], "queries": [], "n_docs": n, "context_windows": w, "window": t}
  for d in ds:
    t0 = time.time()
    num = den = 0.0
    positive = np.zeros((1, d * w * t), bool)
    positive[:, :w * t] = True  # the query's own document comes first
    for s in range(0, n, batch):
      rows = np.arange(s, min(n, s + batch))
      members = (rows[:, None] + np.arange(d)[None]) % n  # [b, d]: own document, then d - 1 others
      memories = {}
      for layer, (k, v) in ctx.items():
        mk = jnp.asarray(k[members].reshape(len(rows), d * w * t, *k.shape[2:]))
        mv = jnp.asarray(v[members].reshape(len(rows), d * w * t, *v.shape[2:]))
        memories[layer] = [MemoryBlock(mk, mv, jnp.ones(mk.shape[:2], bool),
                                       jnp.asarray(np.broadcast_to(positive, mk.shape[:2])))]
      rn, rdn = _rd_sums(params, jnp.asarray(queries[rows]), memories, cfg, chunk)
      num, den = num + float(rn), den + float(rdn)
    out["d"].append(int(d))
    out["r_d"].append(num / den)
    out["inverse_d"].append(1.0 / d)
    out["queries"].append(int(den))
    print(f"[{name}] rd: d={d:>3}: r_d {num / den:.4f} (1/d = {1 / d:.4f}; {n} documents, "
          f"{time.time() - t0:.1f}s)", flush=True)
  return out
