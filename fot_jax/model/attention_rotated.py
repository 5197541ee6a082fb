"""Attention whose keys are rotated per position strategy (Self-Extend, LM-Infinite;
fot_jax/model/position_strategies.py): `attend_rotated` streams a causal window whose
(query, key) pairs each pick their score among several rotations of q and k, block by block as
attention_ops' `blockwise` does, with a custom VJP that recomputes each pair's scores.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fot_jax.model.attention_ops import (_chunk, _normalised_partial, _online_update, _pad_to, _query_chunks, _rows,
                                         _split, _split_heads, _stream, _unsplit_heads, _visible)
from fot_jax.model.memory import NEG, Partial


def attend_rotated(qs, ks, v, key_mask, q_pos, positions, choose, block: int = 512) -> Partial:
  """A causal window whose pairs pick their score among several rotations (position strategies).

  qs [R, B, T, KV, G, D] (scaled), ks [R, B, S, KV, D]: the queries and keys under each of R
  rotations; positions [B, T] (the window's token positions, queries and keys alike);
  choose(query positions [B, t], key positions [B, s]) -> (choice int [B, t, s], visible bool):
  the rotation that scores a pair and whether the strategy lets it be seen (causality, padding
  and q_pos are applied here). Streams (query chunk, key block) pairs as `blockwise` does,
  skipping pairs nothing sees, in both passes: a custom VJP recomputes each pair's scores in
  the backward pass, so training keeps O(block^2) scores too, not every block's.
  """
  t = qs.shape[2]
  qc, kblock = min(block, t), min(block, ks.shape[2])
  qs_p = _pad_to(qs, 2, qc)
  q_pos_p = _pad_to(q_pos.astype(jnp.int32), 1, qc, -1)  # padding queries see nothing
  positions = positions.astype(jnp.int32)
  pos_p = _pad_to(positions, 1, qc)
  out, lse = _query_chunks(
      lambda c: _rotated(_chunk(qs_p, c, qc, axis=2), ks, v, key_mask, _chunk(q_pos_p, c, qc),
                         _chunk(pos_p, c, qc), positions, choose, kblock),
      t, qc)
  return _normalised_partial(out, lse)


def _rotated_blocks(ks, v, key_mask, k_posn, block):
  """Key blocks: keys per rotation [S/block, R, B, KV, block, D] and values [S/block, B, KV,
  block, D] float32, mask and positions [S/block, B, block]."""
  per_rotation = jax.vmap(lambda x: _split_heads(x, block), out_axes=1)
  return per_rotation(ks), _split_heads(v, block), _split(key_mask, block), _split(k_posn, block)


def _rotated_pairs(choose, q_posn, q_pos, i, mb, kpos, r_n):
  """Key block i -> visible [B, 1, 1, t, block] and, per rotation, the visible pairs it scores."""
  choice, allowed = choose(q_posn, kpos)
  vis = _visible(mb, q_pos, i * mb.shape[1], mb.shape[1]) & allowed[:, None, None]
  return vis, [(choice == r)[:, None, None] & vis for r in range(r_n)]


def _where_pairs(mask, x, y):
  """jnp.where for rows-major x/y [B, KV, G*t, block] and a pair mask [B, 1, 1, t, block]."""
  view = x.shape[:2] + (-1,) + mask.shape[3:]
  return jnp.where(mask, x.reshape(view), jnp.reshape(y, view) if jnp.ndim(y) else y).reshape(x.shape)


def _rotated_scores(rows, kb, use):
  """rows [R, B, KV, G*t, D], kb [R, B, KV, block, D] -> scores [B, KV, G*t, block], each pair
  by the rotation that `use` gives it (0 where none does); a rotation that scores no pair of
  the block is not computed."""
  s = jnp.zeros(rows.shape[1:4] + kb.shape[3:4], jnp.float32)
  for r, u in enumerate(use):
    score = lambda s, r=r, u=u: _where_pairs(u, jnp.einsum("bkqd,bksd->bkqs", rows[r], kb[r]), s)
    s = jax.lax.cond(jnp.any(u), score, lambda s: s, s)
  return s


def _rotated_forward(qs, ks, v, key_mask, q_pos, q_posn, k_posn, choose, block):
  r_n, b, t, kv, g, d = qs.shape
  rows = _rows(qs)

  def body(carry, xs):
    i, kb, vb, mb, kpos = xs
    vis, use = _rotated_pairs(choose, q_posn, q_pos, i, mb, kpos, r_n)
    update = lambda carry: _online_update(carry, _rotated_scores(rows, kb, use), vis, vb, None)
    return jax.lax.cond(jnp.any(vis), update, lambda carry: carry, carry), None

  out, lse, _ = _stream(body, (b, kv, g * t), d, _rotated_blocks(ks, v, key_mask, k_posn, block))
  return out.reshape(b, kv, g, t, d), lse.reshape(b, kv, g, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _rotated(qs, ks, v, key_mask, q_pos, q_posn, k_posn, choose, block):
  """One query chunk qs [R, B, t, KV, G, D] with q_pos and positions q_posn [B, t] over all
  keys (positions k_posn [B, S]) -> out [B, KV, G, t, D] float32 (normalised), lse [B, KV, G, t]."""
  return _rotated_forward(qs, ks, v, key_mask, q_pos, q_posn, k_posn, choose, block)


def _rotated_fwd(qs, ks, v, key_mask, q_pos, q_posn, k_posn, choose, block):
  out, lse = _rotated_forward(qs, ks, v, key_mask, q_pos, q_posn, k_posn, choose, block)
  return (out, lse), (qs, ks, v, key_mask, q_pos, q_posn, k_posn, out, lse)


def _rotated_bwd(choose, block, res, cts):
  """As `block_backward`, with each pair's scores from its rotation: p and ds come from the
  pair's own scores, and each rotation's queries and keys take ds on the pairs it scores."""
  qs, ks, v, key_mask, q_pos, q_posn, k_posn, out, lse = res
  dout, dlse = cts
  r_n, b, t, kv, g, d = qs.shape
  live = lse > NEG / 2  # queries that see nothing take no part (see block_backward)
  dout, dlse = jnp.where(live[..., None], dout, 0.0), jnp.where(live, dlse, 0.0)
  delta = (jnp.sum(dout * out, -1) - dlse).reshape(b, kv, g * t)
  dout, lse = dout.reshape(b, kv, g * t, d), lse.reshape(b, kv, g * t)
  rows = _rows(qs)

  def body(dq, xs):
    i, kb, vb, mb, kpos = xs
    vis, use = _rotated_pairs(choose, q_posn, q_pos, i, mb, kpos, r_n)

    def grads(dq):
      p = _where_pairs(vis, jnp.exp(_rotated_scores(rows, kb, use) - lse[..., None]), 0.0)
      dv = jnp.einsum("bkqs,bkqd->bksd", p, dout)
      ds = p * (jnp.einsum("bkqd,bksd->bkqs", dout, vb) - delta[..., None])
      dqs, dks = [], []
      for r, u in enumerate(use):
        def rotation(dq_r, r=r, u=u):
          ds_r = _where_pairs(u, ds, 0.0)
          return (dq_r + jnp.einsum("bkqs,bksd->bkqd", ds_r, kb[r]),
                  jnp.einsum("bkqs,bkqd->bksd", ds_r, rows[r]))
        dq_r, dk_r = jax.lax.cond(jnp.any(u), rotation, lambda dq_r: (dq_r, jnp.zeros(kb.shape[1:])), dq[r])
        dqs.append(dq_r)
        dks.append(dk_r)
      return jnp.stack(dqs), (jnp.stack(dks), dv)

    skip = lambda dq: (dq, (jnp.zeros(kb.shape), jnp.zeros(vb.shape)))
    return jax.lax.cond(jnp.any(vis), grads, skip, dq)

  blocks = _rotated_blocks(ks, v, key_mask, k_posn, block)
  dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(rows.shape, jnp.float32),
                              (jnp.arange(blocks[0].shape[0], dtype=jnp.int32),) + blocks)
  dq = jnp.transpose(dq.reshape(r_n, b, kv, g, t, d), (0, 1, 4, 2, 3, 5))
  s = ks.shape[2]
  return (dq.astype(qs.dtype), _unsplit_heads(dk, s).astype(ks.dtype), _unsplit_heads(dv, s).astype(v.dtype),
          None, None, None, None)


_rotated.defvjp(_rotated_fwd, _rotated_bwd)
