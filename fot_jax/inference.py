"""Long-input processing with FoT memory (docs/semantics.md, "Memory (inference)").

Input is processed in windows of the local length. Memory layers attend to the
causal local window plus the memory; after each window its memory-layer keys
(with the configured position treatment: 'first' = as if at position 0) and
values are appended to that layer's memory. Memory is per memory layer, per row
and per kv head, held on device in buffers whose capacity doubles as it grows
(so a long run compiles O(log n) shapes, not one per window).

* `dense`: every live memory entry joins the softmax (LongLLaMA's choice);
  `topk`: exact top-k memory entries per query and kv head (the paper's kNN);
  `approx_topk`: jax.lax.approx_max_k per memory chunk, aiming at `recall` (TPU-native);
  `blocks`: InfLLM-style, each window attends to the `block_topk` memory blocks of `block_size`
  slots its queries score best against their `block_reps` representative keys (docs/block_memory.md).
* Generation keeps a key/value cache of the current window: one query per new token
  against cache + memory, the decode loop (sampling included) on device (generation.py);
  a full window moves into memory.
* single_doc: each row is one document; memory is cleared between documents.
  multi_doc: rows are streams of concatenated documents; memory is never cleared.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.generation import decode_loop, first_token, fit_slots, pow2, prefill_window, select_rows
from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MEMORY_MODES, READ_CHUNK, BlockSpec, MemoryBlock

DOC_MODES = ("single_doc", "multi_doc")


def token_nll(logits, targets) -> np.ndarray:
  """Each target's negative log-likelihood under `logits` [..., vocab], in float64 NumPy (perplexity
  and export verification compare these to other frameworks' to the last digits)."""
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "topk", "chunk", "stop_after", "recall"))
def forward_window(params, tokens, token_mask, memories, cfg, mode, topk, chunk, stop_after=None, recall=0.95):
  """One window through the model with memory -> (logits or None, {layer: (keys, values)})."""
  logits, aux = LlamaModel(cfg).apply({"params": params}, tokens, token_mask=token_mask,
                                      memories=memories, mem_mode=mode, mem_topk=topk,
                                      mem_chunk=chunk, want_mem_kv=True, stop_after=stop_after,
                                      mem_recall=recall)
  return logits, aux["mem_kv"]


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))  # in place: a copy per window made long inputs O(n^2)
def _append(buf_k, buf_v, buf_m, k, v, m, at):
  """Writes each row's block at its own offset at[b] (rows fill memory at their own pace)."""
  put = jax.vmap(lambda buf, x, i: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), i, axis=0))
  return put(buf_k, k, at), put(buf_v, v, at), put(buf_m, m, at)


