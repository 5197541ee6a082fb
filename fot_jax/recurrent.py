"""Recurrent training memory: the Memorizing Transformer and Transformer-XL baselines.

FoT's memory layers learn from other rows of the batch, with gradients (crossbatch). The two
baselines of the FoT paper instead carry what earlier windows left behind, as constants:

* memorizing (Wu et al., 2022): each memory layer attends, besides its causal window, to a kNN
  memory (top-k per query and kv head, or all of it with topk=0) of the same document's earlier
  windows: up to `memory_tokens` keys/values per slot, kept from earlier windows and earlier
  steps, never differentiated, no crossbatch negatives. One softmax over window and retrieved
  keys (FoT's), or the model's `mem_gating` (the paper's gate). Memory keys get the memory
  layer's position treatment (`mem_positions`), as at inference.
* transformer_xl (Dai et al., 2019): every layer also attends to the previous window's keys and
  values (a stop-gradient segment cache), with relative positions: the cached window sits just
  before the current one.

A step's batch is the slots' packs of `windows` consecutive windows (the doc-pinned slot
batches FoT trains on; batch n + 1 continues each slot's stream). The step runs the pack
positions in order, each one forward over all slots, and what window j leaves is what window
j + 1 sees; the last window's carry goes into the next step (the `carry` beside the train state,
checkpointed with it). So a slot's windows are seen in stream order, whatever `windows` is.

Document boundaries (memorizing): a row attends only to memory entries of the document its last
token belongs to (`doc_ids`; a batch without them holds one document per slot and step, as the
copy and dictionary tasks do), so its memory is always its own document's earlier tokens; the
tokens of a document that ends inside the window see no memory. transformer_xl, like the local
window, does not look at documents: its segment is the slot's previous window.

Spec (a curriculum phase's spec, in place of a crossbatch spec):
  {'memory': 'memorizing', 'windows': k, 'memory_tokens': M, 'topk': 32}
  {'memory': 'transformer_xl', 'windows': k}
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MemoryBlock

KINDS = ("memorizing", "transformer_xl")
SPEC_FIELDS = ("memory", "windows", "memory_tokens", "topk")


class RecurrentSpec(NamedTuple):
  """A recurrent phase's settings (hashable: a static argument of the jitted step)."""
  kind: str
  windows: int = 1  # k: consecutive windows of a slot per step
  memory_tokens: int = 0  # memorizing: memory entries per slot (a multiple of the window)
  topk: int = 32  # memorizing: retrieved keys per query and kv head (0: attend to all of memory)


def is_recurrent(spec) -> bool:
  return bool(spec) and spec.get("memory") is not None


def recurrent_spec(spec) -> Optional[RecurrentSpec]:
  """The RecurrentSpec of a curriculum spec, or None for a crossbatch / empty spec; a bad field
  is a ValueError naming it."""
  if not is_recurrent(spec):
    return None
  spec = dict(spec)
  unknown = sorted(set(spec) - set(SPEC_FIELDS))
  if unknown:
    raise ValueError(f"curriculum spec {spec}: a recurrent-memory spec takes only {list(SPEC_FIELDS)}, "
                     f"not {unknown} (crossbatch and recurrent memory do not mix in one phase)")
  kind = spec["memory"]
  if kind not in KINDS:
    raise ValueError(f"curriculum spec.memory: must be one of {KINDS}, got {kind!r}")
  out = RecurrentSpec(kind, int(spec.get("windows", 1)), int(spec.get("memory_tokens", 0)),
                      int(spec.get("topk", 32)))
  if out.windows < 1:
    raise ValueError(f"curriculum spec.windows: must be >= 1, got {out.windows}")
  if kind == "memorizing":
    if out.memory_tokens <= 0:
      raise ValueError("curriculum spec.memory_tokens: the memorizing kind needs a memory size > 0 "
                       "(entries per slot, a multiple of the window)")
    if out.topk < 0:
      raise ValueError(f"curriculum spec.topk: must be >= 0 (0: all of memory), got {out.topk}")
  elif "memory_tokens" in spec or "topk" in spec:
    raise ValueError("curriculum spec: memory_tokens / topk are memorizing settings; transformer_xl's "
                     "segment is the previous window")
  return out


