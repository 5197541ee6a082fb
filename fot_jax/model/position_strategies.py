"""Training-free position/mask strategies for the causal local attention: Self-Extend, LM-Infinite.

`ModelConfig.position_strategy` selects one (a dict, kept as sorted pairs like rope_scaling;
() = plain attention). Both replace the local window's scores only; memory and crossbatch
contexts, values and the softmax are untouched, and memory layers with mem_positions='none'
(no RoPE) ignore them. Distances d = position(query) - position(key):

* self_extend (Jin et al. 2024), keys `window` (W, neighbour window) and `group` (G):
  d < W keeps the true RoPE positions; farther keys use floor-divided positions, the query at
  i // G + W - W // G and the key at j // G, so the distance grows G times slower.
* lm_infinite (Han et al. 2023), keys `global_tokens` (G), `local_window` (M) and
  `max_distance` (L, the pretraining length): a key is visible if j < G (attention sinks) or
  d < M (the M most recent tokens, itself included), and its RoPE distance is min(d, L).

Each strategy is a list of (query positions, key positions) rotations plus, per
(query, key), which rotation scores it and whether it is visible; any RoPE variant
(rope.py) rotates them, with the dynamic-NTK length of the true positions. With
attention_impl 'dense' the window's [T, T] scores are materialised (and kept for the backward
pass); otherwise they are streamed block by block in both passes (attention_rotated.attend_rotated,
with a custom VJP): long windows forward and fine-tune in bounded memory
(docs/context_extension.md, "Fine-tuning memory with a position strategy").
"""
from __future__ import annotations

import jax.numpy as jnp

from fot_jax.model.rope import apply_rope

STRATEGIES = {
    "self_extend": ("window", "group"),
    "lm_infinite": ("global_tokens", "local_window", "max_distance"),
}


def strategy_tuple(spec):
  """A strategy dict (or pairs) -> sorted (key, value) pairs; None, {} or kind 'none' -> ()."""
  items = dict(spec or ())
  if items.get("kind", "none") == "none" and set(items) <= {"kind"}:
    return ()
  return tuple(sorted((str(k), v) for k, v in items.items()))


def validate_strategy(pairs) -> None:
  """Raises ValueError naming the bad key of ModelConfig.position_strategy."""
  p = dict(pairs)
  kind = p.get("kind")
  if kind not in STRATEGIES:
    raise ValueError(f"kind must be one of {sorted(STRATEGIES)}, got {kind!r}")
  want = STRATEGIES[kind]
  if set(p) - {"kind"} != set(want):
    raise ValueError(f"{kind} takes exactly {list(want)}, got {sorted(set(p) - {'kind'})}")
  for key in want:
    if isinstance(p[key], bool) or not isinstance(p[key], int) or p[key] < (0 if key == "global_tokens" else 1):
      raise ValueError(f"{key} must be a {'non-negative' if key == 'global_tokens' else 'positive'} "
                       f"integer, got {p[key]!r}")


def rotations(pairs, q_pos, k_pos):
  """q_pos [B, T], k_pos [B, S] int -> the strategy's rotations [(query positions, key positions)]."""
  p = dict(pairs)
  if p["kind"] == "self_extend":
    w, g = p["window"], p["group"]
    return [(q_pos, k_pos), (q_pos // g + w - w // g, k_pos // g)]
  return [(q_pos, k_pos), (jnp.full_like(q_pos, p["max_distance"]), jnp.zeros_like(k_pos))]  # distance L


def choice_visible(pairs, q_pos, k_pos):
  """-> (choice int [B, T, S]: index of the rotation that scores each pair, visible bool [B, T, S])."""
  p = dict(pairs)
  dist = q_pos[:, :, None] - k_pos[:, None, :]
  if p["kind"] == "self_extend":
    return (dist >= p["window"]).astype(jnp.int32), jnp.ones(dist.shape, bool)
  visible = (k_pos < p["global_tokens"])[:, None, :] | (dist < p["local_window"])
  return (dist > p["max_distance"]).astype(jnp.int32), visible


def _rotated(cfg, q, k, positions, scale):
  """q [B, T, H, D], k [B, T, KV, D] before RoPE -> per rotation, q scaled [B, T, KV, G, D] and k."""
  b, t, h, d = q.shape
  kv = k.shape[2]
  length = jnp.max(positions) + 1  # one dynamic-NTK length for all rotations: the true one
  return [((apply_rope(q, qp, cfg, length) * scale).reshape(b, t, kv, h // kv, d), apply_rope(k, kp, cfg, length))
          for qp, kp in rotations(cfg.position_strategy, positions, positions)]


def local_scores(cfg, q, k, positions, scale):
  """q [B, T, H, D], k [B, T, KV, D] before RoPE -> (scaled scores [B, KV, G, T, T] float32,
  visible [B, 1, 1, T, T]) under cfg.position_strategy (the caller adds causality and padding)."""
  choice, visible = choice_visible(cfg.position_strategy, positions, positions)
  s = None
  for i, (qr, kr) in enumerate(_rotated(cfg, q, k, positions, scale)):
    si = jnp.einsum("btkgd,bskd->bkgts", qr.astype(jnp.float32), kr.astype(jnp.float32))
    s = si if s is None else jnp.where((choice == i)[:, None, None], si, s)
  return s, visible[:, None, None]


def streamed_inputs(cfg, q, k, positions, scale):
  """The same attention for attention_rotated.attend_rotated, which streams it block by block:
  -> (queries [R, B, T, KV, G, D] scaled, keys [R, B, T, KV, D] per rotation, choose(q_pos, k_pos))."""
  rot = _rotated(cfg, q, k, positions, scale)
  choose = lambda qp, kp: choice_visible(cfg.position_strategy, qp, kp)
  return jnp.stack([r[0] for r in rot]), jnp.stack([r[1] for r in rot]), choose
