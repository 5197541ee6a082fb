"""Self-attention for ordinary LLaMA layers and FoT memory layers."""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.model import attention_ops as ops
from fot_jax.model.attention_rotated import attend_rotated
from fot_jax.model import context_parallel as cp
from fot_jax.model import fused_kernels
from fot_jax.model import memory as mem
from fot_jax.model import position_strategies
from fot_jax.model.config import ModelConfig
from fot_jax.model.rope import apply_rope, rope_at_position_zero


def dense(features, axes, name, dtype, init_std=0.02):
  return nn.Dense(features, use_bias=False, name=name, dtype=dtype, param_dtype=jnp.float32,
                  kernel_init=nn.with_logical_partitioning(nn.initializers.normal(init_std), axes))


def _normalize(x, eps=1e-6):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class Attention(nn.Module):
  """Grouped-query causal attention; a memory layer also attends to extra contexts.

  Extra contexts come either from a crossbatch plan (training: other rows of this
  batch, with gradients) or from memory blocks (inference). Both join the causal
  local window under one softmax (or an MT-style gate when `mem_gating`).
  """
  cfg: ModelConfig
  is_memory: bool = False

  @nn.compact
  def __call__(self, x, positions, token_mask, plan=None, memory: Optional[Sequence[mem.MemoryBlock]] = None,
               mem_mode: str = "dense", mem_topk: int = 32, mem_chunk: int = mem.READ_CHUNK,
               want_mem_kv: bool = False, cache=None, want_cache: bool = False, mem_recall: float = 0.95,
               prev=None):
    """cache: generation (k [B, W, KV, D], v, memory keys or None, fill [B]): the t new tokens
    go to slots fill..fill+t-1 and attend to the cache; aux['cache'] returns it updated.
    want_cache: aux['cache'] = this window's (keys, values, memory keys or None).
    prev: Transformer-XL (fot_jax/recurrent.py): the previous window's (keys before RoPE
    [B, P, KV, D], values, mask [B, P]), attended as the P tokens just before this window
    (positions - P), causally with it; aux['prev_kv'] = this window's (keys before RoPE, values)."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    b, t, _ = x.shape
    h, kv, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
    g = h // kv
    q = dense(h * d, ("embed", "heads"), "q_proj", dtype, cfg.init_std)(x).reshape(b, t, h, d)
    k = dense(kv * d, ("embed", "kv_heads"), "k_proj", dtype, cfg.init_std)(x).reshape(b, t, kv, d)
    v = dense(kv * d, ("embed", "kv_heads"), "v_proj", dtype, cfg.init_std)(x).reshape(b, t, kv, d)
    q = nn.with_logical_constraint(q, ("batch", "length", "act_heads", "head_dim"))

    memory_layer = self.is_memory
    scale = d ** -0.5
    if memory_layer and cfg.mem_qk_norm:
      q, k = _normalize(q), _normalize(k)
      inv_temp = self.param("inv_temperature",
                            nn.with_logical_partitioning(nn.initializers.constant(d ** 0.5), ("heads",)),
                            (h,), jnp.float32)
      q = q * inv_temp[:, None].astype(q.dtype)
      scale = 1.0
    if memory_layer and cfg.mem_gating:  # created at init too, where no extra context comes
      gate_logit = self.param("mem_gate", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)),
                              (h,), jnp.float32)
    # Memory keys: 'first' rotates them as if at position 0, which is the identity (times
    # YaRN's attention factor, as for a local key at 0); 'none' uses no rotation at all.
    k_mem, q_pre, k_pre = k, q, k  # before RoPE: a position strategy rotates them itself
    if not (memory_layer and cfg.mem_positions == "none"):
      k_mem = rope_at_position_zero(k, cfg)
      q = apply_rope(q, positions, cfg)
      k = apply_rope(k, positions, cfg)
    q = (q * scale).reshape(b, t, kv, g, d)
    if memory_layer:  # read by host-side retrieval (fot_jax.eval.approx); a no-op unless collected
      self.sow("intermediates", "mem_queries", q)

    impl, block = cfg.attention_impl, cfg.attention_block
    strategy = cfg.position_strategy and not (memory_layer and cfg.mem_positions == "none")
    if strategy and (cache is not None or prev is not None):
      raise ValueError(f"model.position_strategy {dict(cfg.position_strategy)}: not supported with cached "
                       f"generation or a Transformer-XL segment; score the prompt with process() / "
                       f"logits_with_memory()")
    seq_par = cp.active() and cache is None  # the window is split over the mesh's context axis
    if seq_par and (strategy or prev is not None):
      raise ValueError(f"model.position_strategy {dict(cfg.position_strategy)} / a Transformer-XL segment: "
                       f"not supported with mesh.context > 1")
    aux = {}
    if cache is not None:
      keys, values, mem_keys, fill = cache
      fill = fill.astype(jnp.int32)
      put = jax.vmap(lambda buf, new, at: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), at, 0))
      keys, values = put(keys, k, fill), put(values, v, fill)
      if memory_layer:
        mem_keys = put(mem_keys, k_mem, fill)
      key_mask = jnp.arange(keys.shape[1])[None, :] < (fill + t)[:, None]
      q_pos = fill[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
      aux["cache"] = (keys, values, mem_keys)
    elif prev is not None:  # Transformer-XL: the previous window, then this one
      prev_k, prev_v, prev_mask = prev
      p = prev_k.shape[1]
      if not (memory_layer and cfg.mem_positions == "none"):
        prev_k = apply_rope(prev_k, positions[:, :1] - p + jnp.arange(p, dtype=jnp.int32)[None, :], cfg)
      keys = jnp.concatenate([prev_k.astype(k.dtype), k], axis=1)
      values = jnp.concatenate([prev_v.astype(v.dtype), v], axis=1)
      key_mask = jnp.concatenate([prev_mask, token_mask], axis=1)
      q_pos = jnp.broadcast_to(p + jnp.arange(t, dtype=jnp.int32), (b, t))
      aux["prev_kv"] = (k_pre, v)
    else:
      keys, values, key_mask = k, v, token_mask
      q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      if want_cache:
        aux["cache"] = (k, v, k_mem if memory_layer else None)

    extra = None
    if memory_layer and plan is not None and plan[0].shape[-1] > 0:
      extra, rd = self._crossbatch(q, k_mem, v, token_mask, plan)
      aux.update(rd)
    if memory_layer and memory:  # with a plan too: training beside a forward-only memory (train.memory)
      crossbatch_part = extra
      if mem_mode == "dense":
        extra = ops.attend_memory(q, memory, min(mem_chunk, block))
      elif mem_mode == "topk":
        extra = mem.topk_memory_partial(q, memory, mem_topk, mem_chunk)
      elif mem_mode == "approx_topk":
        extra = mem.topk_memory_partial(q, memory, mem_topk, mem_chunk, recall=mem_recall)
      elif mem_mode == "blocks":  # mem_topk: a memory.BlockSpec (or block_topk)
        extra = mem.block_memory_partial(q, memory, mem.block_spec(mem_topk), token_mask)
      elif mem_mode == "gathered":  # each query's entries, retrieved on the host (fot_jax/host_memory.py)
        extra = mem.gathered_memory_partial(q, memory[0])
      else:
        raise ValueError(f"memory mode must be one of {mem.MEMORY_MODES}, got {mem_mode!r}")
      if crossbatch_part is not None:  # one softmax over the window, the crossbatch contexts and memory
        extra = mem.merge(crossbatch_part, extra)  # r_d stays the crossbatch contexts' own
      elif extra.pos is not None:  # memory marked with positives: r_d (multi-document evaluation)
        aux.update(_rd_aux(extra, token_mask[:, None, None, :] & (extra.l > 0)))

    # Nothing to merge with: the backend's fused kernel where it has one (fused_kernels).
    alone = extra is None and cache is None and prev is None and not (strategy or seq_par)
    kernel = fused_kernels.for_window(cfg, t) if impl == "fused" and alone else None
    if kernel is not None:
      out = kernel.call(q, k, v, token_mask)
    else:
      if strategy and impl != "dense":  # Self-Extend / LM-Infinite, streamed
        qs, ks, choose = position_strategies.streamed_inputs(cfg, q_pre, k_pre, positions, scale)
        local = attend_rotated(qs, ks, v, token_mask, q_pos, positions, choose, block)
      elif strategy:  # Self-Extend / LM-Infinite: their own positions and visibility over the window
        local_scores, visible = position_strategies.local_scores(cfg, q_pre, k_pre, positions, scale)
        causal = jnp.tril(jnp.ones((t, t), bool))
        local = mem.block_partial(local_scores, causal[None, None, None] & token_mask[:, None, None, None, :]
                                  & visible, v)
      else:
        local = self._sequence_parallel(q, keys, values, key_mask, causal=True) if seq_par else \
            ops.attend(q, keys, values, key_mask, q_pos, impl=impl, block=block)
      if extra is None:
        out = mem.finish(local)
      elif cfg.mem_gating:
        gate = jax.nn.sigmoid(gate_logit).reshape(1, 1, kv, g, 1)
        has_extra = (extra.l > 0).transpose(0, 3, 1, 2)[..., None]  # rows with no extra: local only
        gate = jnp.where(has_extra, gate, 0.0)
        out = gate * mem.finish(extra) + (1 - gate) * mem.finish(local)
      else:
        out = mem.finish(mem.merge(local, extra))
    out = out.reshape(b, t, h * d).astype(dtype)
    out = dense(cfg.hidden_size, ("heads", "embed"), "o_proj", dtype, cfg.init_std)(out)
    if want_mem_kv and memory_layer:
      aux["mem_kv"] = (k_mem, v)
    return out, aux

  def _crossbatch(self, q, k_mem, v, token_mask, plan):
    """Extra contexts from other rows.

    plan: sources [B, N] (row indices, -1 = none) and positive [B, N]; or grouped
    [G, B/G, N] with indices local to each group of B/G consecutive rows. Groups keep
    the gather inside a group, so with the batch split over G devices a row's
    contexts never leave its device (crossbatch_scope='device').

    An optional third entry, widths (static: crossbatch.pack_widths), gives per pack
    position j (row % k) how many leading columns hold its live sources: the rows of
    each width attend to that many contexts only, instead of every row to all N.
    """
    sources, positive = plan[:2]
    widths = plan[2] if len(plan) > 2 else None
    b, t, kv, d = k_mem.shape
    if sources.ndim == 2:
      sources, positive = sources[None], positive[None]
    groups, rows, n = sources.shape
    axis = 0 if groups > 1 else 1  # the row axis that follows the batch

    # Sharding: the row axis (groups, or rows when there is one group) follows the
    # batch, the token axis the window's (split over `context` when that is > 1); without
    # these constraints GSPMD replicates the gathered contexts.
    def rows_axis(ndim, axis, length=None):
      return tuple("batch" if i == axis else "length" if i == length else None for i in range(ndim))

    def grouped(x):  # [B, T, ...] -> [G, B/G, T, ...]
      x = x.reshape((groups, rows) + x.shape[1:])
      return nn.with_logical_constraint(x, rows_axis(x.ndim, axis, 2))

    kg, vg, mg = grouped(k_mem), grouped(v), grouped(token_mask)

    def extra(qs, src, pos):
      """qs [G, R, T, KV, G', D] attend to sources src/pos [G, R, w] -> Partial over [G*R], has [G*R]."""
      r, w = src.shape[1:]
      live = src >= 0
      idx = jnp.where(live, src, 0)

      def gather(x):  # [G, B/G, T, ...] -> [G, R, w, T, ...], rows taken within their group
        out = jax.vmap(lambda xg, sg: xg[sg])(x, idx)
        return nn.with_logical_constraint(out, rows_axis(out.ndim, axis, 3))

      rw = groups * r
      emask = (live[..., None] & gather(mg)).reshape(rw, w, t)
      has = jnp.any(emask, axis=(1, 2))
      keys, values = kg, vg
      if self.cfg.mem_stop_gradient:
        keys, values = jax.lax.stop_gradient(kg), jax.lax.stop_gradient(vg)
      if self.cfg.attention_impl != "dense" and not cp.active():
        # Sources read by index inside the blockwise scan: no per-row copy of them.
        read = functools.partial(ops.attend_sources, block=self.cfg.attention_block)
        args = (qs, keys, values, mg, jnp.asarray(src), jnp.asarray(pos))
        if groups == 1:  # vmap over a group axis of 1 measured twice as slow on CPU
          return read(*(x[0] for x in args)), has
        part = jax.vmap(read)(*args)  # device-scope groups
        return mem.Partial(*(None if f is None else f.reshape((rw,) + f.shape[2:]) for f in part)), has
      ek, ev = (nn.with_logical_constraint(gather(x).reshape(rw, w, t, kv, d), rows_axis(5, 0, 2))
                for x in (keys, values))
      epos = jnp.broadcast_to(pos[..., None], (groups, r, w, t)).reshape(rw, w, t)
      qs = qs.reshape((rw,) + qs.shape[2:])
      if cp.active():  # each extra context stays split over `context` like the window
        part = self._sequence_parallel(qs, ek, ev, emask, causal=False, positive=epos)
      else:
        ek, ev = (nn.with_logical_constraint(x.reshape(rw, w * t, kv, d), rows_axis(4, 0)) for x in (ek, ev))
        part = ops.attend(qs, ek, ev, emask.reshape(rw, w * t), positive=epos.reshape(rw, w * t),
                          impl=self.cfg.attention_impl, block=self.cfg.attention_block)
      return part, has

    if widths is None:
      part, has = extra(grouped(q), sources, positive)
    else:
      part, has = self._by_width(extra, grouped(q), sources, positive, tuple(int(x) for x in widths))
    qmask = token_mask[:, None, None, :] & has[:, None, None, None]
    return part, _rd_aux(part, qmask)

  @staticmethod
  def _by_width(extra, qg, sources, positive, widths):
    """Rows grouped by the static width of their pack position: each width's rows attend to
    that many plan columns (none for width 0), then the results go back to row order."""
    groups, rows, n = sources.shape
    k = len(widths)
    if rows % k:
      raise ValueError(f"crossbatch plan: {rows} rows per group are not whole packs of {k} (widths {widths})")
    if max(widths) > n:
      raise ValueError(f"crossbatch plan: widths {widths} exceed the plan's {n} columns")
    packs = rows // k

    def at(x, js):  # [G, B/G, ...] -> [G, packs * len(js), ...]: the rows at pack positions js
      x = x.reshape((groups, packs, k) + x.shape[2:])
      x = x[:, :, js[0]:js[-1] + 1] if js == list(range(js[0], js[-1] + 1)) else x[:, :, np.asarray(js)]
      return x.reshape((groups, packs * len(js)) + x.shape[3:])

    pieces = {}  # pack position -> (Partial fields, has), each [G * packs, ...]
    for w in sorted(set(widths)):
      js = [j for j in range(k) if widths[j] == w]
      if w == 0:
        _, _, t, kv, g, d = qg.shape
        shape = (groups * packs, len(js), kv, g, t)
        fields = (jnp.full(shape, mem.NEG, jnp.float32), jnp.zeros(shape, jnp.float32),
                  jnp.zeros(shape + (d,), jnp.float32), jnp.zeros(shape, jnp.float32))
        has = jnp.zeros((groups * packs, len(js)), bool)
      else:
        part, has = extra(at(qg, js), at(sources, js)[..., :w], at(positive, js)[..., :w])
        fields = tuple(f.reshape((groups * packs, len(js)) + f.shape[1:]) for f in part)
        has = has.reshape(groups * packs, len(js))
      for i, j in enumerate(js):
        pieces[j] = (tuple(f[:, i] for f in fields), has[:, i])

    def assemble(parts):  # k arrays [G * packs, ...] -> [B, ...] in row order
      x = jnp.stack(parts, axis=1)
      return x.reshape((-1,) + x.shape[2:])

    fields = [assemble([pieces[j][0][f] for j in range(k)]) for f in range(4)]
    return mem.Partial(*fields), assemble([pieces[j][1] for j in range(k)])

  def _sequence_parallel(self, q, k, v, key_mask, causal, positive=None):
    cfg = self.cfg
    return cp.attend(q, k, v, key_mask, causal=causal, positive=positive, strategy=cfg.context_parallel,
                     layout=cfg.context_layout, impl=cfg.attention_impl, block=cfg.attention_block)


def _rd_aux(part: mem.Partial, qmask):
  """r_d per query/head: positive mass over all extra mass, summed over the valid queries
  (qmask [B, 1 or KV, 1 or G, T]) of rows that have any extra context, averaged over heads."""
  ratio = part.pos / jnp.maximum(part.l, 1e-30)  # [B, KV, G, T]
  qmask = jnp.broadcast_to(qmask, ratio.shape)
  ratio = jnp.where(qmask, ratio, 0.0)
  heads = ratio.shape[1] * ratio.shape[2]
  return {"rd_num": jnp.sum(ratio) / heads, "rd_den": jnp.sum(qmask[:, 0, 0, :]).astype(jnp.float32)}
