"""FoT memory on the host, searched per query: the FoT paper's kNN memory (a faiss index) for prompts
whose dense memory costs more than the model itself.

Dense memory over a 128K-token prompt costs ~80 TFLOP in four memory layers (every query against
every earlier key), on top of the model's own ~35 TFLOP. Here each memory layer's keys and values of
the earlier windows stay in host RAM, one faiss inner-product index per row, layer and kv head;
every query head of a window retrieves its own top-k, and the model attends to those k entries
beside its causal local window under one softmax (`mem_mode='gathered'`,
model/memory.gathered_memory_partial): the semantics of `MemoryInference(mode='topk')`, which an
exact ('flat') index reproduces (tests/test_host_memory.py).

A query of memory layer l depends on the layers below it, which read their own memory, so a window
runs the stack piecewise (LlamaModel's start_at / hidden): layers up to l - 1, then layer l alone
for its queries (`mem_queries`), the host search, then layer l with the retrieved entries and on up
to the next memory layer. The extra cost is one layer per memory layer and window (4 of 30 layers
for SmolLM2 with four memory layers) plus the searches.

Index kinds: 'flat' (exact) or 'ivf' (inverted lists: exact until `ivf_from` entries, then an
IndexIVFFlat with 4 sqrt(N) lists, at most 1024, trained on the memory so far and retrained each
time memory doubles, `nprobe` lists searched). The recall@k of 'ivf' against a NumPy brute force on
a sample of queries is kept (`HostMemory.recall`).
"""
from __future__ import annotations

import functools
import logging
import math
import time
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.generation import fit_slots, sample
from fot_jax.inference import generation_layout, generation_result, new_tokens_made, padded_width, windows_of
from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MemoryBlock

KINDS = ("flat", "ivf")
log = logging.getLogger(__name__)


def ivf_lists(n: int) -> int:
  """Inverted lists for an IVF index over n keys: 4 sqrt(n), at most 1024 (k-means cost), and at
  least 39 keys a list (faiss's minimum training points per centroid)."""
  return max(1, min(1024, int(4 * math.sqrt(n)), n // 39))


class _LayerStore:
  """One row's memory of one memory layer: keys / values [N, KV, D] (float32, buffers that double)
  and, per kv head, a faiss inner-product index over the keys."""

  def __init__(self, kv: int, d: int, kind: str, nprobe: int, ivf_from: int):
    self.kv, self.d, self.kind, self.nprobe, self.ivf_from = kv, d, kind, nprobe, ivf_from
    self.keys = np.zeros((0, kv, d), np.float32)
    self.values = np.zeros((0, kv, d), np.float32)
    self.size, self.trained_at = 0, 0
    self.indexes: List = []

  def add(self, keys: np.ndarray, values: np.ndarray) -> None:
    import faiss
    n = len(keys)
    if not n:
      return
    if self.size + n > len(self.keys):  # capacity doubles: appending never copies the whole memory per window
      cap = max(1024, len(self.keys))
      while cap < self.size + n:
        cap *= 2
      grow = lambda x: np.concatenate([x, np.zeros((cap - len(x),) + x.shape[1:], np.float32)])
      self.keys, self.values = grow(self.keys), grow(self.values)
    self.keys[self.size:self.size + n], self.values[self.size:self.size + n] = keys, values
    self.size += n
    if self.kind == "ivf" and self.size >= self.ivf_from and self.size >= 2 * self.trained_at:
      self._train_ivf()
      return
    if not self.indexes:
      self.indexes = [faiss.IndexFlatIP(self.d) for _ in range(self.kv)]
    for h, index in enumerate(self.indexes):
      index.add(np.ascontiguousarray(keys[:, h]))

  def _train_ivf(self) -> None:
    import faiss
    n = self.size
    nlist = ivf_lists(n)
    rng = np.random.default_rng(n)
    sample = rng.choice(n, min(n, 64 * nlist), replace=False)
    self.indexes = []
    for h in range(self.kv):
      x = np.ascontiguousarray(self.keys[:n, h])
      index = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.d), self.d, nlist, faiss.METRIC_INNER_PRODUCT)
      index.train(np.ascontiguousarray(x[sample]))
      index.add(x)
      index.nprobe = self.nprobe
      self.indexes.append(index)
    self.trained_at = n

  def search(self, q: np.ndarray, k: int) -> np.ndarray:
    """q [KV, Q, D] -> ids [KV, Q, k] of each query's top-k keys of its head (-1: none)."""
    return np.stack([self.indexes[h].search(np.ascontiguousarray(q[h]), k)[1] for h in range(self.kv)])


