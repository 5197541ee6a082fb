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

from fot_jax.host_memory import ivf_lists, recall_hits
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
    self.nlist = int(nlist) or ivf_lists(m)
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
    """recall_hits against a brute force over the whole memory, the excluded range left out."""
    s = q @ self.keys[:, h, :].T
    s[:, lo:hi] = -np.inf
    return recall_hits(s, ids, k)


class StreamedTopK:
  """Exact (`flat`) retrieval over memory that arrives chunk by chunk, for queries known up front:
  faiss's exact inner-product search on each chunk, merged into a running top-n per query and kv
  head. Only one chunk and n entries per query are held, so RAM does not grow with the memory.

  queries: [B, T, KV, G, D] (memory_queries). Each kept entry carries its keys and values for every
  kv head: the device scores the union of a row's entries with all heads, as HostIndex.candidates.
  A NumPy brute force on a sample of `recall_queries` queries checks the faiss path (recall)."""

  def __init__(self, queries, n: int, recall_queries: int = 64, seed: int = 0):
    q = np.asarray(queries, np.float32)
    b, t, kv, g, d = q.shape
    self.b, self.per_row, self.kv, self.n, self.size = b, t * g, kv, int(n), 0
    # [KV, B * T * G, D]: one search per kv head covers every row's queries
    self.q = np.ascontiguousarray(q.transpose(2, 0, 1, 3, 4).reshape(kv, b * t * g, d))
    shape = (kv, b * t * g, self.n)
    self.scores, self.ids = np.full(shape, -np.inf, np.float32), np.full(shape, -1, np.int64)
    self.keys, self.values = np.zeros(shape + (kv, d), np.float32), np.zeros(shape + (kv, d), np.float32)
    rng = np.random.default_rng(seed)
    self.sample = rng.choice(kv * b * t * g, min(int(recall_queries), kv * b * t * g), replace=False)
    self.ref_scores = np.full((len(self.sample), self.n), -np.inf, np.float32)
    self.ref_ids = np.full((len(self.sample), self.n), -1, np.int64)

  def add(self, keys: np.ndarray, values: np.ndarray):
    """The next chunk of memory (entries size .. size + len - 1): keys, values [C, KV, D]."""
    import faiss
    k, v = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    take = min(self.n, len(k))
    for h in range(self.kv):
      s, i = faiss.knn(self.q[h], np.ascontiguousarray(k[:, h]), take, metric=faiss.METRIC_INNER_PRODUCT)
      keep = _top(np.concatenate([self.scores[h], s], 1), self.n)
      for buf, new in ((self.scores, s), (self.ids, i + self.size), (self.keys, k[i]), (self.values, v[i])):
        both = np.concatenate([buf[h], new], 1)
        buf[h] = np.take_along_axis(both, keep.reshape(keep.shape + (1,) * (both.ndim - 2)), 1)
    heads, qs = np.divmod(self.sample, self.q.shape[1])
    s = np.empty((len(qs), len(k)), np.float32)  # the reference: every score, by NumPy
    for h in np.unique(heads):
      s[heads == h] = self.q[h, qs[heads == h]] @ k[:, h].T
    take_ref = _top(s, min(self.n, s.shape[1]))
    s, i = np.take_along_axis(s, take_ref, 1), take_ref + self.size
    keep = _top(np.concatenate([self.ref_scores, s], 1), self.n)
    self.ref_scores = np.take_along_axis(np.concatenate([self.ref_scores, s], 1), keep, 1)
    self.ref_ids = np.take_along_axis(np.concatenate([self.ref_ids, i], 1), keep, 1)
    self.size += len(k)

  def _best(self, scores, ids, row_of, exclude, k):
    """Top-k positions of each query's kept entries, leaving out its row's excluded range, and
    their scores (-inf: no entry)."""
    ex = np.asarray(exclude, np.int64).reshape(-1, 2)[row_of]
    lo, hi = ex[..., :1], ex[..., 1:]
    s = np.where((ids < 0) | ((ids >= lo) & (ids < hi)), -np.inf, scores)
    best = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    return best, np.take_along_axis(s, best, -1)

  def candidates(self, k: int, exclude: Sequence[Tuple[int, int]], rows: Sequence[int]) -> MemoryBlock:
    """A MemoryBlock [len(rows), C, KV, D] of each row's exact top-k entries of the memory so far,
    the union over its queries and heads. exclude[r] = (lo, hi): entries row rows[r] must not see;
    n must be at least k + hi - lo (kept entries can only miss by exclusion)."""
    if any(hi - lo > self.n - k for lo, hi in exclude):
      raise ValueError(f"streamed top-k: keeps {self.n} entries per query, too few for k={k} "
                       f"with {max(hi - lo for lo, hi in exclude)} excluded")
    rows = list(rows)
    found = []
    for r, row in enumerate(rows):
      sl = slice(row * self.per_row, (row + 1) * self.per_row)
      ids = self.ids[:, sl]
      best, s = self._best(self.scores[:, sl], ids, np.full(ids.shape[:2], r), exclude, k)
      ok = np.isfinite(s)
      pick = np.take_along_axis(ids, best, -1)[ok]
      uniq, first = np.unique(pick, return_index=True)
      kv_of = lambda buf: np.take_along_axis(buf[:, sl], best[..., None, None], 2)[ok][first]
      found.append((uniq, kv_of(self.keys), kv_of(self.values)))
    width = _round_up(max(len(u) for u, _, _ in found))
    d = self.q.shape[-1]
    keys = np.zeros((len(rows), width, self.kv, d), np.float32)
    values = np.zeros((len(rows), width, self.kv, d), np.float32)
    mask = np.zeros((len(rows), width), bool)
    for r, (uniq, kk, vv) in enumerate(found):
      keys[r, :len(uniq)], values[r, :len(uniq)], mask[r, :len(uniq)] = kk, vv, True
    return MemoryBlock(jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask))

  def recall(self, k: int, exclude: Sequence[Tuple[int, int]]) -> float:
    """recall@k on the sample against the NumPy brute force; exclude[b] for every row b. An entry
    counts when its score reaches the exact k-th best: memory holds many identical keys (a
    window's first token sees only itself), and which of a tie is kept changes nothing."""
    heads, qs = np.divmod(self.sample, self.q.shape[1])
    row_of = qs // self.per_row
    _, got = self._best(self.scores[heads, qs], self.ids[heads, qs], row_of, exclude, k)
    _, want = self._best(self.ref_scores, self.ref_ids, row_of, exclude, k)
    total = hit = 0
    for g, w in zip(got, want):
      w = w[np.isfinite(w)]
      if len(w):
        hit += min(len(w), int((g >= w[-1] - 1e-5 * (1 + abs(w[-1]))).sum()))
        total += len(w)
    return hit / total if total else 1.0


def _top(scores, n):
  """Positions of the n largest of each row (unordered)."""
  return np.argpartition(-scores, n - 1, axis=1)[:, :n]
