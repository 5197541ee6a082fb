"""Long-input processing with FoT memory (DESIGN.md, "Inference semantics").

Input is processed in windows of the local length. Memory layers attend to the
causal local window plus the memory; after each window its memory-layer keys
(with the configured position treatment: 'first' = as if at position 0) and
values are appended to that layer's memory. Memory is per memory layer, per row
and per kv head, held on device in buffers whose capacity doubles as it grows
(so a long run compiles O(log n) shapes, not one per window).

* `dense`: every live memory entry joins the softmax (LongLLaMA's choice);
  `topk`: exact top-k memory entries per query and kv head (the paper's kNN).
* single_doc: each row is one document; memory is cleared between documents.
  multi_doc: rows are streams of concatenated documents; memory is never cleared.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MEMORY_MODES, MemoryBlock

DOC_MODES = ("single_doc", "multi_doc")


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "topk", "chunk", "stop_after"))
def forward_window(params, tokens, token_mask, memories, cfg, mode, topk, chunk, stop_after=None):
  """One window through the model with memory -> (logits or None, {layer: (keys, values)})."""
  logits, aux = LlamaModel(cfg).apply({"params": params}, tokens, token_mask=token_mask,
                                      memories=memories, mem_mode=mode, mem_topk=topk,
                                      mem_chunk=chunk, want_mem_kv=True, stop_after=stop_after)
  return logits, aux["mem_kv"]


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))  # in place: a copy per window made long inputs O(n^2)
def _append(buf_k, buf_v, buf_m, k, v, m, at):
  return (jax.lax.dynamic_update_slice_in_dim(buf_k, k.astype(buf_k.dtype), at, axis=1),
          jax.lax.dynamic_update_slice_in_dim(buf_v, v.astype(buf_v.dtype), at, axis=1),
          jax.lax.dynamic_update_slice_in_dim(buf_m, m, at, axis=1))


class Memory:
  """Per-layer key/value memory: buffers [B, capacity, KV, D] and a live mask [B, capacity]."""

  def __init__(self, cfg: ModelConfig, batch: int, dtype=jnp.float32, initial_capacity: int = 1024):
    self.cfg, self.batch, self.dtype = cfg, batch, jnp.dtype(dtype)
    self.initial_capacity = initial_capacity
    self.clear()

  def clear(self):
    self.size = 0
    self.buffers: Dict[int, tuple] = {}

  def _grow(self, need: int):
    cap = self.capacity
    if need <= cap:
      return
    new_cap = max(self.initial_capacity, cap)
    while new_cap < need:
      new_cap *= 2
    kv, d = self.cfg.kv_heads, self.cfg.dim_per_head
    for layer in self.cfg.mem_layers:
      k = jnp.zeros((self.batch, new_cap, kv, d), self.dtype)
      v = jnp.zeros((self.batch, new_cap, kv, d), self.dtype)
      m = jnp.zeros((self.batch, new_cap), bool)
      if layer in self.buffers and self.size:
        ok, ov, om = self.buffers[layer]
        k, v, m = _append(k, v, m, ok[:, :self.size], ov[:, :self.size], om[:, :self.size], 0)
      self.buffers[layer] = (k, v, m)

  @property
  def capacity(self) -> int:
    if not self.buffers:
      return 0
    return next(iter(self.buffers.values()))[0].shape[1]

  def add(self, mem_kv: Dict[int, tuple], token_mask):
    """Appends one window: mem_kv {layer: (k [B, T, KV, D], v)}; padded tokens stay dead."""
    t = token_mask.shape[1]
    self._grow(self.size + t)
    for layer, (k, v) in mem_kv.items():
      bk, bv, bm = self.buffers[layer]
      self.buffers[layer] = _append(bk, bv, bm, k, v, token_mask, self.size)
    self.size += t

  def blocks(self) -> Optional[Dict[int, List[MemoryBlock]]]:
    if not self.size:
      return None
    return {layer: [MemoryBlock(k, v, m)] for layer, (k, v, m) in self.buffers.items()}

  def nbytes(self) -> int:
    return sum(int(k.nbytes + v.nbytes + m.nbytes) for k, v, m in self.buffers.values())


class MemoryInference:
  """Window-by-window processing of long inputs with FoT memory."""

  def __init__(self, cfg: ModelConfig, params, window: int, mode: str = "dense", topk: int = 32,
               chunk: int = 65536, mem_dtype=jnp.float32):
    if mode not in MEMORY_MODES:
      raise ValueError(f"inference.mode: must be one of {MEMORY_MODES}, got {mode!r}")
    if window <= 0:
      raise ValueError(f"inference.window: must be positive, got {window}")
    self.cfg, self.params, self.window = cfg, params, window
    self.mode, self.topk, self.chunk, self.mem_dtype = mode, topk, chunk, mem_dtype

  def new_memory(self, batch: int) -> Memory:
    return Memory(self.cfg, batch, self.mem_dtype)

  def process(self, tokens, memory: Memory, token_mask=None, want_logits: bool = True,
              stop_after: Optional[int] = None):
    """tokens [B, L] -> logits [B, L, V] (NumPy; None if not wanted); memory is updated.

    Windows start at token 0; the last one is padded to the window length (padding
    is masked and never enters memory), so every call compiles one shape.
    """
    tokens = np.asarray(tokens, np.int32)
    b, length = tokens.shape
    if b != memory.batch:
      raise ValueError(f"inference: {b} rows but the memory was made for {memory.batch}")
    token_mask = np.ones((b, length), bool) if token_mask is None else np.asarray(token_mask, bool)
    outs = []
    for start in range(0, length, self.window):
      tok = tokens[:, start:start + self.window]
      msk = token_mask[:, start:start + self.window]
      n = tok.shape[1]
      if n < self.window:
        tok = np.pad(tok, [(0, 0), (0, self.window - n)])
        msk = np.pad(msk, [(0, 0), (0, self.window - n)])
      logits, mem_kv = forward_window(self.params, jnp.asarray(tok), jnp.asarray(msk), memory.blocks(),
                               self.cfg, self.mode, self.topk, self.chunk, stop_after)
      memory.add(mem_kv, jnp.asarray(msk))
      if want_logits and logits is not None:
        outs.append(np.asarray(logits[:, :n]))
    return np.concatenate(outs, axis=1) if outs else None

  def generate(self, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0):
    """prompt [B, L] (L >= 1) -> [B, L + max_new_tokens] tokens, greedy (temperature 0) or sampled.

    Window-aligned like `process`: the current, partly filled window is recomputed
    for every new token (no local key/value cache) and enters memory once full, so
    the logits behind each token equal `process` on the sequence so far.
    """
    tokens = np.asarray(prompt, np.int32)
    b, length = tokens.shape
    if length < 1:
      raise ValueError("generate: the prompt needs at least one token")
    rng = np.random.default_rng(seed)
    memory = self.new_memory(b)
    start = (length - 1) // self.window * self.window  # the last window keeps >= 1 prompt token
    if start:
      self.process(tokens[:, :start], memory, want_logits=False)
    local = [tokens[:, start:]]
    for _ in range(max_new_tokens):
      cur = np.concatenate(local, axis=1)
      n = cur.shape[1]
      msk = np.arange(self.window) < n
      logits, mem_kv = forward_window(self.params, jnp.asarray(np.pad(cur, [(0, 0), (0, self.window - n)])),
                                      jnp.asarray(np.broadcast_to(msk, (b, self.window))), memory.blocks(),
                                      self.cfg, self.mode, self.topk, self.chunk)
      last = np.asarray(logits[:, n - 1], np.float64)
      if temperature > 0:
        p = np.exp((last - last.max(-1, keepdims=True)) / temperature)
        nxt = np.array([rng.choice(p.shape[-1], p=row / row.sum()) for row in p], np.int32)
      else:
        nxt = last.argmax(-1).astype(np.int32)
      if n == self.window:  # the window is full: it goes to memory, the new token opens the next
        memory.add(mem_kv, jnp.ones((b, self.window), bool))
        local = []
      local.append(nxt[:, None])
      tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
    return tokens

  def documents(self, docs: List[np.ndarray], doc_mode: str = "single_doc", batch: int = 1):
    """Logits for each document, in `single_doc` (memory cleared per document) or
    `multi_doc` (one stream, memory kept across documents; batch must be 1)."""
    if doc_mode not in DOC_MODES:
      raise ValueError(f"inference.doc_mode: must be one of {DOC_MODES}, got {doc_mode!r}")
    results = []
    if doc_mode == "multi_doc":
      memory = self.new_memory(1)
      for doc in docs:
        results.append(self.process(np.asarray(doc)[None], memory)[0])
      return results
    for i in range(0, len(docs), batch):
      group = [np.asarray(d) for d in docs[i:i + batch]]
      width = max(len(d) for d in group)
      toks = np.zeros((len(group), width), np.int32)
      mask = np.zeros((len(group), width), bool)
      for r, d in enumerate(group):
        toks[r, :len(d)], mask[r, :len(d)] = d, True
      logits = self.process(toks, self.new_memory(len(group)), mask)
      results.extend(logits[r, :len(d)] for r, d in enumerate(group))
    return results
