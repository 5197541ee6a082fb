"""Attention over a causal local window plus extra key/value contexts.

The memory layers combine several *blocks* of keys under one softmax: the causal
local window, crossbatch contexts (training), and memory (inference, dense or
exact top-k). Each block is reduced to a flash-attention style partial
(running max, sum of exponentials, weighted values), so blocks can be merged in
any order and memory can be streamed in chunks far larger than one block.

Shapes use grouped-query layout: queries [B, T, KV, G, D], keys/values
[B, S, KV, D]; scores [B, KV, G, T, S].
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity" keeps fully masked blocks NaN-free
MEMORY_MODES = ("dense", "topk", "approx_topk")


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


def topk_memory_partial(q, blocks: Sequence[MemoryBlock], k: int, chunk: int,
                        recall: Optional[float] = None) -> Optional[Partial]:
  """Top-k per query and kv-head group over all blocks (inner product): exact, or with
  `recall` the approximate top-k of each chunk (jax.lax.approx_max_k: the TPU's native
  kNN, aiming at that recall; other backends compute it exactly)."""
  b, t, kv, g, d = q.shape
  best_s = jnp.full((b, kv, g, t, k), NEG, jnp.float32)
  best_v = jnp.zeros((b, kv, g, t, k, d), jnp.float32)
  for block in blocks:
    ks, vs, ms, _ = _chunks(block, min(chunk, block.keys.shape[1]))

    def body(carry, xs):
      bs, bv = carry
      kc, vc, mc = xs
      s = jnp.where(mc[:, None, None, None, :], scores(q, kc), NEG)
      kk = min(k, s.shape[-1])
      if recall is None:
        cs, ci = jax.lax.top_k(s, kk)  # [B, KV, G, T, kk]
      else:
        cs, ci = jax.lax.approx_max_k(s, kk, recall_target=recall)
      vc = jnp.broadcast_to(vc, (b,) + vc.shape[1:]).astype(jnp.float32)
      vc = jnp.moveaxis(vc, 2, 1)  # [B, KV, C, D]
      cv = jnp.take_along_axis(vc, ci.reshape(b, kv, g * t * kk, 1), axis=2)
      cv = cv.reshape(b, kv, g, t, kk, d)
      all_s = jnp.concatenate([bs, cs], axis=-1)
      all_v = jnp.concatenate([bv, cv], axis=-2)
      ns, ni = jax.lax.top_k(all_s, k)
      nv = jnp.take_along_axis(all_v, ni[..., None], axis=-2)
      return (ns, nv), None

    (best_s, best_v), _ = jax.lax.scan(body, (best_s, best_v), (ks, vs, ms))
  live = best_s > NEG / 2
  return block_partial(best_s, live, best_v)
