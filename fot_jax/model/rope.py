"""Rotary position embedding (Hugging Face "rotate half" layout) and its context-extension variants.

`ModelConfig.rope_scaling` holds the scaling as Hugging Face writes it in config.json
(`rope_type`, `factor`, ...; see `VARIANTS`). Every variant follows transformers'
`modeling_rope_utils` exactly (same defaults, same float32 arithmetic), so an imported
checkpoint gives transformers' logits:
* default: inv_freq_j = theta^(-2j/d).
* linear (position interpolation): inv_freq / factor.
* ntk (fot_jax only, "NTK-frozen"): a fixed NTK-aware base theta * factor^(d/(d-2)); it
  exports as a plain RoPE with that base, which is what it is.
* dynamic (dynamic NTK): the NTK base for the current length L = max(position)+1 of the
  forward call, L' = max(L, original): theta * (factor*L'/original - (factor-1))^(d/(d-2)).
* yarn: per-frequency ramp between interpolation (/factor) and the original frequency
  (beta_fast / beta_slow rotations in the original context), and cos/sin multiplied by the
  attention factor (0.1*ln(factor)+1 unless given, or the mscale/mscale_all_dim ratio).
* llama3: wavelengths above original/low_freq_factor divided by factor, below
  original/high_freq_factor kept, a linear blend in between.
"""
from __future__ import annotations

import math
from typing import Tuple

import jax.numpy as jnp

# rope_type -> (required keys, optional keys), the keys as config.json spells them.
VARIANTS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "ntk": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}


def scaling_tuple(scaling) -> Tuple[Tuple[str, object], ...]:
  """A rope_scaling dict (or pairs) -> sorted (key, value) pairs, the hashable form ModelConfig
  keeps; plain RoPE is (). HF's legacy key `type` becomes `rope_type`; `rope_theta` is not kept
  here (ModelConfig.rope_theta holds it)."""
  items = dict(scaling or ())
  if "type" in items:
    items.setdefault("rope_type", items.pop("type"))
  items.pop("rope_theta", None)
  if items.get("rope_type", "default") == "default" and set(items) <= {"rope_type"}:
    return ()
  return tuple(sorted((str(k), v) for k, v in items.items()))


def validate_scaling(scaling: Tuple[Tuple[str, object], ...], head_dim: int) -> None:
  """Raises ValueError naming the bad key of `scaling` (ModelConfig.rope_scaling)."""
  p = dict(scaling)
  kind = p.get("rope_type", "default")
  if kind not in VARIANTS:
    raise ValueError(f"rope_type {kind!r} is not supported; fot_jax knows {sorted(VARIANTS)}")
  required, optional = VARIANTS[kind]
  missing = [k for k in required if p.get(k) is None]
  if missing:
    raise ValueError(f"rope_type {kind!r} needs {missing}")
  unknown = sorted(set(p) - {"rope_type", *required, *optional})
  if unknown:
    raise ValueError(f"rope_type {kind!r} does not use {unknown} (it takes {list(required + optional)})")
  if not isinstance(p.get("truncate", True), bool):
    raise ValueError(f"truncate must be true or false, got {p['truncate']!r}")
  for key, value in p.items():
    if key in ("rope_type", "truncate"):
      continue
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise ValueError(f"{key} must be a number, got {value!r}")
  if p.get("factor", 1.0) < 1.0:
    raise ValueError(f"factor must be >= 1, got {p['factor']}")
  if p.get("original_max_position_embeddings", 1) <= 0:
    raise ValueError(f"original_max_position_embeddings must be positive, got "
                     f"{p['original_max_position_embeddings']}")
  if kind == "llama3" and p["high_freq_factor"] <= p["low_freq_factor"]:
    raise ValueError(f"high_freq_factor ({p['high_freq_factor']}) must exceed low_freq_factor "
                     f"({p['low_freq_factor']})")
  if kind in ("ntk", "dynamic") and head_dim <= 2:
    raise ValueError(f"NTK scaling needs a head dimension above 2, got {head_dim}")


