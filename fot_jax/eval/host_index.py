"""Host-side memory for the memory layer: a faiss index per kv head (inner product).

`flat` is exact; `ivf` (inverted lists, `nprobe` of `nlist` lists searched) is the
approximate top-k whose accuracy cost the dictionary suite measures. Memory that does
not fit the device stays here; only each row's retrieved entries go to the device.
"""
from __future__ import annotations

import functools
import math
from typing import List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MemoryBlock

KINDS = ("flat", "ivf")


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def memory_queries(params, tokens, cfg: ModelConfig, layer: int):
  """The memory layer's attention queries (position treatment and scale applied, so q . k
  is the attention score): [B, T, KV, G, D]."""
  _, state = LlamaModel(cfg).apply({"params": params}, tokens, stop_after=layer, mutable=["intermediates"])
  return state["intermediates"][f"layers_{layer}"]["self_attn"]["mem_queries"][0]


def _round_up(n: int) -> int:
  return 1 << max(6, math.ceil(math.log2(max(n, 1))))  # few distinct shapes -> few compilations


class HostIndex:
  """keys/values [M, KV, D] (float32 NumPy) in one faiss index per kv head."""

  def __init__(self, keys: np.ndarray, values: np.ndarray, kind: str = "ivf", nprobe: int = 8,
               nlist: int = 0, recall_queries: int = 16, seed: int = 0):
    import faiss
    if kind not in KINDS:
      raise ValueError(f"host index: kind must be one of {KINDS}, got {kind!r}")
    self.keys, self.values = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    m, kv, d = self.keys.shape
    self.kind, self.nprobe, self.recall_queries = kind, int(nprobe), int(recall_queries)
    # 4 sqrt(M) lists, at most 1024 (k-means cost), and >= 39 keys per list (faiss's minimum)
    self.nlist = int(nlist) or max(1, min(1024, int(4 * math.sqrt(m)), m // 39))
    self.rng = np.random.default_rng(seed)
    self.indexes = []
    for h in range(kv):
      x = np.ascontiguousarray(self.keys[:, h, :])
      if kind == "flat":
        index = faiss.IndexFlatIP(d)
      else:
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, self.nlist, faiss.METRIC_INNER_PRODUCT)
        sample = x if m <= 64 * self.nlist else x[self.rng.choice(m, 64 * self.nlist, replace=False)]
        index.train(sample)
      index.add(x)
      self.indexes.append(index)

  def _params(self, lo: int, hi: int):
    import faiss
    inner = faiss.IDSelectorRange(int(lo), int(hi)) if hi > lo else None
    sel = faiss.IDSelectorNot(inner) if inner is not None else None
    if self.kind == "ivf":
      params = faiss.SearchParametersIVF(sel=sel, nprobe=self.nprobe) if sel else faiss.SearchParametersIVF(nprobe=self.nprobe)
    else:
      params = faiss.SearchParameters(sel=sel) if sel else None
    return params, (inner, sel)

  def candidates(self, queries, k: int, exclude: Sequence[Tuple[int, int]]) -> Tuple[MemoryBlock, float]:
    """queries [B, T, KV, G, D] -> (a MemoryBlock [B, C, KV, D] of each row's retrieved entries,
    the union over its queries and heads; recall@k of the retrieval on a sample of queries,
    None when nothing was left to retrieve).
    exclude[r] = (lo, hi): entries row r must not see (its own window's shared copy)."""
    q = np.asarray(queries, np.float32)
    b, t, kv, g, d = q.shape
    rows: List[np.ndarray] = []
    hit = total = 0
    for r in range(b):
      lo, hi = exclude[r]
      params, _sel = self._params(lo, hi)  # _sel is kept alive for the search
      found = []
      for h in range(kv):
        qh = np.ascontiguousarray(q[r, :, h].reshape(t * g, d))
        _, ids = self.indexes[h].search(qh, k, params=params)
        found.append(ids.reshape(-1))
        sample = self.rng.choice(t * g, min(self.recall_queries, t * g), replace=False)
        hit_r, total_r = self._recall(qh[sample], ids[sample], h, k, lo, hi)
        hit, total = hit + hit_r, total + total_r
      ids = np.unique(np.concatenate(found))
      rows.append(ids[ids >= 0])
    width = _round_up(max(len(x) for x in rows))
    keys = np.zeros((b, width, kv, d), np.float32)
    values = np.zeros((b, width, kv, d), np.float32)
    mask = np.zeros((b, width), bool)
    for r, ids in enumerate(rows):
      keys[r, :len(ids)], values[r, :len(ids)], mask[r, :len(ids)] = self.keys[ids], self.values[ids], True
    block = MemoryBlock(jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask))
    return block, (hit / total if total else None)

  def _recall(self, q, ids, h, k, lo, hi):
    """Retrieved entries among the exact top-k (brute force over the whole memory)."""
    s = q @ self.keys[:, h, :].T
    s[:, lo:hi] = -np.inf
    kk = min(k, s.shape[1] - (hi - lo))
    if kk <= 0:
      return 0, 0
    exact = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
    hit = sum(len(set(e.tolist()) & set(f.tolist())) for e, f in zip(exact, ids))
    return hit, kk * len(q)
