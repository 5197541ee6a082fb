"""Sequence parallelism on the `context` mesh axis: attention over a window split across devices.

With the mesh's `context` axis of size n > 1, every activation's `length` axis is split
over it (rule `("length", "context")`): each device holds c = T / n tokens of every row,
and the per-token layers (projections, MLP, norms) run on them without communication.
Attention is the one layer that needs other devices' tokens. `attend` is the
sequence-parallel form of `attention_ops.attend` (same arguments, same `Partial` out),
run in `jax.shard_map` over the whole mesh; three strategies (`ModelConfig.context_parallel`):

* `ring`: queries stay, key/value chunks travel around the ring (`ppermute`), each step's
  partial merged by running max / sum (the blockwise op's `block_forward` per chunk). A custom
  VJP rings again in the backward pass: keys/values and their float32 gradient
  accumulators travel, one last hop returns the finished gradients to their owner; each
  chunk's gradients are `attention_ops.block_backward` with the global log-sum-exp. The
  next chunk's transfer is issued before this chunk's compute, so XLA may overlap them.
  Chunk pairs that the causal mask hides entirely are skipped (`lax.cond` on the layout's
  geometry, per device).
* `allgather`: all-gather keys/values (`all_gather`), local queries against all of them
  (Llama 3's context parallelism); its transpose is a reduce-scatter.
* `ulysses`: all-to-all from the sequence split to a head split, full-sequence attention on
  n-th of the heads, all-to-all back (DeepSpeed-Ulysses). Needs the (local) kv heads, or
  the query heads with kv heads repeated, to divide by n.

Layouts (`ModelConfig.context_layout`) place tokens on devices for causal load balance:
`contiguous` (device p: tokens pc..pc+c-1), `striped` (token i on device i mod n), `zigzag`
(the sequence in 2n chunks, device p holds chunks p and 2n-1-p). The caller puts the batch
in layout order (`to_layout`: inputs, targets, masks; `positions` = `permutation`) and
undoes it on per-token outputs (`from_layout`); losses are sums and need nothing.
Memory layers' extra contexts (crossbatch rows, each itself sequence-split) are fully
visible: they travel the ring like local keys (or are gathered / all-to-all'ed), and
their partial merges with the causal local one under one softmax, as without sharding.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fot_jax.model import attention_ops as ops
from fot_jax.model.config import CONTEXT_LAYOUTS as LAYOUTS, CONTEXT_PARALLEL as STRATEGIES
from fot_jax.model.memory import NEG, Partial, merge

AXIS = "context"


# ----------------------------------------------------------------------------- layouts

def permutation(t: int, n: int, layout: str) -> np.ndarray:
  """int32 [T]: slot i of the layout-ordered sequence holds original token perm[i];
  device p holds slots p*c .. (p+1)*c - 1."""
  check_length(t, n, layout)
  idx = np.arange(t, dtype=np.int32)
  if layout == "contiguous" or n == 1:
    return idx
  if layout == "striped":
    return idx.reshape(t // n, n).T.reshape(-1)
  chunks = idx.reshape(2 * n, t // (2 * n))
  return np.concatenate([np.concatenate([chunks[p], chunks[2 * n - 1 - p]]) for p in range(n)])


def check_length(t: int, n: int, layout: str, what: str = "window") -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"model.context_layout: must be one of {LAYOUTS}, got {layout!r}")
  parts = 2 * n if layout == "zigzag" and n > 1 else n
  if t % parts:
    raise ValueError(f"{what}: {t} tokens do not split into {parts} equal chunks for mesh.context={n} "
                     f"with layout {layout!r}; make the window a multiple of {parts}")


def check_heads(strategy: str, heads: int, kv_heads: int, n: int, tensor: int = 1) -> None:
  """Ulysses splits heads over `context`: the kv heads of a tensor shard (all of them when
  tensor does not divide them, as `attend` shards them), or else its query heads (each with
  its own copy of its kv head), must divide by n."""
  if kv_heads % tensor == 0:
    heads, kv_heads = heads // tensor, kv_heads // tensor
  if strategy == "ulysses" and kv_heads % n and heads % n:
    raise ValueError(f"model.context_parallel='ulysses': neither {kv_heads} kv heads nor {heads} query heads "
                     f"per tensor shard split over mesh.context={n}; use 'ring' or 'allgather'")


def to_layout(x, perm, axis: int = 1):
  """Puts the token axis in layout order (a gather with a static index: local when the
  axis is not yet split)."""
  return jnp.take(x, jnp.asarray(perm), axis=axis)


def from_layout(x, perm, axis: int = 1):
  return jnp.take(x, jnp.asarray(np.argsort(perm)), axis=axis)


def _runs(layout: str, n: int, c: int, dev):
  """[(start, length, first position, stride)]: the runs of original positions that the c
  slots of device `dev` hold (dev: int, or a traced index inside shard_map)."""
  if layout == "contiguous":
    return [(0, c, dev * c, 1)]
  if layout == "striped":
    return [(0, c, dev, n)]
  h = c // 2
  return [(0, h, dev * h, 1), (h, h, (2 * n - 1 - dev) * h, 1)]


def work_counts(t: int, n: int, layout: str) -> np.ndarray:
  """Unmasked (query, key) scores each device computes for a causal window of T tokens."""
  perm = permutation(t, n, layout)
  return np.array([int(np.sum(perm[p * (t // n):(p + 1) * (t // n)] + 1)) for p in range(n)])


# ----------------------------------------------------------------------------- mesh

def context_size(mesh=None) -> int:
  """Size of the `context` axis of `mesh` (default: the abstract mesh being traced under)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh is None or getattr(mesh, "empty", False) or AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[AXIS])


