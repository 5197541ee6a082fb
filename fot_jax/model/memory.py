"""Attention over a causal local window plus extra key/value contexts.

The memory layers combine several *blocks* of keys under one softmax: the causal
local window, crossbatch contexts (training), and memory (inference, dense,
exact top-k or retrieved blocks). Each block is reduced to a flash-attention style partial
(running max, sum of exponentials, weighted values), so blocks can be merged in
any order and memory can be streamed in chunks far larger than one block.

Shapes use grouped-query layout: queries [B, T, KV, G, D], keys/values
[B, S, KV, D]; scores [B, KV, G, T, S].
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from fot_jax.model.config import BlockSpec  # kept with the configs: read without importing jax

NEG = -1e30  # finite "minus infinity" keeps fully masked blocks NaN-free
MEMORY_MODES = ("dense", "topk", "approx_topk", "blocks")
# Memory keys scored at a time when reading at inference (the top-k search's chunk): a 64K buffer is
# one chunk. Training's memory write scores fewer (fot_jax/train/far_memory.py MEMORY_CHUNK), so its
# chunks with no live entry yet are skipped.
READ_CHUNK = 65536


class Partial(NamedTuple):
  m: jax.Array  # [B, KV, G, T] running max
  l: jax.Array  # [B, KV, G, T] sum of exp(score - m)
  acc: jax.Array  # [B, KV, G, T, D] sum of exp(score - m) * value
  pos: Optional[jax.Array] = None  # [B, KV, G, T] mass on positive extra keys (r_d)


class MemoryBlock(NamedTuple):
  """Keys/values in memory for one memory layer.

  keys/values: [Bm, M, KV, D] with Bm = batch or 1 (shared by all rows);
  mask: [Bm or B, M] bool, True where an entry is live;
  positive: optional [Bm or B, M] bool, entries of the query's own document (only to
  measure r_d in dense mode; retrieval ignores it).
  """
  keys: jax.Array
  values: jax.Array
  mask: jax.Array
  positive: Optional[jax.Array] = None


def scores(q, k):
  """q [B, T, KV, G, D], k [Bk, S, KV, D] -> [B, KV, G, T, S] in float32."""
  return jnp.einsum("btkgd,bskd->bkgts", q.astype(jnp.float32), k.astype(jnp.float32))


def block_partial(s, mask, v, positive=None) -> Partial:
  """s: [B, KV, G, T, S]; mask broadcastable to s; v: [Bv, S, KV, D] or per-query
  values [B, KV, G, T, S, D]; positive: optional bool broadcastable to s."""
  s = jnp.where(mask, s, NEG)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - m[..., None]) * mask
  l = jnp.sum(p, axis=-1)
  if v.ndim == 4:
    acc = jnp.einsum("bkgts,bskd->bkgtd", p, v.astype(jnp.float32))
  else:
    acc = jnp.einsum("bkgts,bkgtsd->bkgtd", p, v.astype(jnp.float32))
  pos = None if positive is None else jnp.sum(p * positive, axis=-1)
  return Partial(m, l, acc, pos)


def merge(a: Partial, b: Partial) -> Partial:
  m = jnp.maximum(a.m, b.m)
  ca, cb = jnp.exp(a.m - m), jnp.exp(b.m - m)
  pos = None
  if a.pos is not None or b.pos is not None:
    pa = 0.0 if a.pos is None else a.pos * ca
    pb = 0.0 if b.pos is None else b.pos * cb
    pos = pa + pb
  return Partial(m, a.l * ca + b.l * cb, a.acc * ca[..., None] + b.acc * cb[..., None], pos)


def finish(p: Partial):
  """-> [B, T, KV, G, D] attention output."""
  out = p.acc / jnp.maximum(p.l, 1e-30)[..., None]
  return jnp.transpose(out, (0, 3, 1, 2, 4))


def _chunks(block: MemoryBlock, chunk: int):
  """Pads a block to a multiple of `chunk` and stacks chunks on a leading axis."""
  m = block.keys.shape[1]
  n = -(-m // chunk)
  pad = n * chunk - m

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((x.shape[0], n, chunk) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  pos = None if block.positive is None else split(block.positive)
  return split(block.keys), split(block.values), split(block.mask), pos


TOPK_GROUP = 8  # grouped_top_k's group: 8 was the fastest of 8 / 16 / 32 for 4,096 entries, k = 32 (XLA:CPU)


def grouped_top_k(s, k: int, group: int = TOPK_GROUP):
  """jax.lax.top_k(s, k) over the last axis, in two small searches: the k groups of `group`
  consecutive entries with the highest maxima, then the top k of their k * group entries. Exact:
  an entry among the top k has fewer than k entries above it, so fewer than k groups have a higher
  maximum than its group. On XLA:CPU top_k over 4,096 entries costs ~0.8x the scores' matmul; this
  ~0.1x. Where the groups do not divide the axis or k groups are all of it, plain top_k."""
  n = s.shape[-1]
  if n % group or k * group >= n:
    return jax.lax.top_k(s, k)
  sg = s.reshape(s.shape[:-1] + (n // group, group))
  _, gi = jax.lax.top_k(jnp.max(sg, axis=-1), k)  # [..., k] groups
  cand = jnp.take_along_axis(sg, gi[..., None], axis=-2).reshape(s.shape[:-1] + (k * group,))
  cs, ci = jax.lax.top_k(cand, k)
  return cs, jnp.take_along_axis(gi, ci // group, axis=-1) * group + ci % group


def topk_memory_partial(q, blocks: Sequence[MemoryBlock], k: int, chunk: int,
                        recall: Optional[float] = None) -> Optional[Partial]:
  """Top-k per query and kv-head group over all blocks (inner product): exact, or with
  `recall` the approximate top-k of each chunk (jax.lax.approx_max_k: the TPU's native
  kNN, aiming at that recall; other backends compute it exactly).

  The search runs without gradient and keeps each query's best keys; their scores are computed
  again from those keys, so a backward pass (train.memory) reaches the queries through the k
  entries read, not through a scatter into every chunk's [T, C] scores and a matmul over all of
  memory."""
  b, t, kv, g, d = q.shape
  best_s = jnp.full((b, kv, g, t, k), NEG, jnp.float32)
  best_k = jnp.zeros((b, kv, g, t, k, d), jnp.float32)
  best_v = jnp.zeros((b, kv, g, t, k, d), jnp.float32)
  q_search = jax.lax.stop_gradient(q)

  def pick(x, ci, kk):  # memory rows x [Bx, C, KV, D] at indices ci [B, KV, G, T, kk] -> [B, KV, G, T, kk, D]
    x = jnp.moveaxis(jnp.broadcast_to(x, (b,) + x.shape[1:]).astype(jnp.float32), 2, 1)  # [B, KV, C, D]
    return jnp.take_along_axis(x, ci.reshape(b, kv, g * t * kk, 1), axis=2).reshape(b, kv, g, t, kk, d)

  for block in blocks:
    ks, vs, ms, _ = _chunks(block, min(chunk, block.keys.shape[1]))

    def search(carry, xs):
      bs, bk, bv = carry
      kc, vc, mc = xs
      s = jnp.where(mc[:, None, None, None, :], scores(q_search, kc), NEG)
      kk = min(k, s.shape[-1])
      if recall is None:
        cs, ci = grouped_top_k(s, kk)  # [B, KV, G, T, kk]
      else:
        cs, ci = jax.lax.approx_max_k(s, kk, recall_target=recall)
      all_s = jnp.concatenate([bs, cs], axis=-1)
      ns, ni = jax.lax.top_k(all_s, k)
      keep = lambda best, new: jnp.take_along_axis(jnp.concatenate([best, new], axis=-2), ni[..., None], axis=-2)
      return ns, keep(bk, pick(kc, ci, kk)), keep(bv, pick(vc, ci, kk))

    def body(carry, xs):  # a chunk with no live entry is skipped: inference's memory buffers are
      # allocated ahead of what is written (a train.memory write: the whole haystack), so the early
      # windows' searches would otherwise scan chunks that are all empty
      return jax.lax.cond(jnp.any(xs[2]), search, lambda c, _: c, carry, xs), None

    (best_s, best_k, best_v), _ = jax.lax.scan(body, (best_s, best_k, best_v), (ks, vs, ms))
  live = best_s > NEG / 2
  s = jnp.einsum("btkgd,bkgtsd->bkgts", q.astype(jnp.float32), best_k)  # the k best, with gradient
  return block_partial(s, live, best_v)


def gathered_memory_partial(q, block: MemoryBlock) -> Partial:
  """Memory retrieved per query outside the model (fot_jax/host_memory.py: a host index's top-k
  of every query head): block.keys / values [B, KV, G, T, k, D], block.mask [B, KV, G, T, k]. The
  same partial as topk_memory_partial when the entries are each query's exact top-k."""
  s = jnp.einsum("btkgd,bkgtsd->bkgts", q.astype(jnp.float32), block.keys.astype(jnp.float32))
  return block_partial(s, block.mask, block.values)