class HostMemory:
  """Per row and memory layer, the keys and values of every earlier window (`_LayerStore`)."""

  def __init__(self, cfg: ModelConfig, batch: int, kind: str = "ivf", nprobe: int = 8, ivf_from: int = 16384,
               recall_queries: int = 16):
    if kind not in KINDS:
      raise ValueError(f"host memory: kind must be one of {KINDS}, got {kind!r}")
    self.cfg, self.batch, self.kind, self.recall_queries = cfg, batch, kind, recall_queries
    self.stores = [{layer: _LayerStore(cfg.kv_heads, cfg.dim_per_head, kind, nprobe, ivf_from)
                    for layer in cfg.mem_layers} for _ in range(batch)]
    self.hits = self.total = 0
    # recall over every query at the scored positions (a passkey's answer), not a sample: the
    # sampled recall is mostly filler queries, whose top-k are many near-equal copies that any
    # list holds, while an answer's query looks for a few rare keys (the key's digits)
    self.scored: Optional[Tuple[int, int]] = None  # [from, to) of the window: set by the inference
    self.scored_hits = self.scored_total = 0
    self.rng = np.random.default_rng(0)
    # {layer: queries [B, T, KV, G, D]} of the last window read, kept when a dict (fot_jax/eval/readout.py)
    self.seen_queries: Optional[Dict[int, np.ndarray]] = None
    # memory layers whose gather retrieves nothing: their attention sees the local window only (the
    # readout's left-out reads; every layer while memory is written: its --write_local)
    self.quiet_layers: frozenset = frozenset()

  @property
  def size(self) -> int:
    return max((s.size for row in self.stores for s in row.values()), default=0)

  @property
  def recall(self) -> Optional[float]:
    """recall@k of the retrieval against exact search, over the sampled queries so far (None: no
    approximate search ran)."""
    return self.hits / self.total if self.total else None

  @property
  def scored_recall(self) -> Optional[float]:
    """recall@k against exact search over every query of the scored positions (None: none read
    through an approximate index)."""
    return self.scored_hits / self.scored_total if self.scored_total else None

  def add(self, mem_kv: Dict[int, tuple], token_mask) -> None:
    """One window's keys and values {layer: (k [B, T, KV, D], v)}; masked tokens stay out."""
    mask = np.asarray(token_mask, bool)
    for layer, (k, v) in mem_kv.items():
      k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
      for r in range(self.batch):
        self.stores[r][layer].add(k[r][mask[r]], v[r][mask[r]])

  def gather(self, layer: int, queries, k: int, token_mask=None) -> Optional[MemoryBlock]:
    """queries [B, T, KV, G, D] -> each query head's top-k entries as a MemoryBlock with keys /
    values [B, KV, G, T, k, D] and mask [B, KV, G, T, k]; None while this layer's memory is empty.
    token_mask [B, T]: the real tokens, whose queries the recall samples (padding's are searched
    but never counted)."""
    k = min(k, self.size)
    if k == 0 or layer in self.quiet_layers:
      return None
    q = np.asarray(queries, np.float32)
    if self.seen_queries is not None:
      self.seen_queries[layer] = q
    b, t, kv, g, d = q.shape
    keys = np.zeros((b, kv, g, t, k, d), np.float32)
    values = np.zeros((b, kv, g, t, k, d), np.float32)
    mask = np.zeros((b, kv, g, t, k), bool)
    real = np.ones((b, t), bool) if token_mask is None else np.asarray(token_mask, bool)
    for r in range(b):
      store = self.stores[r][layer]
      if not store.size:
        continue
      qr = q[r].transpose(1, 2, 0, 3).reshape(kv, g * t, d)  # [KV, G*T, D]: a search per kv head
      ids = store.search(qr, k)  # [KV, G*T, k]
      if store.kind == "ivf" and store.trained_at and real[r].any():
        self._count_recall(store, qr, ids, k, (np.arange(g)[:, None] * t + np.flatnonzero(real[r])[None]).ravel())
        if self.scored is not None and self.scored[0] < min(self.scored[1], t):
          cols = (np.arange(g)[:, None] * t + np.arange(self.scored[0], min(self.scored[1], t))[None]).ravel()
          for h in range(kv):
            hits, total = recall_hits(qr[h, cols] @ store.keys[:store.size, h].T, ids[h, cols], k)
            self.scored_hits, self.scored_total = self.scored_hits + hits, self.scored_total + total
      ok = ids >= 0
      safe = np.where(ok, ids, 0)
      heads = np.arange(kv)[:, None, None]
      keys[r] = store.keys[safe, heads].reshape(kv, g, t, k, d)
      values[r] = store.values[safe, heads].reshape(kv, g, t, k, d)
      mask[r] = ok.reshape(kv, g, t, k)
    return MemoryBlock(jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask))

  def _count_recall(self, store: _LayerStore, q, ids, k: int, cols) -> None:
    """recall_hits on a sample of each kv head's queries among `cols` (those of real tokens)."""
    for h in range(q.shape[0]):
      pick = self.rng.choice(cols, min(self.recall_queries, len(cols)), replace=False)
      hits, total = recall_hits(q[h, pick] @ store.keys[:store.size, h].T, ids[h, pick], k)
      self.hits, self.total = self.hits + hits, self.total + total