def active() -> bool:
  return context_size() > 1


def _mesh_axes(name):
  """The mesh axes of one logical name under the current rules (None: replicated)."""
  spec = nn.logical_to_mesh_axes((name,))
  return spec[0] if len(spec) else None


def _size(mesh, axes) -> int:
  if axes is None:
    return 1
  return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


# ----------------------------------------------------------------------------- the op

def attend(q, k, v, key_mask, *, causal: bool, positive=None, strategy: str = "ring",
           layout: str = "zigzag", impl: str = "blockwise", block: int = 512) -> Partial:
  """Sequence-parallel `attention_ops.attend` over the `context` axis of the abstract mesh.

  q [B, T, KV, G, D] (scaled), k/v [B, T, KV, D] with key_mask [B, T] (the causal local
  window, every token axis in layout order), or extra contexts [B, N, T, KV, D] with
  key_mask/positive [B, N, T] (fully visible; pass causal=False). -> Partial over
  [B, KV, G, T] in layout order, normalised (max = log-sum-exp), `pos` when `positive`."""
  mesh = jax.sharding.get_abstract_mesh()
  n = context_size(mesh)
  if strategy not in STRATEGIES:
    raise ValueError(f"model.context_parallel: must be one of {STRATEGIES}, got {strategy!r}")
  if _mesh_axes("length") != AXIS:
    raise ValueError(f"mesh.rules: with mesh.context={n} the logical axis 'length' must map to 'context' "
                     f"(got {_mesh_axes('length')!r})")
  b, t, kvh, g, d = q.shape
  check_length(t, n, layout)
  batch = _mesh_axes("batch")
  heads = _mesh_axes("act_heads")
  heads = heads if heads is not None and kvh % _size(mesh, heads) == 0 else None
  want_pos = positive is not None
  extra = k.ndim == 5
  if positive is None:
    positive = jnp.zeros(key_mask.shape, bool)
  kspec = P(batch, None, AXIS, heads) if extra else P(batch, AXIS, heads)
  mspec = P(batch, None, AXIS) if extra else P(batch, AXIS)
  row = P(batch, heads, None, AXIS)
  out_specs = Partial(row, row, row, row)
  body = functools.partial(_local, causal=causal, strategy=strategy, layout=layout, n=n, impl=impl,
                           block=block, extra=extra, want_pos=want_pos)
  part = jax.shard_map(body, mesh=mesh, in_specs=(P(batch, AXIS, heads), kspec, kspec, mspec, mspec),
                       out_specs=out_specs, check_vma=False)(q, k, v, key_mask, positive)
  return part._replace(pos=jax.lax.stop_gradient(part.pos) if want_pos else None)


