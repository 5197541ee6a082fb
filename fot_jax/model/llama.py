"""LLaMA decoder in Flax linen with FoT memory layers."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fot_jax.model.attention import Attention, dense
from fot_jax.model.config import ModelConfig
from fot_jax.model.memory import READ_CHUNK, MemoryBlock


class RMSNorm(nn.Module):
  eps: float = 1e-6
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    w = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                   (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
    return (y * w).astype(jnp.dtype(self.dtype))


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    gate = dense(cfg.intermediate_size, ("embed", "mlp"), "gate_proj", dtype, cfg.init_std)(x)
    up = dense(cfg.intermediate_size, ("embed", "mlp"), "up_proj", dtype, cfg.init_std)(x)
    h = nn.with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    return dense(cfg.hidden_size, ("mlp", "embed"), "down_proj", dtype, cfg.init_std)(h)


class DecoderLayer(nn.Module):
  cfg: ModelConfig
  is_memory: bool = False

  @nn.compact
  def __call__(self, x, positions, token_mask, plan=None, memory=None, mem_mode="dense",
               mem_topk=32, mem_chunk=READ_CHUNK, want_mem_kv=False, cache=None, want_cache=False,
               mem_recall=0.95, plan_widths=None, prev=None):
    cfg = self.cfg
    if plan is not None and plan_widths is not None:  # static: a separate argument so remat keeps it concrete
      plan = tuple(plan) + (plan_widths,)
    h, aux = Attention(cfg, self.is_memory, name="self_attn")(
        RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="input_layernorm")(x), positions, token_mask,
        plan, memory, mem_mode, mem_topk, mem_chunk, want_mem_kv, cache, want_cache, mem_recall, prev)
    x = x + h
    x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="post_attention_layernorm")(x))
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    return x, aux


class LlamaModel(nn.Module):
  """tokens [B, T] -> logits [B, T, V] (float32) and aux metrics.

  plan: (sources [B, N] int32, positive [B, N] bool) crossbatch plan, or None.
  memories: {layer: [MemoryBlock, ...]} for memory inference, or None; mem_mode 'dense',
  'topk' or 'approx_topk' (with mem_recall, its recall target).
  stop_after: run only layers 0..stop_after (used to fill memory cheaply); no logits.
  start_at, hidden: run layers start_at.. on `hidden` [B, T, hidden_size] (the residual stream
  before layer start_at) instead of embedding `tokens` (which then only give the shape); with
  want_hidden, aux['hidden'] is the residual stream after the last layer run (before the final
  norm). Host-side retrieval (fot_jax/host_memory.py) runs the stack piecewise this way, one
  memory layer at a time.
  want_cache: aux['cache'] = {layer: (keys, values, memory keys or None)} of this window.
  cache, cache_fill [B]: generation; the tokens go to slots cache_fill.. of each layer's
  cache (positions = slots) and aux['cache'] holds the updated caches.
  prev: Transformer-XL (fot_jax/recurrent.py): {layer: (keys before RoPE, values, mask)} of the
  previous window, attended before this one in every layer; aux['prev_kv'] = {layer: (keys
  before RoPE, values)} of this window.

  cfg.scan_layers: without cache/want_cache and with the intermediates collection immutable,
  each run of >= 2 consecutive non-memory layers is one lax.scan over their weights, stacked
  at apply time (in the compute dtype when that is half precision); memory layers stay
  unrolled. Anything else (init, generation, sow/capture_intermediates) runs unrolled, so the
  parameter tree and the intermediates are the same either way. docs/scan_and_remat.md.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions=None, token_mask=None, plan=None,
               memories: Optional[Dict[int, Sequence[MemoryBlock]]] = None,
               mem_mode: str = "dense", mem_topk: int = 32, mem_chunk: int = READ_CHUNK,
               want_mem_kv: bool = False, stop_after: Optional[int] = None,
               cache: Optional[Dict[int, tuple]] = None, cache_fill=None, want_cache: bool = False,
               mem_recall: float = 0.95, prev: Optional[Dict[int, tuple]] = None, start_at: int = 0,
               hidden=None, want_hidden: bool = False):
    cfg = self.cfg
    b, t = tokens.shape
    if cache is not None and positions is None:
      positions = cache_fill[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if token_mask is None:
      token_mask = jnp.ones((b, t), bool)
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="embed_tokens", param_dtype=jnp.float32,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(cfg.embed_init_std or cfg.init_std), ("vocab", "embed")))
    if start_at:
      if hidden is None:
        raise ValueError("LlamaModel: start_at needs the residual stream before that layer (hidden)")
      x = hidden.astype(jnp.dtype(cfg.dtype))
    else:
      x = embed(tokens).astype(jnp.dtype(cfg.dtype))
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    policy = _CHECKPOINT_POLICIES[cfg.remat_policy]
    layer_cls = DecoderLayer
    if cfg.remat:
      layer_cls = nn.remat(DecoderLayer, static_argnums=(6, 7, 8, 9, 11, 12, 13), policy=policy)
    widths = None
    if plan is not None and len(plan) > 2:  # the plan's static widths (crossbatch.pack_widths)
      plan, widths = tuple(plan[:2]), tuple(int(w) for w in plan[2])
    rd_num = jnp.zeros((), jnp.float32)
    rd_den = jnp.zeros((), jnp.float32)
    mem_kv, caches, prev_kv = {}, {}, {}
    last = cfg.num_layers - 1 if stop_after is None else stop_after
    scan = (cfg.scan_layers and not self.is_initializing() and cache is None and not want_cache
            and prev is None and not self.is_mutable_collection("intermediates"))
    for run in _segments(cfg, last + 1, scan, start_at):
      if len(run) > 1:
        x = self._scan_run(run, x, positions, token_mask, policy)
        continue
      i = run[0]
      is_mem = i in cfg.mem_layers
      layer_memory = (memories or {}).get(i) if is_mem else None
      x, aux = layer_cls(cfg, is_mem, name=f"layers_{i}")(
          x, positions, token_mask, plan if is_mem else None, layer_memory, mem_mode, mem_topk,
          mem_chunk, want_mem_kv, None if cache is None else cache[i] + (cache_fill,), want_cache,
          mem_recall, widths if is_mem else None, None if prev is None else prev[i])
      if "rd_num" in aux:
        rd_num, rd_den = rd_num + aux["rd_num"], rd_den + aux["rd_den"]
      if "mem_kv" in aux:
        mem_kv[i] = aux["mem_kv"]
      if "cache" in aux:
        caches[i] = aux["cache"]
      if "prev_kv" in aux:
        prev_kv[i] = aux["prev_kv"]
    out_aux = {"rd_num": rd_num, "rd_den": rd_den}
    if prev_kv:
      out_aux["prev_kv"] = prev_kv
    if want_mem_kv:
      out_aux["mem_kv"] = mem_kv
    if caches:
      out_aux["cache"] = caches
    if want_hidden:
      out_aux["hidden"] = x
    if stop_after is not None:
      return None, out_aux
    x = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="norm")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x.astype(jnp.float32))
    else:
      logits = dense(cfg.vocab_size, ("embed", "vocab"), "lm_head", jnp.float32, cfg.init_std)(x.astype(jnp.float32))
    return logits.astype(jnp.float32), out_aux

  def _scan_run(self, run, x, positions, token_mask, policy):
    """Layers `run` (non-memory, consecutive) as one lax.scan over their stacked parameters;
    gradients reach each layers_i through the stack."""
    cfg = self.cfg
    # Half-precision kernels here, so a gather inside the loop moves half the bytes.
    weights = [weights_in_compute_dtype(nn.meta.unbox(self.variables["params"][f"layers_{i}"]), cfg.dtype)
               for i in run]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *weights)
    layer = DecoderLayer(cfg, False, parent=None)  # unbound: applied functionally, not a child

    def body(h, p):
      return layer.apply({"params": p}, h, positions, token_mask)[0], None

    if cfg.remat:  # inside scan the recompute cannot be CSE'd away: prevent_cse is not needed
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, stacked)[0]


