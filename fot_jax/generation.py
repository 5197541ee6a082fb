"""Token generation for `MemoryInference.generate` (docs/attention.md, "KV-cached generation"):
the jitted prefill of a window into a key/value cache, the cache's fitting and row selection,
sampling (greedy, temperature, top_p) and the on-device decode loop (one query per new token
against cache + memory). Memory itself and the window-by-window driver are in inference.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fot_jax.model.llama import LlamaModel


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "topk", "chunk", "recall"), donate_argnums=(2,))
def decode_step(params, tokens, cache, fill, memories, cfg, mode, topk, chunk, recall):
  """New tokens [B, t] at cache slots fill.. -> (logits [B, t, V], updated cache)."""
  logits, aux = LlamaModel(cfg).apply({"params": params}, tokens, memories=memories, mem_mode=mode,
                                      mem_topk=topk, mem_chunk=chunk, cache=cache, cache_fill=fill,
                                      mem_recall=recall)
  return logits, aux["cache"]


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "topk", "chunk", "recall"))
def prefill_window(params, tokens, token_mask, memories, at, cfg, mode, topk, chunk, recall):
  """-> (logits [B, V] at column at[b] of each row, memory keys/values, cache of the window)."""
  logits, aux = LlamaModel(cfg).apply({"params": params}, tokens, token_mask=token_mask, memories=memories,
                                      mem_mode=mode, mem_topk=topk, mem_chunk=chunk, want_mem_kv=True,
                                      want_cache=True, mem_recall=recall)
  return logits[jnp.arange(tokens.shape[0]), at], aux["mem_kv"], aux["cache"]


@functools.partial(jax.jit, static_argnums=(1,))
def fit_slots(cache, slots):
  """Cache [B, S, ...] -> [B, slots, ...]: padded, or cut past every row's fill."""
  fit = lambda x: jnp.pad(x[:, :slots], [(0, 0), (0, max(0, slots - x.shape[1]))] + [(0, 0)] * (x.ndim - 2))
  return jax.tree_util.tree_map(fit, cache)


@jax.jit
def select_rows(rows, new, old):
  return jax.tree_util.tree_map(lambda n, o: jnp.where(rows.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
                                new, old)


def pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _sample(logits, key, temperature, top_p, greedy: bool, nucleus: bool):
  """Traced temperature / top_p (no recompile per value); greedy / nucleus pick the code."""
  if greedy:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if not nucleus:
    return jax.random.categorical(key, logits).astype(jnp.int32)
  order = jnp.argsort(-logits, axis=-1)  # stable: ties keep index order, as argmax
  ranked = jnp.take_along_axis(logits, order, -1)
  p = jax.nn.softmax(ranked, -1)
  before = jnp.cumsum(p, -1) - p  # mass of the more likely tokens: the one crossing top_p stays
  pick = jax.random.categorical(key, jnp.where(before < top_p, ranked, -jnp.inf))
  return jnp.take_along_axis(order, pick[:, None], -1)[:, 0].astype(jnp.int32)


def sample(logits, key, temperature: float = 0.0, top_p: float = 1.0):
  """logits [B, V] -> tokens [B] (on device): greedy at temperature 0, else softmax(logits /
  temperature) restricted to the smallest set of most likely tokens whose mass reaches top_p,
  drawn with the jax.random key."""
  return _sample(jnp.asarray(logits), key, temperature, top_p, temperature <= 0, top_p < 1)


_SAMPLING = ("greedy", "nucleus", "eos")


@functools.partial(jax.jit, static_argnames=_SAMPLING, donate_argnums=(1, 2))
def first_token(logits, toks, seen, key, temperature, top_p, greedy, nucleus, eos):
  """Token 0 from the prefill's logits [B, V] into toks [B, N] (and seen [B, N, V]) -> done [B]."""
  tok = _sample(logits, jax.random.fold_in(key, 0), temperature, top_p, greedy, nucleus)
  seen = None if seen is None else seen.at[:, 0].set(logits)
  return toks.at[:, 0].set(tok), seen, jnp.isin(tok, jnp.asarray(eos, jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "topk", "chunk", "recall", "window") + _SAMPLING,
                   donate_argnums=(1, 4, 5))
def decode_loop(params, cache, fill, memories, toks, seen, step, done, stop, key, temperature, top_p,
                 cfg, mode, topk, chunk, recall, window, greedy, nucleus, eos):
  """Tokens step..stop-1 in one on-device loop (one host round trip, not one per token): each
  decodes the previous token against cache + memory and samples with key folded with its step.
  Stops early when every row is done (eos; a done row gets eos[0]) or some row's cache is full
  (fill == window: it moves into memory on the host first) -> (cache, fill, toks, seen, step, done)."""
  pad = eos[0] if eos else 0

  def more(c):
    step, fill, done = c[:3]
    return (step < stop) & ~jnp.all(done) & jnp.all(fill < window)

  def one(c):
    step, fill, done, cache, toks, seen = c
    prev = jax.lax.dynamic_index_in_dim(toks, step - 1, 1)  # [B, 1]
    logits, cache = decode_step(params, prev, cache, fill, memories, cfg, mode, topk, chunk, recall)
    logits = logits[:, 0]
    tok = _sample(logits, jax.random.fold_in(key, step), temperature, top_p, greedy, nucleus)
    tok = jnp.where(done, pad, tok)
    toks = jax.lax.dynamic_update_index_in_dim(toks, tok, step, 1)
    if seen is not None:  # a done row's logits are 0
      seen = jax.lax.dynamic_update_index_in_dim(seen, jnp.where(done[:, None], 0.0, logits), step, 1)
    return step + 1, fill + 1, done | jnp.isin(tok, jnp.asarray(eos, jnp.int32)), cache, toks, seen

  step, fill, done, cache, toks, seen = jax.lax.while_loop(more, one, (step, fill, done, cache, toks, seen))
  return cache, fill, toks, seen, step, done