def _local(q, k, v, mask, positive, *, causal, strategy, layout, n, impl, block, extra, want_pos):
  """One device's shard: q [b, c, kv, g, d]; k/v [b, c, kv, d] or [b, N, c, kv, d]."""
  if extra:  # each device holds a slice of every extra context: all fully visible
    b, m, c = mask.shape
    k, v = (x.reshape((b, m * c) + x.shape[3:]) for x in (k, v))
    mask, positive = mask.reshape(b, m * c), positive.reshape(b, m * c)
  if strategy == "ring":
    out, lse, pos = _ring(q, k, v, mask, positive, causal, layout, n, block, want_pos)
  elif strategy == "allgather":
    out, lse, pos = _allgather(q, k, v, mask, positive, causal, layout, n, impl, block)
  else:
    out, lse, pos = _ulysses(q, k, v, mask, positive, causal, layout, n, impl, block)
  live = (lse > NEG / 2).astype(jnp.float32)
  # `l` = 1 for a live query (normalised partial), as `attention_ops.attend` returns it.
  return Partial(lse, live, out, pos)


def _normalised(part: Partial):
  l = jnp.maximum(part.l, 1e-30)
  pos = jnp.zeros_like(part.l) if part.pos is None else part.pos / l
  return part.acc / l[..., None], part.m + jnp.log(l), pos


# ----------------------------------------------------------------------------- ring

def _ring_pairs(layout, n, c, s, me, src, causal):
  """[(query run, key run, visible)] for this device's queries and the chunk that started on
  `src`; visible is True / False (static) or a traced bool."""
  if not causal:
    return [((0, c, None, None), (0, s, None, None), True)]
  pairs = []
  for qr in _runs(layout, n, c, me):
    for kr in _runs(layout, n, s, src):
      _, ql, qo, qs = qr
      _, _, ko, _ = kr
      visible = ko <= qo + qs * (ql - 1)  # the run's first key precedes the last query
      pairs.append((qr, kr, visible))
  return pairs


def _q_rel(qr, kr, b, causal):
  """Query positions relative to a key run of stride s: key j (position o + s j) is visible
  to a query at position p iff j <= floor((p - o) / s); what `block_forward` compares slots to."""
  _, ql, qo, qs = qr
  if not causal:
    return jnp.full((b, ql), ops.ALL_VISIBLE, jnp.int32)
  _, _, ko, ks = kr
  pos = qo + qs * jnp.arange(ql, dtype=jnp.int32)
  return jnp.broadcast_to(jnp.floor_divide(pos - ko, ks).astype(jnp.int32), (b, ql))


def _cond(visible, compute, skip):
  if visible is True or visible is False:  # static (benchmarks compile one device's program)
    return compute() if visible else skip()
  return jax.lax.cond(visible, compute, skip)


def _ring_loop(step_fn, carry, cur, n, shift):
  """Runs step_fn(carry, chunk, step) for the n ring steps. SPMD: a scan over the first n - 1
  steps, each issuing the next chunk's transfer before its compute (so the two may
  overlap), then the last step; `shift` moves what travels after each step's compute."""
  def body(state, step):
    carry, cur = state
    nxt = _shift(cur[0], n)
    carry, travelling = step_fn(carry, cur, step)
    return (carry, (nxt,) + tuple(shift(travelling))), None

  (carry, cur), _ = jax.lax.scan(body, (carry, cur), jnp.arange(n - 1, dtype=jnp.int32))
  carry, travelling = step_fn(carry, cur, n - 1)
  return carry, travelling


def _shift(x, n):
  return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)])


def _empty(shape, d):
  z = jnp.zeros(shape, jnp.float32)
  return Partial(z + NEG, z, jnp.zeros(shape + (d,), jnp.float32), z)