def check(rspec: RecurrentSpec, cfg: ModelConfig, window: int) -> None:
  """Fails before tracing when the model or window cannot run `rspec`."""
  if rspec.kind == "memorizing":
    if not cfg.mem_layers:
      raise ValueError("curriculum spec.memory='memorizing' needs memory layers (model.mem_layers is empty)")
    if rspec.memory_tokens % window:
      raise ValueError(f"curriculum spec.memory_tokens: {rspec.memory_tokens} is not a multiple of the "
                       f"window {window}")
  if cfg.position_strategy:
    raise ValueError("model.position_strategy: not supported with recurrent-memory training")


def _layers(cfg: ModelConfig, rspec: RecurrentSpec):
  return cfg.mem_layers if rspec.kind == "memorizing" else tuple(range(cfg.num_layers))


def init_carry(cfg: ModelConfig, rspec: RecurrentSpec, slots: int, window: int) -> Dict[str, tuple]:
  """The empty carry of `slots` slots: {'layers_i': (keys, values, live)}; keys/values
  [slots, M, KV, D] in the compute dtype; live: the memorizing kind's document id per entry
  (int32, -1 empty), transformer_xl's token mask (bool)."""
  check(rspec, cfg, window)
  dtype = jnp.dtype(cfg.dtype)
  size = rspec.memory_tokens if rspec.kind == "memorizing" else window
  shape = (slots, size, cfg.kv_heads, cfg.dim_per_head)

  def build():  # jitted: every leaf its own buffer (the step donates the carry)
    live = (jnp.full((slots, size), -1, jnp.int32) if rspec.kind == "memorizing" else
            jnp.zeros((slots, size), bool))
    return {f"layers_{i}": (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), live) for i in _layers(cfg, rspec)}
  return jax.jit(build)()


def window_forward(model, params, rspec: RecurrentSpec, tokens, doc, carry):
  """One window of every slot: tokens/doc [S, T] -> (logits [S, T, V], the carry after it)."""
  sg = jax.lax.stop_gradient
  carry = jax.tree_util.tree_map(sg, carry)
  if rspec.kind == "transformer_xl":
    prev = {int(name.split("_")[1]): c for name, c in carry.items()}
    logits, aux = model.apply({"params": params}, tokens, prev=prev)
    live = jnp.ones(tokens.shape, bool)
    return logits, {f"layers_{i}": (sg(k), sg(v), live) for i, (k, v) in aux["prev_kv"].items()}
  own = doc[:, -1:]  # the document of the row's last token
  memories = {int(name.split("_")[1]): [MemoryBlock(k, v, (d == own) & (d >= 0))]
              for name, (k, v, d) in carry.items()}
  logits, aux = model.apply({"params": params}, tokens, memories=memories,
                            mem_mode="topk" if rspec.topk else "dense", mem_topk=max(rspec.topk, 1),
                            want_mem_kv=True)
  t = tokens.shape[1]
  out = {}
  for name, (k, v, d) in carry.items():
    nk, nv = aux["mem_kv"][int(name.split("_")[1])]
    out[name] = (jnp.concatenate([k[:, t:], sg(nk).astype(k.dtype)], 1),
                 jnp.concatenate([v[:, t:], sg(nv).astype(v.dtype)], 1),
                 jnp.concatenate([d[:, t:], doc.astype(jnp.int32)], 1))
  return logits, out