class Memory:
  """Per-layer key/value memory: buffers [B, capacity, KV, D] and a live mask [B, capacity];
  row b holds fill[b] entries (rows differ in batched generation). dtype: of the stored keys
  and values (LongLLaMA's mem_dtype); None: the model's compute dtype. Scores against them
  are float32 either way."""

  def __init__(self, cfg: ModelConfig, batch: int, dtype=None, initial_capacity: int = 1024):
    self.cfg, self.batch = cfg, batch
    self.dtype = jnp.dtype(cfg.dtype if dtype is None else dtype)
    self.initial_capacity = initial_capacity
    self.clear()

  def clear(self):
    self.fill = np.zeros(self.batch, np.int32)
    self.buffers: Dict[int, tuple] = {}

  @property
  def size(self) -> int:
    return int(self.fill.max())

  def _grow(self, need: int):
    cap = self.capacity
    if need <= cap:
      return
    new_cap = max(self.initial_capacity, cap)
    while new_cap < need:
      new_cap *= 2
    kv, d = self.cfg.kv_heads, self.cfg.dim_per_head
    for layer in self.cfg.mem_layers:
      if layer in self.buffers:
        pad = lambda x: jnp.pad(x, [(0, 0), (0, new_cap - cap)] + [(0, 0)] * (x.ndim - 2))
        self.buffers[layer] = tuple(pad(x) for x in self.buffers[layer])
      else:
        self.buffers[layer] = (jnp.zeros((self.batch, new_cap, kv, d), self.dtype),
                               jnp.zeros((self.batch, new_cap, kv, d), self.dtype),
                               jnp.zeros((self.batch, new_cap), bool))

  @property
  def capacity(self) -> int:
    if not self.buffers:
      return 0
    return next(iter(self.buffers.values()))[0].shape[1]

  def add(self, mem_kv: Dict[int, tuple], token_mask, rows=None):
    """Appends one window: mem_kv {layer: (k [B, T, KV, D], v)}; padded tokens stay dead.
    rows: bool [B], the rows that append (default all); the others keep their fill."""
    t = token_mask.shape[1]
    rows = np.ones(self.batch, bool) if rows is None else np.asarray(rows, bool)
    self._grow(self.size + t)
    at = jnp.asarray(self.fill)
    live = jnp.asarray(token_mask) & jnp.asarray(rows)[:, None]
    for layer, (k, v) in mem_kv.items():
      bk, bv, bm = self.buffers[layer]
      self.buffers[layer] = _append(bk, bv, bm, k, v, live, at)
    self.fill = self.fill + t * rows.astype(np.int32)

  def blocks(self) -> Optional[Dict[int, List[MemoryBlock]]]:
    if not self.size:
      return None
    return {layer: [MemoryBlock(k, v, m)] for layer, (k, v, m) in self.buffers.items()}

  def nbytes(self) -> int:
    return sum(int(k.nbytes + v.nbytes + m.nbytes) for k, v, m in self.buffers.values())


def _prompt_rows(prompt):
  """-> (list of 1-D int32 prompts, '1d' | '2d' | 'list')."""
  if isinstance(prompt, (list, tuple)) and len(prompt) and np.ndim(prompt[0]) == 1:
    rows, form = [np.asarray(r, np.int32) for r in prompt], "list"
  else:
    arr = np.asarray(prompt, np.int32)
    if arr.ndim not in (1, 2):
      raise ValueError(f"generate: prompt must be 1-D tokens, [batch, length] tokens or a list of "
                       f"1-D prompts; got shape {arr.shape}")
    rows, form = (([arr], "1d") if arr.ndim == 1 else (list(arr), "2d"))
  if not rows or min(len(r) for r in rows) < 1:
    raise ValueError("generate: every prompt needs at least one token")
  return rows, form


def end_aligned(rows: List[np.ndarray], window: int, tail: int):
  """Rows placed so that each one longer than `tail` ends with exactly `tail` tokens in its last
  window (LongLLaMA's `last_context_length`): masked padding before a row's first token shifts the
  window boundaries, so the end of a prompt (the question) keeps up to `tail` tokens of local
  context instead of however many the length leaves past a boundary. Rows up to `tail` tokens stay
  at 0. -> (tokens [B, W], mask [B, W], pads [B]); W is a multiple of the window."""
  if not 0 < tail <= window:
    raise ValueError(f"inference: last_context_length must be in 1..window ({window}), got {tail}")
  lens = np.array([len(r) for r in rows])
  pads = np.where(lens > tail, (tail - lens) % window, 0)
  return (*_place(rows, window, pads), pads)


def start_aligned(rows: List[np.ndarray], window: int):
  """Rows from column 0 (windows from each row's first token, as `process`) -> (tokens [B, W],
  mask [B, W], pads [B], all 0); W is a multiple of the window."""
  pads = np.zeros(len(rows), int)
  return (*_place(rows, window, pads), pads)