def _forward_step(q, chunk, me, src, causal, layout, n, block, want_pos, parts):
  """Merges the partials of this device's queries against one chunk (that started on `src`)."""
  b, c, kvh, g, d = q.shape
  kc, vc, mc, pc = chunk
  s = kc.shape[1]
  starts = [r[0] for r in (_runs(layout, n, c, me) if causal else [(0, c, None, None)])]
  parts = list(parts)
  for qr, kr, visible in _ring_pairs(layout, n, c, s, me, src, causal):
    i = starts.index(qr[0])
    qx = q[:, qr[0]:qr[0] + qr[1]]
    sl = slice(kr[0], kr[0] + kr[1])
    q_rel = _q_rel(qr, kr, b, causal)

    def compute(qx=qx, sl=sl, q_rel=q_rel):
      out, lse, pos = ops.block_forward(qx, kc[:, sl], vc[:, sl], mc[:, sl], q_rel, pc[:, sl],
                                   min(block, sl.stop - sl.start), want_pos)
      live = (lse > NEG / 2).astype(jnp.float32)
      return Partial(lse, live, out * live[..., None], pos * live)

    parts[i] = merge(parts[i], _cond(visible, compute, lambda ql=qr[1]: _empty((b, kvh, g, ql), d)))
  return parts


def _ring_forward(q, k, v, mask, positive, causal, layout, n, block, want_pos, me=None, chunks=None):
  """-> (out [b, kv, g, c, d], lse, positive fraction) of the local queries against every
  device's chunk. With a static `me` and `chunks` (every device's (k, v, mask, positive))
  it is one device's work with no collectives, unrolled: what a benchmark compiles to see
  that device's FLOPs."""
  b, c, kvh, g, d = q.shape
  runs = _runs(layout, n, c, 0) if causal else [(0, c, None, None)]
  parts = [_empty((b, kvh, g, r[1]), d) for r in runs]
  if chunks is not None:
    for step in range(n):
      parts = _forward_step(q, chunks[(me - step) % n], me, (me - step) % n, causal, layout, n, block,
                            want_pos, parts)
  else:
    me = jax.lax.axis_index(AXIS)
    step_fn = lambda parts, cur, step: (_forward_step(q, cur[0], me, (me - step) % n, causal, layout, n, block,
                                                      want_pos, parts), ())
    parts, _ = _ring_loop(step_fn, parts, ((k, v, mask, positive),), n, lambda t: t)
  outs = [_normalised(p) for p in parts]
  return tuple(jnp.concatenate([o[j] for o in outs], axis=3) for j in range(3))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring(q, k, v, mask, positive, causal, layout, n, block, want_pos):
  return _ring_forward(q, k, v, mask, positive, causal, layout, n, block, want_pos)


def _ring_fwd(q, k, v, mask, positive, causal, layout, n, block, want_pos):
  out, lse, pos = _ring_forward(q, k, v, mask, positive, causal, layout, n, block, want_pos)
  return (out, lse, pos), (q, k, v, mask, out, lse)


