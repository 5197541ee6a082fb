"""The score/softmax work of attention, with implementations chosen by config.

`attend` reduces one block of keys (the causal local window, the crossbatch
contexts, a generation cache) to a `memory.Partial`, so any mix of blocks stays
one softmax (DESIGN.md, "One attention path"). Implementations:

* `dense`: the reference; materialises the float32 scores [B, KV, G, T, S].
* `blockwise`: streams key/value blocks of `block` keys with the running max /
  sum merge; a custom VJP recomputes each block's scores in the backward pass, so
  neither pass keeps more than [B, KV, G, T, block] scores. It returns the
  partial in normalised form (max = log-sum-exp, sum = 1), which merges like any
  other partial.
* `fused`: the backend's kernel (cuDNN through `jax.nn.dot_product_attention` on
  GPU) for a causal window that nothing merges with (layers without extra
  contexts); everything else, and every CPU or TPU run, uses `blockwise`.

Shapes: q [B, T, KV, G, D] (already scaled), k/v [B, S, KV, D], key_mask [B, S].
With `q_pos` [B, T] the block is causal: query i sees key slot j iff j <= q_pos[b, i]
(the local window: q_pos = 0..T-1; a generation cache: the token's slot).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from fot_jax.model.config import ATTENTION_IMPLS as IMPLS
from fot_jax.model.memory import NEG, Partial, block_partial, scores

_ALL = jnp.iinfo(jnp.int32).max  # q_pos of a fully visible (non-causal) block


def attend(q, k, v, key_mask, q_pos=None, positive=None, impl: str = "dense", block: int = 512) -> Partial:
  """One block of keys -> Partial over [B, KV, G, T]; `pos` (mass on positive keys) when
  `positive` [B, S] is given (for r_d; never differentiated)."""
  b, t = q.shape[:2]
  if impl == "dense":
    mask = key_mask[:, None, None, None, :]
    if q_pos is not None:
      slots = jnp.arange(k.shape[1], dtype=jnp.int32)
      mask = mask & (slots[None, None, None, None, :] <= q_pos[:, None, None, :, None])
    pos = None if positive is None else positive[:, None, None, None, :]
    return block_partial(scores(q, k), mask, v, pos)
  if impl not in IMPLS:
    raise ValueError(f"model.attention_impl: must be one of {IMPLS}, got {impl!r}")
  if block <= 0:
    raise ValueError(f"model.attention_block: must be positive, got {block}")
  q_pos = jnp.full((b, t), _ALL, jnp.int32) if q_pos is None else q_pos.astype(jnp.int32)
  want_pos = positive is not None
  positive = jnp.zeros(key_mask.shape, bool) if positive is None else positive
  out, lse, pos = _blockwise(q, k, v, key_mask, q_pos, positive, min(block, k.shape[1]))
  live = (lse > NEG / 2).astype(jnp.float32)
  return Partial(lse, live, out, jax.lax.stop_gradient(pos) if want_pos else None)


def _split(x, block):
  """[B, S, ...] -> [S/block, B, block, ...], padded with zeros (dead keys) to whole blocks."""
  s = x.shape[1]
  n = -(-s // block)
  x = jnp.pad(x, [(0, 0), (0, n * block - s)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((x.shape[0], n, block) + x.shape[2:]), 1, 0)


def _visible(mask_b, q_pos, start, block):
  """[B, 1, 1, T, block] bool: live keys of this block that the queries may see."""
  slots = start + jnp.arange(block, dtype=jnp.int32)
  return mask_b[:, None, None, None, :] & (slots[None, None, None, None, :] <= q_pos[:, None, None, :, None])


def _forward(q, k, v, key_mask, q_pos, positive, block):
  b, t, kv, g, d = q.shape
  q32 = q.astype(jnp.float32)
  shape = (b, kv, g, t)

  def body(carry, xs):
    m, l, acc, pos = carry
    i, kb, vb, mb, pb = xs
    vis = _visible(mb, q_pos, i * block, block)
    s = jnp.where(vis, scores(q32, kb), NEG)
    m_new = jnp.maximum(m, jnp.max(s, -1))
    p = jnp.exp(s - m_new[..., None]) * vis
    c = jnp.exp(m - m_new)
    acc = acc * c[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, vb.astype(jnp.float32))
    pos = pos * c + jnp.sum(p * pb[:, None, None, None, :], -1)
    return (m_new, l * c + jnp.sum(p, -1), acc, pos), None

  blocks = (_split(k, block), _split(v, block), _split(key_mask, block), _split(positive, block))
  n = blocks[0].shape[0]
  init = (jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape + (d,), jnp.float32), jnp.zeros(shape, jnp.float32))
  (m, l, acc, pos), _ = jax.lax.scan(body, init, (jnp.arange(n, dtype=jnp.int32),) + blocks)
  safe = jnp.maximum(l, 1e-30)
  return acc / safe[..., None], m + jnp.log(safe), pos / safe


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _blockwise(q, k, v, key_mask, q_pos, positive, block):
  """-> out [B, KV, G, T, D] float32 (normalised), lse [B, KV, G, T], positive fraction."""
  return _forward(q, k, v, key_mask, q_pos, positive, block)


def _blockwise_fwd(q, k, v, key_mask, q_pos, positive, block):
  out, lse, pos = _forward(q, k, v, key_mask, q_pos, positive, block)
  return (out, lse, pos), (q, k, v, key_mask, q_pos, positive, out, lse)


def _blockwise_bwd(block, res, cts):
  """Flash-attention backward: per block, p = exp(s - lse) is recomputed and
  ds = p * (dp - sum(dout * out) + dlse); the positive fraction is a metric (no gradient)."""
  q, k, v, key_mask, q_pos, positive, out, lse = res
  dout, dlse, _ = cts
  # Queries that see no key take no part (their cotangents can be inf/NaN from the
  # division by an empty sum downstream, and 0 * inf would leak into the keys).
  live = lse > NEG / 2
  dout, dlse = jnp.where(live[..., None], dout, 0.0), jnp.where(live, dlse, 0.0)
  q32 = q.astype(jnp.float32)
  delta = jnp.sum(dout * out, -1) - dlse  # [B, KV, G, T]

  def body(dq, xs):
    i, kb, vb, mb = xs
    vis = _visible(mb, q_pos, i * block, block)
    s = jnp.where(vis, scores(q32, kb), NEG)
    p = jnp.exp(s - lse[..., None]) * vis
    dv = jnp.einsum("bkgts,bkgtd->bskd", p, dout)
    dp = jnp.einsum("bkgtd,bskd->bkgts", dout, vb.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, kb.astype(jnp.float32))
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q32)
    return dq, (dk, dv)

  kb, vb, mb = _split(k, block), _split(v, block), _split(key_mask, block)
  n = kb.shape[0]
  dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32),
                              (jnp.arange(n, dtype=jnp.int32), kb, vb, mb))
  s = k.shape[1]

  def unsplit(x):  # [S/block, B, block, KV, D] -> [B, S, KV, D]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :s]

  return (dq.astype(q.dtype), unsplit(dk).astype(k.dtype), unsplit(dv).astype(v.dtype),
          None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ----------------------------------------------------------------------------- fused kernels

def fused_backend(dtype=jnp.bfloat16) -> Optional[str]:
  """The fused kernel this backend has for `dtype` ('cudnn' on GPU, half precision only),
  or None (CPU, TPU, float32: blockwise)."""
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return "cudnn" if jax.default_backend() == "gpu" and half else None


def fused_causal(q, k, v, token_mask, implementation: str):
  """Causal self-attention of a window through `jax.nn.dot_product_attention` -> [B, T, KV, G, D].

  q is already scaled (scale=1); GQA is passed through (heads = KV * G, grouped as here).
  `implementation='xla'` runs the same call on CPU (the tests check the layout with it).
  """
  b, t, kv, g, d = q.shape
  # Padding keys are masked; a query always sees itself, so padding queries stay finite
  # (their outputs are don't-care, as in the reference, and never reach real tokens).
  eye = jnp.eye(t, dtype=bool)[None, None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None] & (token_mask[:, None, None, :] | eye)
  out = jax.nn.dot_product_attention(q.reshape(b, t, kv * g, d), k, v, mask=mask, scale=1.0,
                                     implementation=implementation)
  return out.reshape(b, t, kv, g, d)