# cfg.remat_policy -> what jax.checkpoint saves (None: the layer's inputs only).
_CHECKPOINT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _segments(cfg: ModelConfig, n: int, scan: bool, start: int = 0):
  """Layers start..n-1 in execution order: [i] for an unrolled layer, [i, i+1, ...] for a scanned
  run of consecutive non-memory layers (scan only)."""
  out = []
  for i in range(start, n):
    if scan and i not in cfg.mem_layers and out and out[-1][-1] not in cfg.mem_layers:
      out[-1].append(i)
    else:
      out.append([i])
  return out


def weights_in_compute_dtype(params, dtype, shardings=None):
  """The decoder's weight matrices (Dense kernels, not the embedding or lm_head) cast to the
  compute `dtype`, each pinned to its parameter's sharding, so the cast happens on the shard
  and what FSDP all-gathers is half precision (half the bytes moved and held). The layers
  cast their kernels to this dtype anyway (flax Dense with dtype=...), so values are the same;
  parameters and optimizer state stay float32 and their gradients come back float32.
  float32 compute: params unchanged. The train step casts the whole tree (pinned to the
  parameter shardings); a scanned run casts its layers' weights when stacking them."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return params

  def cast(path, p, sh=None):
    names = [getattr(k, "key", str(k)) for k in path]
    if names[-1] != "kernel" or "lm_head" in names:
      return p
    p = p.astype(dtype)
    return p if sh is None else jax.lax.with_sharding_constraint(p, sh)

  if shardings is None:
    return jax.tree_util.tree_map_with_path(cast, params)
  return jax.tree_util.tree_map_with_path(cast, params, shardings)