def recall_hits(scores, ids, k: int) -> Tuple[int, int]:
  """(retrieved entries among the exact top-k, k x queries): scores [S, N] of every memory entry
  (NumPy brute force; -inf: excluded), ids [S, k] retrieved (-1: none). An entry counts when its
  score reaches the exact k-th best (repeated text holds many equal keys: which of a tie is kept
  changes nothing). k is capped at the entries that can be retrieved."""
  k = min(k, int(np.isfinite(scores[0]).sum()) if len(scores) else 0)
  if k <= 0:
    return 0, 0
  kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1:k]
  got = np.take_along_axis(scores, np.where(ids[:, :k] >= 0, ids[:, :k], 0), 1)
  return int(((got >= kth - 1e-5) & (ids[:, :k] >= 0)).sum()), k * len(scores)


@functools.partial(jax.jit, static_argnames=("cfg", "start", "stop", "want_cache"))
def _run_layers(params, tokens, hidden, token_mask, memories, cfg: ModelConfig, start: int, stop: Optional[int],
                want_cache: bool = False):
  """Layers start..stop (stop None: to the logits) -> (logits or None, hidden after, {layer: (k, v)},
  {layer: (keys, values, memory keys or None)} of this window when want_cache, else None)."""
  logits, aux = LlamaModel(cfg).apply({"params": params}, tokens, token_mask=token_mask, memories=memories,
                                      mem_mode="gathered", want_mem_kv=True, stop_after=stop, start_at=start,
                                      hidden=hidden, want_hidden=True, want_cache=want_cache)
  return logits, aux["hidden"], aux["mem_kv"], aux.get("cache")