def _place(rows, window: int, pads):
  """Each row at its pad offset, masked elsewhere, in a width that is a multiple of the window."""
  width = -(-int(max(len(r) + p for r, p in zip(rows, pads))) // window) * window
  toks = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, (r, p) in enumerate(zip(rows, pads)):
    toks[i, p:p + len(r)], mask[i, p:p + len(r)] = r, True
  return toks, mask


def generation_layout(prompt, window: int, max_new_tokens: int, temperature: float, top_p: float,
                      last_context_length: Optional[int], eos_token_id):
  """`generate`'s arguments checked and its prompts placed -> (rows, their form, eos ids, (tokens,
  mask, pads) placed as `generate` reads them: `end_aligned` on last_context_length tokens, by
  default the window less the new tokens and at least half of it; 0: `start_aligned`)."""
  rows, form = _prompt_rows(prompt)
  if max_new_tokens < 0:
    raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
  if temperature < 0 or not 0 < top_p <= 1:
    raise ValueError(f"generate: needs temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
  eos = () if eos_token_id is None else tuple(int(e) for e in np.atleast_1d(eos_token_id))
  if last_context_length is None:
    last_context_length = window - min(max_new_tokens, window // 2)
  placed = start_aligned(rows, window) if last_context_length == 0 else end_aligned(rows, window,
                                                                                     last_context_length)
  return rows, form, eos, placed


def generation_result(rows: List[np.ndarray], gen: np.ndarray, form: str):
  """Each prompt with its new tokens gen [B, N], in the prompt's form ('1d', '2d' or 'list')."""
  out = [np.concatenate([r, g]) for r, g in zip(rows, gen)]
  return out[0] if form == "1d" else np.stack(out) if form == "2d" else out


def new_tokens_made(gen: np.ndarray, eos) -> int:
  """New tokens generated, gen [B, N]: a row that wrote an eos counts up to and including it."""
  if not eos or not gen.shape[1]:
    return int(gen.size)
  hit = np.isin(gen, eos)
  return int(np.where(hit.any(1), hit.argmax(1) + 1, gen.shape[1]).sum())


def padded_width(cfg: ModelConfig, window: int, n: int) -> int:
  """A last window of n tokens is padded to a power of two (at least 16); dynamic NTK keeps the
  whole window: its RoPE base depends on the window's length, padding included."""
  if dict(cfg.rope_scaling or ()).get("rope_type") == "dynamic":
    return window
  return min(window, max(16, pow2(n)))


def windows_of(cfg: ModelConfig, window: int, tokens: np.ndarray, token_mask: np.ndarray):
  """(start, n, tokens, mask) of each window from token 0: n real tokens, the last window padded
  (`padded_width`; padding is masked)."""
  for start in range(0, tokens.shape[1], window):
    tok, msk = tokens[:, start:start + window], token_mask[:, start:start + window]
    n = tok.shape[1]
    if n < window:
      width = padded_width(cfg, window, n)
      tok, msk = np.pad(tok, [(0, 0), (0, width - n)]), np.pad(msk, [(0, 0), (0, width - n)])
    yield start, n, tok, msk


class MemoryInference:
  """Window-by-window processing of long inputs with FoT memory."""

  def __init__(self, cfg: ModelConfig, params, window: int, mode: str = "dense", topk: int = 32,
               chunk: int = READ_CHUNK, mem_dtype=None, recall: float = 0.95, block_size: int = 128,
               block_reps: int = 16, block_topk: int = 8):
    if mode not in MEMORY_MODES:
      raise ValueError(f"inference.mode: must be one of {MEMORY_MODES}, got {mode!r}")
    if window <= 0:
      raise ValueError(f"inference.window: must be positive, got {window}")
    self.cfg, self.params, self.window = cfg, params, window
    if not 0 < recall <= 1:
      raise ValueError(f"inference.recall: the approx_topk recall target must be in (0, 1], got {recall}")
    if mode == "blocks":  # the model takes the block parameters where the other modes take topk
      topk = BlockSpec(block_size, block_reps, block_topk).checked()
    self.mode, self.topk, self.chunk, self.mem_dtype = mode, topk, chunk, mem_dtype
    self.recall = recall

  def new_memory(self, batch: int, capacity: int = 1024) -> Memory:
    return Memory(self.cfg, batch, self.mem_dtype, capacity)


  def process(self, tokens, memory: Memory, token_mask=None, want_logits: bool = True,
              stop_after: Optional[int] = None, logits_from: int = 0):
    """tokens [B, L] -> logits [B, L, V] (NumPy; None if not wanted); memory is updated.

    Windows start at token 0; the last one is padded to a power of two (at least 16, at most the
    window; padding is masked and never enters memory, and causal attention makes the padded tail
    change nothing before it), so a short input costs what it needs, not a whole window, and few
    shapes compile (dynamic NTK RoPE: the whole window, see `padded_width`). logits_from: keep
    only the logits of the windows from the one holding that column on ([B, L - s, V] from
    that window's start s): a 16K-token batch's full logits are gigabytes at a 49K vocabulary.
    """
    tokens = np.asarray(tokens, np.int32)
    b, length = tokens.shape
    if b != memory.batch:
      raise ValueError(f"inference: {b} rows but the memory was made for {memory.batch}")
    token_mask = np.ones((b, length), bool) if token_mask is None else np.asarray(token_mask, bool)
    outs = []
    for start, n, tok, msk in windows_of(self.cfg, self.window, tokens, token_mask):
      logits, mem_kv = forward_window(self.params, jnp.asarray(tok), jnp.asarray(msk), memory.blocks(),
                               self.cfg, self.mode, self.topk, self.chunk, stop_after, self.recall)
      memory.add(mem_kv, jnp.asarray(msk))
      if want_logits and logits is not None and start + self.window > logits_from:
        outs.append(np.asarray(logits[:, :n]))
    return np.concatenate(outs, axis=1) if outs else None

  def generate(self, prompt, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, return_logits: bool = False, last_context_length: Optional[int] = None,
               eos_token_id=None):
    """Appends max_new_tokens to each prompt, greedy (temperature 0) or sampled (temperature,
    top_p; jax.random key of `seed`), with a key/value cache of the current window.

    prompt: 1-D tokens, [B, L] tokens, or a list of 1-D prompts of different lengths; the
    result has the same form. The prompt's last `last_context_length` tokens go into the
    current window's cache (LongLLaMA's setting; default: the window less the new tokens, at
    least half of it), the windows before them into memory (`end_aligned`: the first one is
    partial); 0 aligns windows at token 0 instead, like `process`. Each new token is one query
    against cache + memory, and a full cache moves into memory. So the logits behind each token
    equal `process` on that row's sequence so far, placed as here (return_logits: also those
    logits, [B, max_new_tokens, V]). eos_token_id (an id or several): a row that samples one
    stops, its remaining tokens are the (first) eos id and their logits 0; decoding ends when
    every row has. Timings and tokens/s land in `self.stats`.

    The cache holds the prompt's last window plus the new tokens, rounded up to a power of two
    (the whole window only when new tokens cross into the next one): a decode step reads the
    slots in use, not the window's. The decode loop runs on device between window crossings.
    """
    rows, form, eos, (toks, mask, pads) = generation_layout(prompt, self.window, max_new_tokens, temperature,
                                                           top_p, last_context_length, eos_token_id)
    w, batch = self.window, len(rows)
    lens = np.array([len(r) for r in rows])
    ends = lens + pads  # a row's end in the placed tokens
    full = (ends - 1) // w  # windows that go to memory; the last (1..w tokens) goes to the cache
    fill = (ends - full * w).astype(np.int32)
    # Decoding feeds max_new_tokens - 1 tokens: a row past its window needs the whole window as
    # cache, else the slots in use; memory is sized once for prompt and new tokens (one shape).
    steps = max(max_new_tokens, 1) - 1
    slots = w if (fill + steps > w).any() else min(w, pow2(int((fill + steps).max())))
    memory = self.new_memory(batch, pow2(int((ends + steps - 1).max()) // w * w))
    args = (self.cfg, self.mode, self.topk, self.chunk, self.recall)
    cache = last = None
    t0 = time.perf_counter()
    for win in range(full.max() + 1):
      current, to_memory = win == full, win < full
      cols = slice(win * w, (win + 1) * w)
      if not current.any():  # memory only: its layers' keys and values (none: nothing to keep)
        if self.cfg.mem_layers:
          _, mem_kv = forward_window(self.params, jnp.asarray(toks[:, cols]), jnp.asarray(mask[:, cols]),
                                     memory.blocks(), *args[:4], max(self.cfg.mem_layers), self.recall)
          memory.add(mem_kv, jnp.asarray(mask[:, cols]), rows=to_memory)
        continue
      # A window that only holds current windows runs on a power-of-two prefix (causal: the
      # padded tail changes nothing before it).
      n = w if to_memory.any() else min(w, pow2(int(fill[current].max())))
      cols = slice(win * w, win * w + n)
      logits, mem_kv, win_cache = prefill_window(self.params, jnp.asarray(toks[:, cols]),
                                                 jnp.asarray(mask[:, cols]), memory.blocks(),
                                                 jnp.asarray(np.where(current, fill - 1, 0)), *args)
      win_cache = fit_slots(win_cache, slots)
      sel = jnp.asarray(current)
      cache = win_cache if cache is None else select_rows(sel, win_cache, cache)
      last = logits if last is None else select_rows(sel, logits, last)
      if to_memory.any():
        memory.add(mem_kv, jnp.asarray(mask[:, cols]), rows=to_memory)
    jax.block_until_ready((last, cache, memory.buffers))
    t1 = time.perf_counter()
    width = pow2(max_new_tokens)  # buffers in power-of-two sizes: few compiled shapes
    gen = jnp.full((batch, width), eos[0] if eos else 0, jnp.int32)  # what rows past their eos hold
    seen = jnp.zeros((batch, width, last.shape[-1]), jnp.float32) if return_logits else None
    key = jax.random.key(seed)
    how = dict(greedy=temperature <= 0, nucleus=top_p < 1, eos=eos)
    temp, top = jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p)
    step, done = 0, np.zeros(batch, bool)
    if max_new_tokens:
      gen, seen, done = first_token(last, gen, seen, key, temp, top, **how)
      step, done = 1, np.asarray(done)
    # One query per row: its scores against cache and memory are [B, H, slots], so they are
    # taken densely and memory in one block of `chunk` (blocks of 512 cost several times more
    # on CPU per step); `attention_impl` / `attention_block` are for long windows' scores.
    decode_cfg = dataclasses.replace(self.cfg, attention_impl="dense",
                                     attention_block=max(self.cfg.attention_block, self.chunk))
    fill = jnp.asarray(fill)
    while step < max_new_tokens and not done.all():
      moving = np.asarray(fill) == w  # a full window moves into memory; the token opens the next one
      if moving.any():
        mem_kv = {layer: (cache[layer][2], cache[layer][1]) for layer in self.cfg.mem_layers}
        memory.add(mem_kv, jnp.ones((batch, w), bool), rows=moving)
        fill = jnp.where(jnp.asarray(moving), 0, fill)
      cache, fill, gen, seen, at, done = decode_loop(
          self.params, cache, fill, memory.blocks(), gen, seen, jnp.int32(step), jnp.asarray(done),
          jnp.int32(max_new_tokens), key, temp, top, decode_cfg, *args[1:], window=w, **how)
      step, done = int(at), np.asarray(done)
    gen = np.asarray(gen[:, :max_new_tokens])
    t2 = time.perf_counter()
    made = new_tokens_made(gen, eos)
    self.stats = {"prompt_tokens": int(lens.sum()), "new_tokens": made, "prefill_s": t1 - t0,
                  "decode_s": t2 - t1, "tokens_per_s": made / max(t2 - t1, 1e-9), "cache_slots": slots}
    logging.info("generate: %d prompt tokens in %.2f s, %d new tokens at %.1f tokens/s", lens.sum(),
                 t1 - t0, made, self.stats["tokens_per_s"])
    out = generation_result(rows, gen, form)
    if not return_logits:
      return out
    return out, np.asarray(seen[:, :max_new_tokens])

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
