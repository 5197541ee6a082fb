"""A study method as the evaluation suites see it: a suite Context with the method's model config,
parameters and inference path (PlainInference for a long-context forward, MemoryInference for FoT
memory inference, with the method's own memory retrieval)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from fot_jax.eval import suite as suite_lib
from fot_jax.inference import Memory, MemoryInference, forward_window
from fot_jax.model.memory import READ_CHUNK
from fot_jax.study.settings import MethodSpec


class PlainInference:
  """MemoryInference's interface for a long-context forward: each `process` call is one window as
  wide as its input rounded up to a multiple of `pad` and of 1/16 of the next power of two (masked
  padding at the end; at most ~6% over), so all suites of a method share a few compiled widths
  (a power of two would double a 16,390-token prompt to 32,768). (Dynamic NTK measures the padded width.)

  The model is the method's, memory layers included, with an empty memory: what the model
  computes on the window alone. (A memory layer without memory is not always a plain layer:
  with mem_positions='none' it applies no RoPE at all, with mem_qk_norm it normalises q and k.)
  The plain path reads no memory: `memory` is never read or written, so each call sees its own
  input only, however the caller reuses a memory object."""

  def __init__(self, cfg, params, pad: int = 64, chunk: int = READ_CHUNK):
    self.cfg, self.params, self.pad, self.chunk = cfg, params, int(pad), chunk
    self.window = 0

  def new_memory(self, batch: int):
    return Memory(self.cfg, batch)

  def process(self, tokens, memory, token_mask=None, want_logits: bool = True, logits_from: int = 0):
    """tokens [B, L] -> logits [B, L, V] of one causal window over the whole input (None if not
    wanted). `memory` and `logits_from` are accepted for MemoryInference's interface; one window
    holds every column, so all logits are kept."""
    del memory, logits_from
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    mask = np.ones((b, t), bool) if token_mask is None else np.asarray(token_mask, bool)
    width = plain_width(t, self.pad)
    tok = np.pad(tokens, [(0, 0), (0, width - t)])
    msk = np.pad(mask, [(0, 0), (0, width - t)])
    logits, _ = forward_window(self.params, jnp.asarray(tok), jnp.asarray(msk), None, self.cfg, "dense", 1,
                               self.chunk)
    return np.asarray(logits[:, :t]) if want_logits else None


def plain_width(t: int, pad: int) -> int:
  """The compiled width for t tokens: t rounded up to a multiple of max(pad, next power of two / 16)."""
  step = max(pad, (1 << max(t - 1, 0).bit_length()) // 16)
  return -(-max(t, 1) // step) * step


def method_context(base: suite_lib.Context, method: MethodSpec, pad: int, params=None) -> suite_lib.Context:
  """A suite Context for one method: the loaded base (its vocabulary, data and suite settings) with
  the method's config, window, name and inference (and `params` instead of the base's: a
  fine-tuned method); the suite runners of fot_jax/eval/suite.py then run on it unchanged. A
  method's own `memory` retrieval wins over the suite settings' mode and topk."""
  cfg = method.model_config(base.cfg)
  if method.inference == "memory" and not cfg.mem_layers:
    raise ValueError(f"study method {method.name!r}: inference 'memory' needs mem_layers")
  params = base.params if params is None else params
  window = method.window or base.window  # the memory path's local window
  s = base.settings
  if method.inference == "plain":
    inference = PlainInference(cfg, params, pad, s.chunk)
  else:
    retrieval = method.memory.to_dict() if method.memory else {"mode": s.mode}
    # the rest: a block mode's block_size, block_reps, block_topk
    inference = MemoryInference(cfg, params, window, retrieval.pop("mode"), retrieval.pop("topk", s.topk), s.chunk,
                                **retrieval)
  return dataclasses.replace(base, cfg=cfg, params=params, window=window, name=method.name, own_inference=inference)
