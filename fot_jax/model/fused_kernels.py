"""`attention_impl='fused'`: one fused causal-attention kernel per backend.

A kernel runs only for a causal window that nothing merges with: a layer with no extra
contexts (crossbatch plan or memory), no position strategy, no sequence parallelism and
no generation cache (`Attention.__call__` decides that). Everything else stays blockwise,
since the kernels return no log-sum-exp to merge under one softmax. Where no kernel
applies (CPU, float32 on GPU, an unsupported shape), `for_window` says so in one line,
once per process, and the layer runs blockwise.

Every call takes q [B, T, KV, G, D] already scaled (and rotated), k/v [B, T, KV, D] and
token_mask [B, T] -> [B, T, KV, G, D]. Real queries never see padding keys; a padding
query sees at least itself, so it stays finite; its output is don't-care, as in the
reference, and never reaches a real token.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

# Tests only: runs splash through the Pallas interpreter, which makes it selectable on CPU.
INTERPRET = False

_noticed = False


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  applies: Callable[[str, object, int, int], bool]  # (backend, dtype, head_dim, T)
  call: Callable  # (q, k, v, token_mask) -> [B, T, KV, G, D]


def _dot_product(q, k, v, token_mask, implementation):
  """`jax.nn.dot_product_attention` with GQA heads (KV * G, grouped as here) and scale 1."""
  b, t, kv, g, d = q.shape
  eye = jnp.eye(t, dtype=bool)[None, None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None] & (token_mask[:, None, None, :] | eye)
  out = jax.nn.dot_product_attention(q.reshape(b, t, kv * g, d), k, v, mask=mask, scale=1.0,
                                     implementation=implementation)
  return out.reshape(b, t, kv, g, d)


def _splash_block(t):
  return next(s for s in (512, 256, 128) if t % s == 0)


def _splash_local(q, k, v, token_mask):
  """Splash on one device's rows and heads: each query head h reads kv head h // G (GQA).
  Padding is a segment id (0 padding, 1 real): segments never see each other. No scale
  argument: splash computes q @ k^T as given, and q is already scaled."""
  b, t, kv, g, d = q.shape
  block = _splash_block(t)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                            block_kv_dq=block)
  # Built per trace: the kernel holds its block tables as arrays (tracers under jit), and
  # splash caches the mask processing itself.
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * (kv * g))
  kernel = splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=INTERPRET)
  qh = q.reshape(b, t, kv * g, d).transpose(0, 2, 1, 3)
  kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  seg = token_mask.astype(jnp.int32)
  out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(qh, kh, vh, seg)
  return out.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4)


def _mesh_axes(name):
  spec = nn.logical_to_mesh_axes((name,))
  return spec[0] if len(spec) else None


def _axis_size(mesh, axes):
  axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in axes)


def _splash(q, k, v, token_mask):
  """Splash per device under the abstract mesh (rows over the batch axes, kv heads over
  the heads' axes where they divide): to GSPMD a Pallas call is one opaque custom call."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return _splash_local(q, k, v, token_mask)
  batch, heads = _mesh_axes("batch"), _mesh_axes("act_heads")
  heads = heads if q.shape[2] % _axis_size(mesh, heads) == 0 else None
  spec = P(batch, None, heads)
  return jax.shard_map(_splash_local, mesh=mesh, in_specs=(spec, spec, spec, P(batch)), out_specs=spec,
                       check_vma=False)(q, k, v, token_mask)


def _cudnn_applies(backend, dtype, head_dim, t):
  # cuDNN's flash attention: half precision, head_dim a multiple of 8 up to 128 (256 needs
  # Hopper, not checked here).
  return (backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim % 8 == 0 and head_dim <= 128)


def _splash_applies(backend, dtype, head_dim, t):
  # Blocks are multiples of 128 (the TPU's lanes) and must tile the window; any head_dim.
  return ((backend == "tpu" or (INTERPRET and backend == "cpu"))
          and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32) and t % 128 == 0)


KERNELS = {
    "cudnn": Kernel("cudnn", _cudnn_applies, lambda q, k, v, m: _dot_product(q, k, v, m, "cudnn")),
    "splash": Kernel("splash", _splash_applies, _splash),
    # The cuDNN call's layout through XLA: never selected, the tests' reference for it.
    "xla": Kernel("xla", lambda *_: False, lambda q, k, v, m: _dot_product(q, k, v, m, "xla")),
}


def select(backend: str, dtype, head_dim: int, t: int) -> Optional[Kernel]:
  """The kernel this backend has for a causal window of t tokens, or None (blockwise)."""
  return next((kern for kern in KERNELS.values() if kern.applies(backend, dtype, head_dim, t)), None)


def describe(cfg, t: int, backend: Optional[str] = None) -> str:
  """One line: what `attention_impl='fused'` runs for a window of t tokens under cfg."""
  backend = backend or jax.default_backend()
  dtype, d = jnp.dtype(cfg.dtype).name, cfg.dim_per_head
  kern = select(backend, dtype, d, t)
  what = f"{kern.name} on {backend} for {dtype}" if kern else f"no fused kernel on {backend} for {dtype}"
  return f"model.attention_impl='fused': {what} (head_dim {d}, window {t})" + ("" if kern else "; using blockwise")


def for_window(cfg, t: int) -> Optional[Kernel]:
  """The kernel for a causal window of t tokens that nothing merges with; when there is
  none (blockwise), the first time in this process says so."""
  global _noticed
  kern = select(jax.default_backend(), cfg.dtype, cfg.dim_per_head, t)
  if kern is None and not _noticed:
    _noticed = True
    logging.getLogger(__name__).warning(describe(cfg, t))
  return kern