def _base_inv_freq(theta, dim: int):
  return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _linear(p, theta, dim, seq_len):
  return _base_inv_freq(theta, dim) / p["factor"], 1.0


def _ntk(p, theta, dim, seq_len):
  return _base_inv_freq(theta * p["factor"] ** (dim / (dim - 2)), dim), 1.0


def _dynamic(p, theta, dim, seq_len):
  factor, orig = p["factor"], p["original_max_position_embeddings"]
  length = jnp.maximum(jnp.asarray(seq_len, jnp.int32), orig).astype(jnp.float32)
  base = theta * ((factor * length / orig) - (factor - 1)) ** (dim / (dim - 2))
  return _base_inv_freq(base, dim), 1.0


def yarn_attention_factor(p) -> float:
  """YaRN's cos/sin multiplier (the square root of 1/temperature), as transformers derives it."""
  if p.get("attention_factor") is not None:
    return float(p["attention_factor"])

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  factor, m, m_all = p["factor"], p.get("mscale"), p.get("mscale_all_dim")
  return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def _yarn(p, theta, dim, seq_len):
  factor, orig = p["factor"], p["original_max_position_embeddings"]
  beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

  def correction_dim(rotations):  # the pair index that turns `rotations` times in `orig` positions
    return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))
  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if p.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  keep = 1 - ramp  # weight of the original (extrapolated) frequency
  inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
  return inv_freq, yarn_attention_factor(p)


def _llama3(p, theta, dim, seq_len):
  inv_freq = _base_inv_freq(theta, dim)
  factor, orig = p["factor"], p["original_max_position_embeddings"]
  low, high = p["low_freq_factor"], p["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > orig / low, inv_freq / factor, inv_freq)
  smooth = (orig / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= orig / high) & (wavelen <= orig / low)
  return jnp.where(medium, blended, scaled), 1.0


INV_FREQ = {"default": lambda p, theta, dim, seq_len: (_base_inv_freq(theta, dim), 1.0),
            "linear": _linear, "ntk": _ntk, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}
assert set(INV_FREQ) == set(VARIANTS)


def inv_frequencies(cfg, seq_len=None):
  """(inv_freq float32 [head_dim/2], cos/sin multiplier) of `cfg` (ModelConfig); seq_len (the
  current length, may be traced) matters for 'dynamic' only."""
  p = dict(cfg.rope_scaling)
  return INV_FREQ[p.get("rope_type", "default")](p, cfg.rope_theta, cfg.dim_per_head, seq_len)


def rope_angles(positions, cfg, length=None):
  """cos/sin of shape positions.shape + (head_dim,), HF layout (two halves repeated), already
  multiplied by the variant's attention factor (YaRN). length: the current length for dynamic
  NTK; default max(positions) + 1, as transformers (the largest position of the call)."""
  inv_freq, scale = inv_frequencies(cfg, jnp.max(positions) + 1 if length is None else length)
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, positions, cfg, length=None):
  """x: [B, T, H, D]; positions: [B, T] (or broadcastable); cfg: ModelConfig (theta + scaling)."""
  cos, sin = rope_angles(positions, cfg, length)
  cos, sin = cos[..., None, :], sin[..., None, :]
  out = x.astype(jnp.float32) * cos + rotate_half(x.astype(jnp.float32)) * sin
  return out.astype(x.dtype)


def rope_at_position_zero(x, cfg):
  """x rotated as if at position 0: the identity, times the variant's attention factor (YaRN),
  exactly what `apply_rope` gives a key at position 0. Memory keys under mem_positions='first'."""
  scale = position_zero_scale(cfg)
  return x if scale == 1.0 else (x.astype(jnp.float32) * scale).astype(x.dtype)


def position_zero_scale(cfg) -> float:
  p = dict(cfg.rope_scaling)
  return yarn_attention_factor(p) if p.get("rope_type") == "yarn" else 1.0