def block_spec(topk) -> BlockSpec:
  """mem_topk in 'blocks' mode: a BlockSpec, or an int taken as block_topk (the rest default)."""
  return (topk if isinstance(topk, BlockSpec) else BlockSpec(block_topk=topk)).checked()


def block_memory_partial(q, blocks: Sequence[MemoryBlock], spec: BlockSpec, query_mask) -> Partial:
  """InfLLM-style block memory. Memory slots in blocks of spec.block_size (the last one padded
  with dead slots); a block's representatives are its block_reps live keys farthest from the
  block's mean key. Per row and kv head, the window's live queries (their mean, over the kv
  head's query heads too) score each live block by its best representative; every query then
  attends to all live tokens of the block_topk best blocks (exact softmax, `pos` when memory marks
  positives). q [B, T, KV, G, D] (scaled); query_mask [B, T]."""
  b, kv = q.shape[0], q.shape[2]
  size, reps, topk = spec

  def split(x):  # [Bm or B, M, ...] -> [B, N, size, ...]
    x = jnp.broadcast_to(x, (b,) + x.shape[1:])
    pad = -x.shape[1] % size
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((b, x.shape[1] // size, size) + x.shape[2:])

  keys = jnp.concatenate([split(x.keys.astype(jnp.float32)) for x in blocks], axis=1)  # [B, N, size, KV, D]
  values = jnp.concatenate([split(x.values) for x in blocks], axis=1)
  mask = jnp.concatenate([split(x.mask) for x in blocks], axis=1)  # [B, N, size]
  positive = None
  if any(x.positive is not None for x in blocks):
    positive = jnp.concatenate([split(x.mask & False if x.positive is None else x.positive) for x in blocks], 1)
  n = keys.shape[1]

  # Representatives: the keys that stand out from the block's shared direction (the mean),
  # which is what a particular query can single out; a key's raw norm would not do under
  # mem_qk_norm, where every key has norm 1.
  live = mask[..., None, None]
  mean = jnp.sum(jnp.where(live, keys, 0.0), 2) / jnp.maximum(jnp.sum(mask, 2), 1)[:, :, None, None]
  spread = jnp.where(mask[..., None], jnp.sum((keys - mean[:, :, None]) ** 2, -1), -1.0)  # [B, N, size, KV]
  _, ri = jax.lax.top_k(jnp.moveaxis(spread, 2, -1), min(reps, size))  # [B, N, KV, r]
  rep = jnp.take_along_axis(jnp.moveaxis(keys, 2, 3), ri[..., None], axis=3)  # [B, N, KV, r, D]
  rep_live = jnp.take_along_axis(mask[:, :, None, :], ri, axis=3)

  # The sum of the live queries ranks blocks as their mean does.
  qsum = jnp.sum(jnp.where(query_mask[:, :, None, None, None], q.astype(jnp.float32), 0.0), axis=(1, 3))
  s = jnp.where(rep_live, jnp.einsum("bkd,bnkrd->bnkr", qsum, rep), NEG).max(-1)  # [B, N, KV]
  # A dead block scores NEG, below every live one; taken only when fewer live blocks than k
  # remain, its slots stay masked.
  _, bi = jax.lax.top_k(jnp.moveaxis(s, 1, -1), min(topk, n))  # [B, KV, k]

  def take(x):  # [B, N, size, KV, ...] -> [B, k * size, KV, ...]: each kv head's chosen blocks
    x = jnp.moveaxis(x, 3, 1)
    x = jnp.take_along_axis(x, bi.reshape(bi.shape + (1,) * (x.ndim - 3)), axis=2)
    return jnp.moveaxis(x.reshape((b, kv, -1) + x.shape[4:]), 1, 2)

  per_head = lambda x: jnp.broadcast_to(x[..., None], x.shape + (kv,))
  seen = jnp.moveaxis(take(per_head(mask)), 1, -1)[:, :, None, None, :]  # [B, KV, 1, 1, S]
  pos = None if positive is None else jnp.moveaxis(take(per_head(positive)), 1, -1)[:, :, None, None, :]
  return block_partial(scores(q, take(keys)), seen, take(values), pos)
