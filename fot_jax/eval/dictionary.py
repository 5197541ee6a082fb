"""Dictionary lookup with memory (FoT paper, App. F / Figure 10).

For each evaluated document the model reads M tokens of context (definitions
from other dictionaries, the distractors, with the target document's definition
block at a random depth) and then the target's queries, window by window with
memory, exactly as `fot_jax.inference` processes a long input. A query is
answered when every value token is predicted right (teacher forcing).

Fast path (models with one memory layer): a window's memory keys depend only on
that window's tokens (layers below the only memory layer never see memory) and
memory is a set (no position on memory keys), so the distractor windows are
encoded once, shared by all rows and all memory sizes, and each row adds only
the window that holds its own definitions (masking the shared copy of that
window). `tests/test_dictionary.py` checks this equals plain window-by-window
inference.

Host retrieval (`retrieval='flat'|'ivf'`, with `fot_jax.eval.host_index`): the shared
memory stays on the host in a faiss index per kv head; each query of the memory layer
retrieves its top-k entries there (exact inner product for `flat`, inverted lists for
`ivf`, the approximate top-k), the union of a row's retrieved entries goes to the device
with the row's own window, and the exact top-k over them makes the attention. `flat` thus
equals device `topk` (tested); `ivf` costs what its retrieval misses (measured: recall@k).
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from data_pipelines.dictionary_lookup import DictionaryTask
from fot_jax.inference import MemoryInference, forward_window
from fot_jax.model.config import ModelConfig
from fot_jax.eval import host_index
from fot_jax.model.memory import MemoryBlock


class DictionaryEvalSet:
  """Seeded targets and distractor pool shared by every model evaluated on it."""

  def __init__(self, task: DictionaryTask, n_docs: int, max_context: int, seed: int = 1234,
               split_keys: bool = False):
    """split_keys: targets draw their keys from the first half of the key space and distractors
    from the second, for key spaces too small to keep every target's keys out of the shared
    distractor pool (64 keys, 64 targets of 16). Default: distractors avoid the targets' keys."""
    if max_context % task.defs_len:
      raise ValueError(f"eval.memory_tokens: {max_context} is not a multiple of the definition "
                       f"block ({task.defs_len} tokens)")
    rng = np.random.default_rng(seed)
    self.task = task
    half = np.arange(task.key_space // 2)
    if split_keys and task.n_defs > len(half):
      raise ValueError(f"split_keys: a document's {task.n_defs} keys do not fit half of the {task.key_space} keys")
    self.docs = [task.document(rng, exclude=half + len(half) if split_keys else None) for _ in range(n_docs)]
    exclude = half if split_keys else np.concatenate([task.key_codes(d["keys"]) for d in self.docs])
    if len(np.unique(exclude)) >= task.key_space:
      raise ValueError(f"eval: the {n_docs} targets use every one of the {task.key_space} keys, so no "
                       f"distractor is left; use fewer targets, a larger key space or split_keys")
    n_defs = max_context // task.def_len
    # Distractor keys may repeat among themselves; none equals a target key, so every
    # query has exactly one answer in memory.
    pool, _, _ = task.definitions(rng, n_defs, exclude=exclude, distinct=False)
    self.pool = pool.astype(np.int32)
    self.depth_rng_seed = seed + 1

  def depths(self, context: int) -> np.ndarray:
    """Which definition block of the context holds each target's definitions."""
    rng = np.random.default_rng([self.depth_rng_seed, context])
    return rng.integers(0, context // self.task.defs_len, len(self.docs))

  def stream(self, i: int, context: int) -> np.ndarray:
    """Row i's full token stream for `context` tokens: context then queries."""
    t = self.task
    ctx = self.pool[:context].copy()
    c = self.depths(context)[i]
    doc = self.docs[i]["tokens"]
    ctx[c * t.defs_len:(c + 1) * t.defs_len] = doc[:t.defs_len]
    return np.concatenate([ctx, doc[t.defs_len:]])

  def window_tokens(self, i: int, context: int, w: int, window: int) -> np.ndarray:
    """stream(i, context)[w * window:(w + 1) * window] for a window of the context, without
    copying the whole context (which is 64 MB per row at 16M tokens)."""
    t = self.task
    lo, hi = w * window, (w + 1) * window
    out = self.pool[lo:hi].copy()
    c = self.depths(context)[i] * t.defs_len
    a, b = max(lo, c), min(hi, c + t.defs_len)
    if a < b:
      out[a - lo:b - lo] = self.docs[i]["tokens"][a - c:b - c]
    return out


def _query_accuracy(task: DictionaryTask, logits_q: np.ndarray, docs: Sequence[dict]) -> np.ndarray:
  """logits over the query block [B, queries_len, V] (+ the logit just before it at index 0
  is not needed: the first query token is a key). Returns bool [B, n_queries]."""
  out = []
  for lg, doc in zip(logits_q, docs):
    q = doc["tokens"][task.defs_len:]
    vmask = doc["value_mask"][task.defs_len:]
    token_ok = np.ones(len(q), bool)  # token t of the block is predicted at position t - 1
    token_ok[1:] = np.where(vmask[1:], np.argmax(lg[:-1], -1) == q[1:], True)
    out.append(token_ok.reshape(task.n_queries, task.query_len).all(axis=1))
  return np.stack(out)


def evaluate(cfg: ModelConfig, params, evalset: DictionaryEvalSet, window: int,
             contexts: Sequence[int], mode: str = "topk", topk: int = 32, batch: int = 8,
             chunk: int = 8192, log: Optional[Callable[[str], None]] = None, name: str = "",
             retrieval: Optional[str] = None, nprobe: int = 8) -> Dict[str, List]:
  """Accuracy against context size. Returns lists: memory_tokens (context M),
  tokens_in_memory, accuracy, seconds; with host `retrieval` also recall (of the index's
  top-k against the exact top-k, over a sample of queries; 1.0 for 'flat')."""
  if retrieval is not None and retrieval not in host_index.KINDS:
    raise ValueError(f"eval.retrieval: must be one of {host_index.KINDS} or None, got {retrieval!r}")
  if retrieval:
    mode = "topk"  # the device takes the exact top-k of what the host index retrieved
  task = evalset.task
  log = log or functools.partial(print, flush=True)
  if task.queries_len > window:
    raise ValueError(f"eval: the query block ({task.queries_len} tokens) must fit the window {window}")
  mem_layers = cfg.mem_layers
  if len(mem_layers) != 1:
    raise NotImplementedError("the shared-memory fast path needs exactly one memory layer; use "
                              "evaluate_generic for other models")
  layer = mem_layers[0]
  n = len(evalset.docs)
  results = {"memory_tokens": [], "tokens_in_memory": [], "accuracy": [], "seconds": []}
  if retrieval:
    results["recall"] = []
  shared = None  # encoded pool, grown to the largest context needing memory
  for context in contexts:
    t0 = time.time()
    if context % task.defs_len:
      raise ValueError(f"eval.memory_tokens: {context} is not a multiple of {task.defs_len}")
    if context > len(evalset.pool):
      raise ValueError(f"eval.memory_tokens: {context} exceeds the distractor pool ({len(evalset.pool)})")
    hits = []
    if context + task.queries_len <= window:  # everything fits in one local window
      in_memory = 0
      for s in range(0, n, batch):
        rows = range(s, min(n, s + batch))
        toks = np.stack([evalset.stream(i, context) for i in rows])
        logits, _ = forward_window(params, jnp.asarray(toks), jnp.ones(toks.shape, bool), None, cfg, mode, topk, chunk)
        hits.append(_query_accuracy(task, np.asarray(logits[:, context:]), [evalset.docs[i] for i in rows]))
    else:
      if context % window:
        raise ValueError(f"eval.memory_tokens: {context} must be a multiple of the window {window} "
                         f"once it does not fit the local window")
      in_memory = context
      if shared is None or shared[0].shape[1] < context:  # once, for the largest context
        largest = max(c for c in contexts if c + task.queries_len > window)
        shared = _encode_windows(cfg, params, evalset.pool[:largest], window, layer, chunk,
                                 on_device=not retrieval)
      sk, sv = shared[0][:, :context], shared[1][:, :context]
      depths = evalset.depths(context)
      index = None
      if retrieval:
        index = host_index.HostIndex(np.asarray(sk[0]), np.asarray(sv[0]), retrieval, nprobe)
        recalls = []
      for s in range(0, n, batch):
        rows = list(range(s, min(n, s + batch)))
        own_w = [(depths[i] * task.defs_len) // window for i in rows]
        own_block = own_window_block(cfg, params, evalset, rows, own_w, context, window, layer, chunk)
        queries = np.stack([evalset.docs[i]["tokens"][task.defs_len:] for i in rows])
        if index is None:
          mask = np.ones((len(rows), context), bool)
          for r, w in enumerate(own_w):
            mask[r, w * window:(w + 1) * window] = False
          blocks = {layer: [MemoryBlock(sk, sv, jnp.asarray(mask)), own_block]}
        else:  # each row's own window is left out of the shared index's answers
          q = host_index.memory_queries(params, jnp.asarray(queries), cfg, layer)
          exclude = [(w * window, (w + 1) * window) for w in own_w]
          cand, recall = index.candidates(q, topk, exclude)
          if recall is not None:
            recalls.append(recall)
          blocks = {layer: [cand, own_block]}
        logits, _ = forward_window(params, jnp.asarray(queries), jnp.ones(queries.shape, bool), blocks,
                            cfg, mode, topk, chunk)
        hits.append(_query_accuracy(task, np.asarray(logits), [evalset.docs[i] for i in rows]))
    acc = float(np.concatenate(hits).mean())
    dt = time.time() - t0
    for key, val in (("memory_tokens", context), ("tokens_in_memory", in_memory), ("accuracy", acc),
                     ("seconds", dt)):
      results[key].append(val)
    note = ""
    if retrieval:
      rec = float(np.mean(recalls)) if in_memory and recalls else None
      results["recall"].append(rec)
      note = f", {retrieval} recall@{topk} {rec:.3f}" if rec is not None else ""
    log(f"[{name}] dictionary ({retrieval or mode}): context {context:>9,} tokens ({in_memory:,} in memory): "
        f"accuracy {acc:.3f}{note} ({dt:.1f}s)")
  return results


def own_window_block(cfg, params, evalset: DictionaryEvalSet, rows: Sequence[int], own_w: Sequence[int],
                     context: int, window: int, layer: int, chunk: int) -> MemoryBlock:
  """The memory block of each row's own window (the one holding its definitions; window own_w[r]
  of its stream): [len(rows), window, KV, D]."""
  tokens = np.stack([evalset.window_tokens(i, context, w, window) for i, w in zip(rows, own_w)])
  _, kv = forward_window(params, jnp.asarray(tokens), jnp.ones(tokens.shape, bool), None, cfg, "dense", 1, chunk,
                         stop_after=layer)
  return MemoryBlock(kv[layer][0], kv[layer][1], jnp.ones(tokens.shape, bool))


def window_kv(cfg, params, tokens: np.ndarray, window: int, layer: int, chunk: int,
              windows_per_call: int = 64):
  """Memory keys/values of `layer` for consecutive windows of `tokens`, windows_per_call windows at
  a time: yields NumPy ([n, KV, D], [n, KV, D]) in token order."""
  n_win = len(tokens) // window
  wins = tokens[:n_win * window].reshape(n_win, window)
  for s in range(0, n_win, windows_per_call):
    part = wins[s:s + windows_per_call]
    if len(part) < windows_per_call and n_win > windows_per_call:  # keep one compiled shape
      part = np.pad(part, [(0, windows_per_call - len(part)), (0, 0)])
    _, kv = forward_window(params, jnp.asarray(part), jnp.ones(part.shape, bool), None, cfg, "dense", 1, chunk,
                    stop_after=layer)
    take = min(windows_per_call, n_win - s)
    k, v = np.asarray(kv[layer][0][:take]), np.asarray(kv[layer][1][:take])
    yield k.reshape(take * window, *k.shape[2:]), v.reshape(take * window, *v.shape[2:])


def _encode_windows(cfg, params, tokens: np.ndarray, window: int, layer: int, chunk: int,
                    windows_per_call: int = 64, on_device: bool = True):
  """Memory keys/values of `layer` for consecutive windows of `tokens`: [1, L, KV, D] each
  (device arrays, or NumPy on the host when not on_device)."""
  ks, vs = zip(*window_kv(cfg, params, tokens, window, layer, chunk, windows_per_call))
  put = jnp.asarray if on_device else np.asarray
  return put(np.concatenate(ks)[None]), put(np.concatenate(vs)[None])


def evaluate_generic(cfg: ModelConfig, params, evalset: DictionaryEvalSet, window: int, context: int,
                     rows: Optional[Sequence[int]] = None, mode: str = "topk", topk: int = 32,
                     chunk: int = 8192) -> np.ndarray:
  """Reference path: each row's whole stream through MemoryInference. bool [rows, n_queries]."""
  task = evalset.task
  rows = list(range(len(evalset.docs))) if rows is None else list(rows)
  infer = MemoryInference(cfg, params, window, mode, topk, chunk)
  toks = np.stack([evalset.stream(i, context) for i in rows])
  # Windows start at the stream's first token, so the queries start a window of their own
  # exactly when the context is a multiple of the window (as in the fast path).
  logits = infer.process(toks, infer.new_memory(len(rows)))
  return _query_accuracy(task, logits[:, context:], [evalset.docs[i] for i in rows])
