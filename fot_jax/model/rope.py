"""Rotary position embedding in the Hugging Face "rotate half" layout."""
import jax.numpy as jnp


def rope_angles(positions, head_dim: int, theta: float):
  """cos/sin of shape positions.shape + (head_dim,), HF layout (two halves repeated)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, positions, theta: float):
  """x: [B, T, H, D]; positions: [B, T] (or broadcastable)."""
  cos, sin = rope_angles(positions, x.shape[-1], theta)
  cos, sin = cos[..., None, :], sin[..., None, :]
  out = x.astype(jnp.float32) * cos + rotate_half(x.astype(jnp.float32)) * sin
  return out.astype(x.dtype)