@functools.partial(jax.jit, static_argnames=("cfg", "start", "stop"))
def _decode_layers(params, tokens, hidden, cache, fill, memories, cfg: ModelConfig, start: int, stop: Optional[int]):
  """New tokens [B, 1] through layers start..stop against each layer's cache, written at slots
  `fill` -> (logits or None, hidden after, those layers' updated caches)."""
  logits, aux = LlamaModel(cfg).apply({"params": params}, tokens, memories=memories, mem_mode="gathered",
                                      cache=cache, cache_fill=fill, stop_after=stop, start_at=start,
                                      hidden=hidden, want_hidden=True)
  return logits, aux["hidden"], aux["cache"]


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def _decode_queries(params, tokens, hidden, cache, fill, cfg: ModelConfig, layer: int):
  """Memory layer `layer`'s queries [B, 1, KV, G, D] of new tokens at cache slots `fill`."""
  _, state = LlamaModel(cfg).apply({"params": params}, tokens, cache=cache, cache_fill=fill, stop_after=layer,
                                   start_at=layer, hidden=hidden, mutable=["intermediates"])
  return state["intermediates"][f"layers_{layer}"]["self_attn"]["mem_queries"][0]


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def _layer_queries(params, tokens, hidden, token_mask, cfg: ModelConfig, layer: int):
  """Memory layer `layer`'s attention queries [B, T, KV, G, D] (scaled, as they score keys)."""
  _, state = LlamaModel(cfg).apply({"params": params}, tokens, token_mask=token_mask, stop_after=layer,
                                   start_at=layer, hidden=hidden, mutable=["intermediates"])
  return state["intermediates"][f"layers_{layer}"]["self_attn"]["mem_queries"][0]


