"""A plain PyTorch reference of LongLLaMA-style memory inference on an exported directory.

It reads what `export_hf` writes (config.json + safetensors) and runs the same
semantics as fot_jax.inference, written independently of it:
* the input is cut into windows of `max_position_embeddings` tokens from token 0;
  positions restart at 0 in every window; ordinary layers see only the causal window;
* a memory layer (config `mem_layers`) also sees the keys/values of all earlier
  windows (dense: every memory entry), under one softmax with the causal window;
  memory keys are rotated as if at position 0 (`mem_positionals: true`; under YaRN that is
  the key times its attention factor, as transformers treats a key at 0) or, with
  `mem_positionals: false`, the memory layer uses no rotation at all;
* RoPE (and its scaling) comes from transformers' own tables for the config.json.
So a user running an exported model in PyTorch gets fot_jax's logits.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from fot_jax.checkpoint import ConvertError, read_json
from fot_jax.convert.hf_files import WeightReader


def _rms(x, w, eps):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(config, seq_len):
  """transformers' own RoPE tables for config.json (any rope_type it knows): (inv_freq, cos/sin
  multiplier); seq_len is the current length (dynamic NTK)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
  kind = config.rope_parameters["rope_type"]
  if kind == "default":
    return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
  return ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)


def _rope(x, positions, rope):
  """x [B, T, H, D], positions [T], rope (inv_freq, multiplier); HF rotate-half layout."""
  d = x.shape[-1]
  inv, scale = rope
  freqs = positions.float()[:, None] * inv
  emb = torch.cat([freqs, freqs], -1)
  cos, sin = emb.cos()[None, :, None, :] * scale, emb.sin()[None, :, None, :] * scale
  half = d // 2
  rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


class TorchMemoryLlama:
  """Exported directory -> logits with memory, in float32 PyTorch."""

  def __init__(self, directory: str):
    config_path = os.path.join(directory, "config.json")
    self.config = c = read_json(config_path)
    if c.get("fot_jax"):
      raise ConvertError(f"{directory}: an fot_jax-only export; the reference runs plain LLaMA weights")
    try:
      self._read_config(c)
    except KeyError as e:
      raise ConvertError(f"{config_path}: missing field {e.args[0]}") from None
    except (TypeError, ValueError) as e:
      raise ConvertError(f"{config_path}: {e}") from None
    reader = WeightReader(directory)
    self.w = {name: torch.from_numpy(reader.get(name)) for name in reader.names()}
    if c.get("tie_word_embeddings"):
      self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]

  def _read_config(self, c: dict):
    self.vocab_size = int(c["vocab_size"])
    self.layers = c["num_hidden_layers"]
    self.heads, self.kv_heads = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
    from transformers import LlamaConfig
    self.hf_config = LlamaConfig(**c)  # RoPE as transformers reads it (scaling included)
    self.eps = float(c["rms_norm_eps"])
    self.window = int(c.get("last_context_length") or c["max_position_embeddings"])  # fot_jax exports both
    self.mem_layers = set(c.get("mem_layers") or ())
    self.mem_positionals = bool(c.get("mem_positionals", True))

  def _attention(self, i, x, memory, rope_len):
    """x [B, T, H*D] (normed); memory (k [B, M, KV, D], v) or None -> (out, (k_mem, v))."""
    p = f"model.layers.{i}.self_attn."
    b, t, _ = x.shape
    h, kv, d = self.heads, self.kv_heads, self.head_dim
    q = (x @ self.w[p + "q_proj.weight"].T).view(b, t, h, d)
    k = (x @ self.w[p + "k_proj.weight"].T).view(b, t, kv, d)
    v = (x @ self.w[p + "v_proj.weight"].T).view(b, t, kv, d)
    is_mem = i in self.mem_layers
    rotate = not (is_mem and not self.mem_positionals)
    pos = torch.arange(t)
    rope = _inv_freq(self.hf_config, rope_len or t)
    k_mem = _rope(k, torch.zeros(t, dtype=torch.long), rope) if rotate else k
    if rotate:
      q, k = _rope(q, pos, rope), _rope(k, pos, rope)
    keys, values = k, v
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    if is_mem and memory is not None:
      mk, mv = memory
      keys, values = torch.cat([mk, k], 1), torch.cat([mv, v], 1)
      mask = torch.cat([torch.ones(t, mk.shape[1], dtype=torch.bool), mask], 1)  # memory fully visible
    g = h // kv  # query head j reads kv head j // g, as HF's repeat_kv
    keys, values = keys.repeat_interleave(g, 2), values.repeat_interleave(g, 2)
    s = torch.einsum("bthd,bshd->bhts", q, keys) * d ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", s.softmax(-1), values).reshape(b, t, h * d)
    return out @ self.w[p + "o_proj.weight"].T, (k_mem, v)

  def window_forward(self, tokens, memories: Dict[int, Tuple],
                     rope_len: Optional[int] = None) -> Tuple[torch.Tensor, Dict[int, Tuple]]:
    """tokens [B, T] (T <= window) -> logits [B, T, V] and this window's memory-layer (k, v).
    rope_len: the length dynamic NTK scales for (default T; fot_jax pads every window to the
    window length, so logits_with_memory passes the window)."""
    x = self.w["model.embed_tokens.weight"][tokens]
    new = {}
    for i in range(self.layers):
      p = f"model.layers.{i}."
      a, new_kv = self._attention(i, _rms(x, self.w[p + "input_layernorm.weight"], self.eps), memories.get(i),
                                  rope_len)
      if i in self.mem_layers:
        new[i] = new_kv
      x = x + a
      hdn = _rms(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
      gate = torch.nn.functional.silu(hdn @ self.w[p + "mlp.gate_proj.weight"].T)
      x = x + (gate * (hdn @ self.w[p + "mlp.up_proj.weight"].T)) @ self.w[p + "mlp.down_proj.weight"].T
    x = _rms(x, self.w["model.norm.weight"], self.eps)
    return x @ self.w["lm_head.weight"].T, new

  @torch.no_grad()
  def logits_with_memory(self, tokens, window: Optional[int] = None) -> np.ndarray:
    """tokens [B, L] -> float32 [B, L, V], window by window with dense memory."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    window = window or self.window
    memories, outs = {}, []
    for start in range(0, tokens.shape[1], window):
      logits, new = self.window_forward(tokens[:, start:start + window], memories, window)
      outs.append(logits)
      for i, (k, v) in new.items():
        old = memories.get(i)
        memories[i] = (k, v) if old is None else (torch.cat([old[0], k], 1), torch.cat([old[1], v], 1))
    return torch.cat(outs, 1).numpy()