def _ring_bwd(causal, layout, n, block, want_pos, res, cts):
  """Queries stay and collect dq; each key/value chunk travels with its float32 dk/dv
  accumulators, and one more hop after the last step brings them home."""
  q, k, v, mask, out, lse = res
  dout, dlse, _ = cts
  b, c, kvh, g, d = q.shape
  s = k.shape[1]
  me = jax.lax.axis_index(AXIS)
  runs = _runs(layout, n, c, me) if causal else [(0, c, None, None)]
  starts = [r[0] for r in runs]
  q32 = q.astype(jnp.float32)

  def step_fn(dq, cur, step):
    (kc, vc, mc), dk, dv = cur
    dq = list(dq)
    for qr, kr, visible in _ring_pairs(layout, n, c, s, me, (me - step) % n, causal):
      i = starts.index(qr[0])
      qs = slice(qr[0], qr[0] + qr[1])
      sl = slice(kr[0], kr[0] + kr[1])
      q_rel = _q_rel(qr, kr, b, causal)

      def compute(qs=qs, sl=sl, q_rel=q_rel):
        res_pair = (q32[:, qs], kc[:, sl].astype(jnp.float32), vc[:, sl].astype(jnp.float32), mc[:, sl],
                    q_rel, None, out[:, :, :, qs], lse[:, :, :, qs])
        return ops.block_backward(min(block, sl.stop - sl.start), False, res_pair,
                                  (dout[:, :, :, qs], dlse[:, :, :, qs], None))[:3]

      def skip(ql=qr[1], kl=kr[1]):
        return (jnp.zeros((b, ql, kvh, g, d), jnp.float32), jnp.zeros((b, kl, kvh, d), jnp.float32),
                jnp.zeros((b, kl, kvh, d), jnp.float32))

      dqp, dkp, dvp = _cond(visible, compute, skip)
      dq[i] = dq[i] + dqp
      dk, dv = dk.at[:, sl].add(dkp), dv.at[:, sl].add(dvp)
    return dq, (dk, dv)

  dq = [jnp.zeros((b, r[1], kvh, g, d), jnp.float32) for r in runs]
  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  # The gradient accumulators travel with their chunk; after the last step, one more hop home.
  dq, (dk, dv) = _ring_loop(step_fn, dq, ((k, v, mask),) + zeros, n, lambda t: _shift(t, n))
  dk, dv = _shift((dk, dv), n)
  return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ----------------------------------------------------------------------------- all-gather, Ulysses

def _gather(x, axis=1):
  return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)


def _my_positions(layout, n, c, b):
  perm = jnp.asarray(permutation(c * n, n, layout))
  mine = jax.lax.dynamic_slice_in_dim(perm, jax.lax.axis_index(AXIS) * c, c)
  return jnp.broadcast_to(mine, (b, c))


def _allgather(q, k, v, mask, positive, causal, layout, n, impl, block):
  """Every device's keys/values gathered (in original order when causal), local queries."""
  b, c = q.shape[:2]
  k, v, mask, positive = (_gather(x) for x in (k, v, mask, positive))
  if causal:
    inv = np.argsort(permutation(c * n, n, layout))
    k, v, mask = (x[:, inv] for x in (k, v, mask))
    part = ops.attend(q, k, v, mask, _my_positions(layout, n, c, b), impl=impl, block=block)
  else:
    part = ops.attend(q, k, v, mask, positive=positive, impl=impl, block=block)
  return _normalised(part)


def _ulysses(q, k, v, mask, positive, causal, layout, n, impl, block):
  """All-to-all to a head split (every token, heads/n), attention, all-to-all back."""
  b, c, kvh, g, d = q.shape
  check_heads("ulysses", kvh * g, kvh, n)
  grouped = kvh % n == 0
  if not grouped:  # fewer kv heads than devices: each query head takes its own copy
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    q = q.reshape(b, c, kvh * g, 1, d)
  to_heads = lambda x: jax.lax.all_to_all(x, AXIS, 2, 1, tiled=True)  # [b, c, H] -> [b, T, H/n]
  q, k, v = to_heads(q), to_heads(k), to_heads(v)
  mask, positive = _gather(mask), _gather(positive)
  t = q.shape[1]
  if causal:
    perm = permutation(t, n, layout)
    inv = np.argsort(perm)
    q, k, v, mask = (x[:, inv] for x in (q, k, v, mask))
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, lse, pos = _normalised(ops.attend(q, k, v, mask, q_pos, impl=impl, block=block))
    out, lse, pos = (x[:, :, :, perm] for x in (out, lse, pos))
  else:
    out, lse, pos = _normalised(ops.attend(q, k, v, mask, positive=positive, impl=impl, block=block))
  to_tokens = lambda x: jax.lax.all_to_all(x, AXIS, 3, 1, tiled=True)  # [b, H/n, g, T] -> [b, H, g, c]
  out, lse, pos = to_tokens(out), to_tokens(lse), to_tokens(pos)
  if not grouped:
    out = out.reshape(b, kvh, g, c, d)
    lse, pos = lse.reshape(b, kvh, g, c), pos.reshape(b, kvh, g, c)
  return out, lse, pos