class HostMemoryInference:
  """Window-by-window processing with host memory; `process` and `new_memory` as MemoryInference's,
  so the evaluation suites read a prompt through either (suite mode 'host')."""

  mode = "host"

  def __init__(self, cfg: ModelConfig, params, window: int, topk: int = 32, kind: str = "ivf", nprobe: int = 8,
               ivf_from: int = 16384):
    if window <= 0:
      raise ValueError(f"host memory: window must be positive, got {window}")
    if topk < 1:
      raise ValueError(f"host memory: topk must be at least 1, got {topk}")
    if kind not in KINDS:
      raise ValueError(f"host memory: kind must be one of {KINDS}, got {kind!r}")
    if not cfg.mem_layers:
      raise ValueError("host memory: the model has no memory layers")
    try:
      import faiss  # noqa: F401  (the eval extra) before a long prompt is read, not at its first search
    except ImportError:
      raise ImportError("host memory needs faiss: pip install -e '.[eval]' (make install installs it)") from None
    self.cfg, self.params, self.window, self.topk = cfg, params, window, topk
    self.kind, self.nprobe, self.ivf_from = kind, nprobe, ivf_from
    self.hits = self.total = 0  # recall counts over every prompt read
    self.scored_hits = self.scored_total = 0  # the same at the scored positions (HostMemory.scored_recall)

  @property
  def recall(self) -> Optional[float]:
    """recall@k against exact search over every prompt read so far (None: no approximate search)."""
    return self.hits / self.total if self.total else None

  @property
  def scored_recall(self) -> Optional[float]:
    """recall@k over every query at the positions whose logits were kept (an answer's), every prompt."""
    return self.scored_hits / self.scored_total if self.scored_total else None

  def new_memory(self, batch: int, capacity: int = 0) -> HostMemory:
    del capacity  # the host stores grow by themselves
    return HostMemory(self.cfg, batch, self.kind, self.nprobe, self.ivf_from)

  def _window(self, tok, msk, memory: HostMemory, want_logits: bool, want_cache: bool = False,
              topk: Optional[int] = None):
    """One window through the stack, piecewise at the memory layers -> (logits or None, its memory
    layers' keys and values {layer: (k, v)}, which the caller adds to memory after it (a window
    never retrieves itself: its own tokens are the local window), and with want_cache every
    layer's cache of the window). Without logits the stack stops at the last memory layer. topk:
    the entries each query reads (default: the inference's own)."""
    layers = sorted(self.cfg.mem_layers)
    hidden, start, logits, mem_kv, cache = None, 0, None, {}, {}
    tok, msk = jnp.asarray(tok), jnp.asarray(msk)
    for j, layer in enumerate(layers):
      if layer > start:
        _, hidden, _, c = _run_layers(self.params, tok, hidden, msk, None, self.cfg, start, layer - 1, want_cache)
        cache.update(c or {})
      # nothing to read before the first window's keys join memory: no queries to compute
      block = (memory.gather(layer, _layer_queries(self.params, tok, hidden, msk, self.cfg, layer),
                             topk or self.topk, msk) if memory.size else None)
      stop = layers[j + 1] - 1 if j + 1 < len(layers) else (None if want_logits else layer)
      logits, hidden, kv, c = _run_layers(self.params, tok, hidden, msk, None if block is None else {layer: [block]},
                                          self.cfg, layer, stop, want_cache)
      cache.update(c or {})
      mem_kv[layer] = kv[layer]
      start = None if stop is None else stop + 1
    return (logits, mem_kv, cache) if want_cache else (logits, mem_kv)

  def _decode(self, tok, cache: dict, fill, memory: HostMemory):
    """One new token per row (tok [B, 1]) at cache slots `fill`, piecewise at the memory layers as
    `_window`, each memory layer's queries searched in host memory -> logits [B, V]; `cache`
    (every layer's) is updated in place."""
    layers = sorted(self.cfg.mem_layers)
    hidden, start, fill = None, 0, jnp.asarray(fill, jnp.int32)
    memory.scored = (0, 1)  # the new token's queries: every one counts in the scored recall
    for j, layer in enumerate(layers):
      if layer > start:
        _, hidden, c = _decode_layers(self.params, tok, hidden, cache, fill, None, self.cfg, start, layer - 1)
        cache.update(c)
      block = (memory.gather(layer, _decode_queries(self.params, tok, hidden, cache, fill, self.cfg, layer),
                             self.topk) if memory.size else None)
      stop = layers[j + 1] - 1 if j + 1 < len(layers) else None
      logits, hidden, c = _decode_layers(self.params, tok, hidden, cache, fill,
                                         None if block is None else {layer: [block]}, self.cfg, layer, stop)
      cache.update(c)
      start = None if stop is None else stop + 1
    memory.scored = None
    return np.asarray(logits[:, 0])

  def process(self, tokens, memory: HostMemory, token_mask=None, want_logits: bool = True,
              logits_from: int = 0):
    """tokens [B, L] -> logits [B, L, V] (NumPy; None if not wanted), memory updated: windows from
    token 0, the last padded as MemoryInference pads it; logits_from as MemoryInference.process."""
    tokens = np.asarray(tokens, np.int32)
    b, length = tokens.shape
    if b != memory.batch:
      raise ValueError(f"host memory: {b} rows but the memory was made for {memory.batch}")
    token_mask = np.ones((b, length), bool) if token_mask is None else np.asarray(token_mask, bool)
    outs, before = [], (memory.hits, memory.total, memory.scored_hits, memory.scored_total)
    for start, n, tok, msk in windows_of(self.cfg, self.window, tokens, token_mask):
      keep = want_logits and start + self.window > logits_from
      memory.scored = (max(0, logits_from - start), n) if keep else None  # the positions with logits
      logits, mem_kv = self._window(tok, msk, memory, keep)
      memory.add(mem_kv, msk)
      if keep:
        outs.append(np.asarray(logits[:, :n]))
    memory.scored = None
    self.hits, self.total = self.hits + memory.hits - before[0], self.total + memory.total - before[1]
    self.scored_hits += memory.scored_hits - before[2]
    self.scored_total += memory.scored_total - before[3]
    return np.concatenate(outs, axis=1) if outs else None

  def generate(self, prompt, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, return_logits: bool = False, last_context_length: Optional[int] = None,
               eos_token_id=None):
    """MemoryInference.generate's arguments and results (prompts placed as there, the same sampling
    and eos handling), memory read through the host index: the windows before each prompt's last go
    into memory, the last one into a key/value cache of every layer; each new token is one query
    against its cache and, in the memory layers, its own top-k of host memory (`_decode`); a full
    cache joins memory as the next token opens another. So the logits behind a token are
    `process`'s on that row's sequence so far, placed as here. Timings land in `self.stats`."""
    rows, form, eos, (toks, mask, pads) = generation_layout(prompt, self.window, max_new_tokens, temperature,
                                                           top_p, last_context_length, eos_token_id)
    w, batch = self.window, len(rows)
    lens = np.array([len(r) for r in rows])
    ends = lens + pads
    full = (ends - 1) // w  # windows that go to memory; the last (1..w tokens) is the current one
    fill = ends - full * w
    memory = self.new_memory(batch)
    t0 = time.perf_counter()
    for win in range(int(full.max())):
      cols = slice(win * w, (win + 1) * w)
      _, mem_kv = self._window(toks[:, cols], mask[:, cols], memory, want_logits=False)
      memory.add(mem_kv, mask[:, cols] & (win < full)[:, None])  # a row's current window waits
    # each row's current window, from column 0 (as its own window), through the stack into the cache
    width = padded_width(self.cfg, w, int(fill.max()))
    cur, cur_mask = np.zeros((batch, width), np.int32), np.zeros((batch, width), bool)
    for r in range(batch):
      at = slice(full[r] * w, full[r] * w + fill[r])
      cur[r, :fill[r]], cur_mask[r, :fill[r]] = toks[r, at], mask[r, at]
    memory.scored = (int(fill[0]) - 1, int(fill[0])) if (fill == fill[0]).all() else None  # the first token's
    logits, _, cache = self._window(cur, cur_mask, memory, want_logits=True, want_cache=True)
    memory.scored = None
    cache = dict(fit_slots(cache, w))
    last = np.asarray(logits)[np.arange(batch), fill - 1]  # [B, V]: the first new token's logits
    t1 = time.perf_counter()
    pad = eos[0] if eos else 0
    gen = np.full((batch, max_new_tokens), pad, np.int32)
    seen = np.zeros((batch, max_new_tokens, last.shape[-1]), np.float32) if return_logits else None
    done, key = np.zeros(batch, bool), jax.random.key(seed)
    for step in range(max_new_tokens):
      if step:
        moving = fill == w  # a full window joins memory; the new token opens the next one
        if moving.any():
          memory.add({layer: (cache[layer][2], cache[layer][1]) for layer in self.cfg.mem_layers},
                     np.broadcast_to(moving[:, None], (batch, w)))
          fill = np.where(moving, 0, fill)
        last = self._decode(jnp.asarray(gen[:, step - 1:step]), cache, fill, memory)
        fill = fill + 1
      tok = np.where(done, pad, np.asarray(sample(last, jax.random.fold_in(key, step), temperature, top_p)))
      gen[:, step] = tok
      if return_logits:
        seen[:, step] = np.where(done[:, None], 0.0, last)  # a done row's logits are 0
      done |= np.isin(tok, eos)
      if done.all():
        break
    t2 = time.perf_counter()
    self.hits, self.total = self.hits + memory.hits, self.total + memory.total
    self.scored_hits, self.scored_total = self.scored_hits + memory.scored_hits, self.scored_total + memory.scored_total
    made = new_tokens_made(gen, eos)
    self.stats = {"prompt_tokens": int(lens.sum()), "new_tokens": made, "prefill_s": t1 - t0,
                  "decode_s": t2 - t1, "tokens_per_s": made / max(t2 - t1, 1e-9), "cache_slots": w,
                  "memory_entries": memory.size, "recall": memory.recall, "scored_recall": memory.scored_recall}
    log.info("generate (host memory): %d prompt tokens in %.2f s, %d new tokens at %.1f tokens/s, recall %s",
                 lens.sum(), t1 - t0, made, self.stats["tokens_per_s"], self.stats["scored_recall"])
    out = generation_result(rows, gen, form)
    if not return_logits:
      return out
    return out, seen
