"""The score/softmax work of attention, with implementations chosen by config.

`attend` reduces one block of keys (the causal local window, the crossbatch
contexts, a generation cache) to a `memory.Partial`, so any mix of blocks stays
one softmax (docs/semantics.md, "One attention path"). Implementations:

* `dense`: the reference; materialises the float32 scores [B, KV, G, T, S].
* `blockwise`: streams key/value blocks of `block` keys with the running max /
  sum merge; a custom VJP recomputes each block's scores in the backward pass, so
  neither pass keeps more than [B, KV, G, T, block] scores. A causal block (q_pos
  given) is also cut into query chunks of `block`, and a (chunk, key block) pair
  that no query may see (the future, padding) is skipped in both passes: a long
  causal window costs about half the dense score work and O(block^2) scores.
  It returns the partial in normalised form (max = log-sum-exp, sum = 1), which
  merges like any other partial. `attention_rotated.attend_rotated` streams the same
  way for the position strategies (several rotations of q and k, one chosen per pair).
* `fused`: the backend's kernel (fot_jax/model/fused_kernels.py: cuDNN on GPU, the
  Pallas splash kernel on TPU) for a causal window that nothing merges with (layers
  without extra contexts); everything else uses `blockwise`, and where no kernel applies
  a one-line warning says so.

Shapes: q [B, T, KV, G, D] (already scaled), k/v [B, S, KV, D], key_mask [B, S].
With `q_pos` [B, T] the block is causal: query i sees key slot j iff j <= q_pos[b, i]
(the local window: q_pos = 0..T-1; a generation cache: the token's slot).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from fot_jax.model.config import ATTENTION_IMPLS as IMPLS
from fot_jax.model.memory import NEG, MemoryBlock, Partial, block_partial, merge, scores

ALL_VISIBLE = jnp.iinfo(jnp.int32).max  # q_pos of a fully visible (non-causal) block


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
  causal = q_pos is not None
  q_pos = jnp.full((b, t), ALL_VISIBLE, jnp.int32) if q_pos is None else q_pos.astype(jnp.int32)
  want_pos = positive is not None
  positive = jnp.zeros(key_mask.shape, bool) if positive is None else positive
  kblock = min(block, k.shape[1])
  if causal:  # query chunks: each skips the key blocks beyond its last query
    qc = min(block, t)
    q, q_pos = _pad_to(q, 1, qc), _pad_to(q_pos, 1, qc, -1)  # padding queries see nothing
    out, lse, pos = _query_chunks(
        lambda c: _blockwise(_chunk(q, c, qc), k, v, key_mask, _chunk(q_pos, c, qc), positive, kblock,
                             want_pos),
        t, qc)
  else:
    out, lse, pos = _blockwise(q, k, v, key_mask, q_pos, positive, kblock, want_pos)
  return _normalised_partial(out, lse, pos if want_pos else None)


def attend_memory(q, blocks: Sequence[MemoryBlock], block: int) -> Optional[Partial]:
  """Dense attention over every live entry of memory `blocks`, streamed in key blocks of
  `block` (`blockwise`, all queries see all live entries: a block with none is skipped, as
  memory grows by doubling its capacity); `pos` set when some block marks positives (r_d)."""
  b = q.shape[0]
  grow = lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:])  # memory shared by the batch (Bm = 1)
  want_pos = any(x.positive is not None for x in blocks)
  total = None
  for x in blocks:
    positive = None if not want_pos else grow(x.mask & False if x.positive is None else x.positive)
    part = attend(q, grow(x.keys), grow(x.values), grow(x.mask), None, positive, "blockwise",
                  min(block, x.keys.shape[1]))
    total = part if total is None else merge(total, part)
  return total


def _normalised_partial(out, lse, pos=None) -> Partial:
  live = (lse > NEG / 2).astype(jnp.float32)
  return Partial(lse, live, out, None if pos is None else jax.lax.stop_gradient(pos))


def _pad_to(x, axis, chunk, value=0):
  """Pads `axis` to whole chunks with `value`."""
  extra = -(-x.shape[axis] // chunk) * chunk - x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _chunk(x, c, chunk, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis)


def _query_chunks(f, t, chunk):
  """f(c) -> arrays [B, KV, G, chunk, ...] for query chunk c; -> the same over T queries
  (one call when T fits one chunk, else lax.map over chunks: a small graph for any T)."""
  n = -(-t // chunk)
  if n == 1:
    return tuple(o[:, :, :, :t] for o in f(0))
  outs = jax.lax.map(f, jnp.arange(n, dtype=jnp.int32))
  return tuple(jnp.moveaxis(o, 0, 3).reshape(o.shape[1:4] + (n * chunk,) + o.shape[5:])[:, :, :, :t]
               for o in outs)


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


def _rows(q):
  """q [..., B, T, KV, G, D] -> [..., B, KV, G*T, D] float32: the G query heads that share a
  key head as one matrix, so a key block is one [G*T, D] x [D, block] matmul per key head
  (on CPU several times faster than G small dots, and the same work on accelerators)."""
  *lead, b, t, kv, g, d = q.shape
  perm = tuple(range(len(lead))) + tuple(len(lead) + i for i in (0, 2, 3, 1, 4))
  return jnp.transpose(q.astype(jnp.float32), perm).reshape(*lead, b, kv, g * t, d)


def _split_heads(x, block):
  """k/v [B, S, KV, D] -> [S/block, B, KV, block, D] float32 (dead zero keys pad the end)."""
  return jnp.swapaxes(_split(x.astype(jnp.float32), block), 2, 3)


def _unsplit_heads(x, s):
  """[S/block, ..., KV, block, D] -> [..., S, KV, D]: `_split_heads` undone, dead keys dropped."""
  x = jnp.moveaxis(jnp.swapaxes(x, -3, -2), 0, -4)
  return x.reshape(x.shape[:-4] + (-1,) + x.shape[-2:])[..., :s, :, :]


def _block_case(mb, start, block, lo, hi):
  """0: no query sees this key block (skip), 1: some do (mask it), 2: every query sees every
  key (no mask): live keys and queries at positions lo..hi."""
  seen = jnp.any(mb) & (start <= hi)
  full = jnp.all(mb) & (start + block - 1 <= lo)
  return jnp.where(full, 2, seen.astype(jnp.int32))


def block_forward(q, k, v, key_mask, q_pos, positive, block, want_pos):
  """The blockwise forward pass over one set of keys (public: the context-parallel
  strategies run it per chunk) -> (out [B, KV, G, T, D] normalised, lse, positive fraction)."""
  b, t, kv, g, d = q.shape
  rows = _rows(q)
  lo, hi = jnp.min(q_pos), jnp.max(q_pos)

  def body(carry, xs):
    i, kb, vb, mb, pb = xs

    def update(masked, carry):
      s = jnp.einsum("bkqd,bksd->bkqs", rows, kb)
      vis = _visible(mb, q_pos, i * block, block) if masked else None
      return _online_update(carry, s, vis, vb, pb if want_pos else None)

    return jax.lax.switch(_block_case(mb, i * block, block, lo, hi),
                          [lambda c: c, functools.partial(update, True), functools.partial(update, False)],
                          carry), None

  blocks = (_split_heads(k, block), _split_heads(v, block), _split(key_mask, block),
            _split(positive, block))
  out, lse, pos = _stream(body, (b, kv, g * t), d, blocks)
  return out.reshape(b, kv, g, t, d), lse.reshape(b, kv, g, t), pos.reshape(b, kv, g, t)


def _online_update(carry, s, vis, vb, pb):
  """One key block into the running (max, sum, weighted values, positive mass); rows-major:
  s [B, KV, G*T, block], vb [B, KV, block, D], vis None (all visible) or [B, 1, 1, T, block],
  pb None (no positive mass wanted) or [B, block]."""
  m, l, acc, pos = carry
  if vis is not None:
    view = s.shape[:2] + (-1, vis.shape[3], s.shape[-1])  # [B, KV, G, T, block]
    s = jnp.where(vis, s.reshape(view), NEG).reshape(s.shape)
  m_new = jnp.maximum(m, jnp.max(s, -1))
  p = jnp.exp(s - m_new[..., None])
  if vis is not None:  # a row with nothing visible yet has m_new = NEG: exp(0) must not count
    p = jnp.where(vis, p.reshape(view), 0.0).reshape(s.shape)
  c = jnp.exp(m - m_new)
  acc = acc * c[..., None] + jnp.einsum("bkqs,bksd->bkqd", p, vb)
  if pb is not None:
    pos = pos * c + jnp.einsum("bkqs,bs->bkq", p, pb.astype(jnp.float32))
  return m_new, l * c + jnp.sum(p, -1), acc, pos


def _stream(body, shape, d, blocks, n=None):
  """Scans `body` over key blocks (n steps: the leading axis of `blocks`, or `n` given)
  -> (out normalised, lse, positive fraction)."""
  n = blocks[0].shape[0] if n is None else n
  init = (jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape + (d,), jnp.float32), jnp.zeros(shape, jnp.float32))
  (m, l, acc, pos), _ = jax.lax.scan(body, init, (jnp.arange(n, dtype=jnp.int32),) + blocks)
  safe = jnp.maximum(l, 1e-30)
  return acc / safe[..., None], m + jnp.log(safe), pos / safe


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blockwise(q, k, v, key_mask, q_pos, positive, block, want_pos):
  """-> out [B, KV, G, T, D] float32 (normalised), lse [B, KV, G, T], positive fraction
  (zeros unless `want_pos`)."""
  return block_forward(q, k, v, key_mask, q_pos, positive, block, want_pos)


def _blockwise_fwd(q, k, v, key_mask, q_pos, positive, block, want_pos):
  out, lse, pos = block_forward(q, k, v, key_mask, q_pos, positive, block, want_pos)
  return (out, lse, pos), (q, k, v, key_mask, q_pos, positive, out, lse)


def block_backward(block, want_pos, res, cts):
  """Flash-attention backward (public, as `block_forward`): per block, p = exp(s - lse) is recomputed and
  ds = p * (dp - sum(dout * out) + dlse); the positive fraction is a metric (no gradient)."""
  q, k, v, key_mask, q_pos, positive, out, lse = res
  dout, dlse, _ = cts
  b, t, kv, g, d = q.shape
  # Queries that see no key take no part (their cotangents can be inf/NaN from the
  # division by an empty sum downstream, and 0 * inf would leak into the keys).
  live = lse > NEG / 2
  dout, dlse = jnp.where(live[..., None], dout, 0.0), jnp.where(live, dlse, 0.0)
  delta = (jnp.sum(dout * out, -1) - dlse).reshape(b, kv, g * t)  # rows-major, as the forward
  dout, lse = dout.reshape(b, kv, g * t, d), lse.reshape(b, kv, g * t)
  rows = _rows(q)
  lo, hi = jnp.min(q_pos), jnp.max(q_pos)

  def body(dq, xs):
    i, kb, vb, mb = xs

    def grads(masked, dq):
      s = jnp.einsum("bkqd,bksd->bkqs", rows, kb)
      p = jnp.exp(s - lse[..., None])
      if masked:
        vis = _visible(mb, q_pos, i * block, block)
        p = jnp.where(vis, p.reshape(b, kv, g, t, block), 0.0).reshape(s.shape)
      dv = jnp.einsum("bkqs,bkqd->bksd", p, dout)
      ds = p * (jnp.einsum("bkqd,bksd->bkqs", dout, vb) - delta[..., None])
      dk = jnp.einsum("bkqs,bkqd->bksd", ds, rows)
      return dq + jnp.einsum("bkqs,bksd->bkqd", ds, kb), (dk, dv)

    zero = jnp.zeros(kb.shape, jnp.float32)
    return jax.lax.switch(_block_case(mb, i * block, block, lo, hi),
                          [lambda dq: (dq, (zero, zero)), functools.partial(grads, True),
                           functools.partial(grads, False)], dq)

  kb, vb = _split_heads(k, block), _split_heads(v, block)
  n = kb.shape[0]
  dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(rows.shape, jnp.float32),
                              (jnp.arange(n, dtype=jnp.int32), kb, vb, _split(key_mask, block)))
  s = k.shape[1]

  dq = jnp.transpose(dq.reshape(b, kv, g, t, d), (0, 3, 1, 2, 4))
  return (dq.astype(q.dtype), _unsplit_heads(dk, s).astype(k.dtype), _unsplit_heads(dv, s).astype(v.dtype),
          None, None, None)


_blockwise.defvjp(_blockwise_fwd, block_backward)


# ----------------------------------------------------------------------------- crossbatch sources

def attend_sources(q, k, v, key_mask, sources, positive, block: int = 512) -> Partial:
  """Crossbatch extra contexts, read by index inside the blockwise scan.

  q [R, T, KV, G, D] (scaled) are R query rows; k/v [Bk, S, KV, D] and key_mask [Bk, S]
  are the windows of the batch (or of a device group); sources [R, W] int32 names the
  windows each row sees (-1: none) and positive [R, W] marks its own stream's. Every
  query of a row sees every live key of its sources (no causality across windows).

  Each scan step takes one key block (`block` keys of one source column, the whole window
  when it is shorter) straight from the batch's keys by index (a gather of [R, KV, block,
  D]), so nothing holds a per-row copy of the W * S source keys: memory is one block's
  scores plus the batch's keys, flat in W (and in d). The custom VJP recomputes the block in
  the backward pass and scatter-adds its key and value gradients into the batch's.
  -> Partial over [R, KV, G, T] with `pos` (r_d).
  """
  if block <= 0:
    raise ValueError(f"model.attention_block: must be positive, got {block}")
  out, lse, pos = _sources(q, k, v, key_mask, jnp.asarray(sources, jnp.int32), jnp.asarray(positive, bool),
                           min(block, k.shape[1]))
  return _normalised_partial(out, lse, pos)


class _SourceSteps:
  """The scan over (source column, key block) steps. (Grouping several short source windows
  into one step measured slower on CPU: the gathered blocks then need a transpose.)"""

  def __init__(self, k, v, key_mask, sources, positive, block):
    split = lambda x: jnp.swapaxes(_split(x, block), 2, 3)  # [S/block, Bk, KV, block, D]
    self.ks, self.vs, self.ms = split(k), split(v), _split(key_mask, block)  # own dtype
    self.nb = self.ks.shape[0]
    self.n = sources.shape[1] * self.nb
    self.live, self.idx, self.posf = sources >= 0, jnp.maximum(sources, 0), positive.astype(jnp.float32)

  def at(self, step):
    """-> (key block, the rows' sources [R], visible keys [R, block], positive keys [R, block])."""
    col, blk = step // self.nb, step % self.nb
    take = lambda x: jax.lax.dynamic_index_in_dim(x, col, 1, keepdims=False)
    src = take(self.idx)
    mb = jax.lax.dynamic_index_in_dim(self.ms, blk, 0, keepdims=False)[src] & take(self.live)[:, None]
    return blk, src, mb, jnp.broadcast_to(take(self.posf)[:, None], mb.shape)

  def gather(self, xs, blk, src):
    """Keys or values of the step, float32 [R, KV, block, D]."""
    return jax.lax.dynamic_index_in_dim(xs, blk, 0, keepdims=False)[src].astype(jnp.float32)

  @staticmethod
  def scatter_add(acc, blk, src, dx):
    """dx [R, KV, block, D] into acc [S/block, Bk, KV, block, D] at the step's keys."""
    return acc.at[blk, src].add(dx)


def _mask_case(mb):
  """0: no live key in the step (skip), 1: some (mask them), 2: all (no mask)."""
  return jnp.where(jnp.all(mb), 2, jnp.any(mb).astype(jnp.int32))


def _sources_forward(q, k, v, key_mask, sources, positive, block):
  r, t, kv, g, d = q.shape
  rows = _rows(q)
  steps = _SourceSteps(k, v, key_mask, sources, positive, block)

  def body(carry, xs):
    blk, src, mb, pb = steps.at(xs[0])

    def update(masked, carry):
      s = jnp.einsum("bkqd,bksd->bkqs", rows, steps.gather(steps.ks, blk, src))
      vis = mb[:, None, None, None, :] if masked else None
      return _online_update(carry, s, vis, steps.gather(steps.vs, blk, src), pb)

    return jax.lax.switch(_mask_case(mb), [lambda c: c, functools.partial(update, True),
                                           functools.partial(update, False)], carry), None

  out, lse, pos = _stream(body, (r, kv, g * t), d, (), n=steps.n)
  return out.reshape(r, kv, g, t, d), lse.reshape(r, kv, g, t), pos.reshape(r, kv, g, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _sources(q, k, v, key_mask, sources, positive, block):
  return _sources_forward(q, k, v, key_mask, sources, positive, block)


def _sources_fwd(q, k, v, key_mask, sources, positive, block):
  out, lse, pos = _sources_forward(q, k, v, key_mask, sources, positive, block)
  return (out, lse, pos), (q, k, v, key_mask, sources, positive, out, lse)


def _sources_bwd(block, res, cts):
  """As `block_backward`, one step's keys at a time; their key/value gradients are
  scatter-added into the batch's (rows that share a source add up)."""
  q, k, v, key_mask, sources, positive, out, lse = res
  dout, dlse, _ = cts
  r, t, kv, g, d = q.shape
  live_q = lse > NEG / 2
  dout, dlse = jnp.where(live_q[..., None], dout, 0.0), jnp.where(live_q, dlse, 0.0)
  delta = (jnp.sum(dout * out, -1) - dlse).reshape(r, kv, g * t)
  dout, lse = dout.reshape(r, kv, g * t, d), lse.reshape(r, kv, g * t)
  rows = _rows(q)
  steps = _SourceSteps(k, v, key_mask, sources, positive, block)

  def body(carry, step):
    blk, src, mb, _ = steps.at(step)

    def grads(masked, carry):
      dq, dks, dvs = carry
      kb, vb = steps.gather(steps.ks, blk, src), steps.gather(steps.vs, blk, src)
      p = jnp.exp(jnp.einsum("bkqd,bksd->bkqs", rows, kb) - lse[..., None])
      if masked:
        p = jnp.where(mb[:, None, None, :], p, 0.0)
      dv = jnp.einsum("bkqs,bkqd->bksd", p, dout)
      ds = p * (jnp.einsum("bkqd,bksd->bkqs", dout, vb) - delta[..., None])
      dk = jnp.einsum("bkqs,bkqd->bksd", ds, rows)
      return (dq + jnp.einsum("bkqs,bksd->bkqd", ds, kb), steps.scatter_add(dks, blk, src, dk),
              steps.scatter_add(dvs, blk, src, dv))

    return jax.lax.switch(_mask_case(mb), [lambda c: c, functools.partial(grads, True),
                                           functools.partial(grads, False)], carry), None

  zeros = jnp.zeros(steps.ks.shape, jnp.float32)
  (dq, dks, dvs), _ = jax.lax.scan(body, (jnp.zeros(rows.shape, jnp.float32), zeros, zeros),
                                   jnp.arange(steps.n, dtype=jnp.int32))
  s = k.shape[1]

  dq = jnp.transpose(dq.reshape(r, kv, g, t, d), (0, 3, 1, 2, 4))
  return (dq.astype(q.dtype), _unsplit_heads(dks, s).astype(k.dtype), _unsplit_heads(dvs, s).astype(v.dtype),
          None, None, None)


_sources.defvjp(_sources_fwd, _sources_bwd)