def recurrent_sums(model, params, rspec: RecurrentSpec, loss_sums: Callable, inputs, targets, mask, acc_mask,
                   doc, carry):
  """The loss sums of rows [S * k, T] (row = slot * k + j), their k windows run in order:
  -> ((loss sum, correct, accuracy count, loss count), carry after the last window)."""
  k = rspec.windows
  rows, t = inputs.shape
  if rows % k:
    raise ValueError(f"recurrent memory: {rows} rows are not whole packs of {k} windows")

  def by_window(x):  # [S * k, T] -> [k, S, T]
    return jnp.swapaxes(x.reshape((rows // k, k) + x.shape[1:]), 0, 1)

  def body(c, xs):
    tok, tgt, m, am, d = xs
    logits, c = window_forward(model, params, rspec, tok, d, c)
    loss_sum, _, count = loss_sums(logits, tgt, m)
    _, correct, acc_count = loss_sums(jax.lax.stop_gradient(logits), tgt, am)
    return c, jnp.stack([loss_sum, correct, acc_count, count])

  carry, sums = jax.lax.scan(body, carry, tuple(by_window(x) for x in (inputs, targets, mask, acc_mask, doc)))
  return tuple(jnp.sum(sums, 0)), carry


def step_doc_ids(batch, step: int, windows: int) -> np.ndarray:
  """The batch's doc_ids, or (a batch without them: one document per slot and step) slot and step
  numbered ids, unique over the run."""
  if "doc_ids" in batch:
    return np.asarray(batch["doc_ids"])
  rows, t = batch["inputs"].shape
  slots = rows // windows
  ids = step * slots + np.arange(slots)
  return np.broadcast_to(np.repeat(ids, windows)[:, None], (rows, t)).astype(np.int32)


class XLMemory:
  """Transformer-XL's state at inference: the last window's keys/values of every layer."""

  def __init__(self, cfg: ModelConfig, batch: int, window: int):
    self.batch = batch
    self.carry = init_carry(cfg, RecurrentSpec("transformer_xl"), batch, window)


class XLInference:
  """MemoryInference's interface (new_memory / process) for a Transformer-XL model: windows of
  `window` tokens in order, each attending to the previous window's cached keys/values in every
  layer; the evaluation suites (perplexity, passkey) run on it unchanged. Only the input's last
  window may be partial (padded at its end): a window after a partial one would see its cache
  at the wrong distance, so process() refuses to continue after one."""

  def __init__(self, cfg: ModelConfig, params, window: int):
    self.cfg, self.params, self.window = cfg, params, int(window)
    model = LlamaModel(cfg)

    def forward(params, tokens, mask, carry):
      prev = {int(name.split("_")[1]): c for name, c in carry.items()}
      logits, aux = model.apply({"params": params}, tokens, token_mask=mask, prev=prev)
      return logits, {f"layers_{i}": (k, v, mask) for i, (k, v) in aux["prev_kv"].items()}
    self._forward = jax.jit(forward)

  def new_memory(self, batch: int) -> XLMemory:
    return XLMemory(self.cfg, batch, self.window)

  def process(self, tokens, memory: XLMemory, token_mask=None, want_logits: bool = True, logits_from: int = 0):
    tokens = np.asarray(tokens, np.int32)
    b, length = tokens.shape
    if b != memory.batch:
      raise ValueError(f"inference: {b} rows but the memory was made for {memory.batch}")
    if getattr(memory, "partial", False):
      raise ValueError("transformer_xl inference: the previous call ended in a partial window; its cache "
                       "would sit at the wrong distance")
    token_mask = np.ones((b, length), bool) if token_mask is None else np.asarray(token_mask, bool)
    outs = []
    for start in range(0, length, self.window):
      tok, msk = tokens[:, start:start + self.window], token_mask[:, start:start + self.window]
      n = tok.shape[1]
      if n < self.window:
        tok, msk = (np.pad(x, [(0, 0), (0, self.window - n)]) for x in (tok, msk))
        memory.partial = True
      logits, memory.carry = self._forward(self.params, jnp.asarray(tok), jnp.asarray(msk), memory.carry)
      if want_logits and start + self.window > logits_from:
        outs.append(np.asarray(logits[:, :n]))
    return np.concatenate(outs, axis=1) if outs else None
