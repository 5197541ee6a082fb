"""Retrieval-head probe: per-layer, per-head copy scores on in-window retrieval prompts.

A prompt is filler text holding one fact (the needle: "Keep in mind: the locker code of {key}
is {value}.", a random key word and a random 5-7 digit value), more filler, a question whose
answer is the value, and the answer itself: teacher forcing, one forward pass, the whole prompt
in one window, no memory. At each position that predicts an answer token (position i predicts
token i + 1), a head *copies* when the argmax of its attention over keys lands on a needle
position holding the token being predicted. A head's copy score is the fraction of answer tokens
(over all prompts) where it copies: the argmax form of the retrieval score of Wu et al. 2024
("Retrieval Head Mechanistically Explains Long-Context Factuality").

Attention weights are recomputed from the model's own projections: one forward pass captures
every layer's q_proj / k_proj outputs (flax capture_intermediates); the layer's own transforms
then follow as in fot_jax.model.attention (memory-layer q/k norm and temperature, RoPE variant
or none, position strategy, GQA sharing). Memory layers are plain attention here: no memory.

`pick_layers`: the n layers whose best head copies most often, ties broken by the layer's mean
head score, then by the lower layer index (`--mem_layers=auto:N`, `resolve_auto_layers`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from data_pipelines import vocab as vocab_lib
from fot_jax.convert.api import from_pretrained
from fot_jax.cli import parse_auto
from fot_jax.eval.report import plot_heads
from fot_jax.model import position_strategies
from fot_jax.model.config import ModelConfig
from fot_jax.model.llama import LlamaModel
from fot_jax.model.rope import apply_rope

# The probe's own filler: plain narrative sentences (no digits, none of the key words).
_SUBJECTS = ("the old miller", "a tired courier", "the harbour clerk", "my neighbour", "the night guard",
             "a young painter", "the ferryman", "our teacher", "the baker's son", "a quiet stranger")
_VERBS = ("carried", "painted", "found", "repaired", "described", "watched", "sold", "followed",
          "cleaned", "forgot")
_OBJECTS = ("a wooden crate", "the blue lantern", "an empty basket", "the broken fence", "a long letter",
            "the village map", "a pair of boots", "the green door", "a heavy coat", "the garden gate")
_PLACES = ("near the river", "behind the bakery", "before sunrise", "on the hill road", "at the market",
           "after the storm", "by the old mill", "during the fair", "under the bridge", "in the square")
KEYS = ("amber", "cobalt", "juniper", "saffron", "orchid", "granite", "willow", "falcon", "maple",
        "quartz", "hazel", "indigo", "copper", "lotus", "ember", "tundra")
MEMORY_ONLY_PARAMS = ("inv_temperature", "mem_gate")  # a memory layer's extra parameters


def needle(key: str, value: str) -> str:
  return f"Keep in mind: the locker code of {key} is {value}.\n"


def question(key: str) -> str:
  return f"Question: what is the locker code of {key}? Answer: the locker code of {key} is"


def _sentence(rng: np.random.Generator) -> str:
  s = " ".join(str(xs[int(rng.integers(len(xs)))]) for xs in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES)) + "."
  return s[0].upper() + s[1:]


def _ids(vocab, text: str) -> List[int]:
  return [int(x) for x in vocab.encode(text)] if text else []


def _filler(vocab, rng: np.random.Generator, tokens: int) -> List[str]:
  """Sentences of about `tokens` tokens in all (counted one by one, with their separating space)."""
  out, used = [], 0
  while True:
    s = _sentence(rng)
    n = len(_ids(vocab, " " + s))
    if used + n + 1 > tokens:  # + 1: the line break that ends a piece
      return out
    out.append(s)
    used += n


@dataclasses.dataclass
class Prompt:
  ids: np.ndarray  # bos + prompt + answer
  needle: Tuple[int, int]  # the needle's token span [start, end)
  answer_start: int  # index of the first answer token
  text: str


def make_prompt(vocab, length: int, rng: np.random.Generator) -> Prompt:
  """A probe prompt of about `length` tokens, the needle after 10-60% of the filler's sentences.
  Its pieces are encoded apart and joined (each ends in a line break, where tokenizers split
  anyway), so the needle's span is exact; the answer is split off as retrieval.encode does."""
  key = KEYS[int(rng.integers(len(KEYS)))]
  digits = int(rng.integers(5, 8))
  value = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
  fact, ask = _ids(vocab, needle(key, value)), question(key)
  ask_ids, full = _ids(vocab, ask), _ids(vocab, ask + " " + value)
  answer = full[len(ask_ids):] if full[:len(ask_ids)] == ask_ids else _ids(vocab, " " + value)
  budget = length - 1 - len(fact) - len(ask_ids) - len(answer)
  if budget < 0:
    raise ValueError(f"heads: length {length} is too short for a probe prompt (needle, question and "
                     f"answer take {length - budget} tokens)")
  filler = _filler(vocab, rng, budget)
  cut = int(round(len(filler) * rng.uniform(0.1, 0.6)))
  cut = min(max(cut, 1), len(filler) - 1) if len(filler) > 1 else cut  # filler on both sides when it can
  before, after = (" ".join(part) + "\n" if part else "" for part in (filler[:cut], filler[cut:]))
  head = [int(vocab.bos_id)] + _ids(vocab, before)
  ids = head + fact + _ids(vocab, after) + ask_ids + answer
  return Prompt(np.asarray(ids, np.int32), (len(head), len(head) + len(fact)), len(ids) - len(answer),
                before + needle(key, value) + after + ask + " " + value)


def _capture(module, method) -> bool:  # only the q/k projections
  return method == "__call__" and module.name in ("q_proj", "k_proj")


def _normalize(x, eps=1e-6):  # fot_jax.model.attention._normalize, in float32
  return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + eps)


def _layer_scores(cfg: ModelConfig, params, tokens, token_mask):
  """-> per layer, the scaled attention scores [B, H, T, T] float32, -inf where a key is not visible."""
  cfg = dataclasses.replace(cfg, remat=False)  # a plain module tree for capture_intermediates
  b, t = tokens.shape
  _, state = LlamaModel(cfg).apply({"params": params}, tokens, token_mask=token_mask,
                                   stop_after=cfg.num_layers - 1, capture_intermediates=_capture,
                                   mutable=["intermediates"])
  h, kv, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None] & token_mask[:, None, :]  # [B, T, T]
  for i in range(cfg.num_layers):
    att = state["intermediates"][f"layers_{i}"]["self_attn"]
    q = att["q_proj"]["__call__"][0].astype(jnp.float32).reshape(b, t, h, d)
    k = att["k_proj"]["__call__"][0].astype(jnp.float32).reshape(b, t, kv, d)
    memory_layer, scale, visible = i in cfg.mem_layers, d ** -0.5, causal
    if memory_layer and cfg.mem_qk_norm:  # as Attention: unit q/k, a learnt temperature per head
      q, k = _normalize(q), _normalize(k)
      q = q * params[f"layers_{i}"]["self_attn"]["inv_temperature"][:, None]
      scale = 1.0
    rotate = not (memory_layer and cfg.mem_positions == "none")
    if rotate and cfg.position_strategy:  # Self-Extend / LM-Infinite: their own scores and visibility
      s, seen = position_strategies.local_scores(cfg, q, k, positions, scale)
      s, visible = s.reshape(b, h, t, t), visible & seen[:, 0, 0]
    else:
      if rotate:
        q, k = apply_rope(q, positions, cfg), apply_rope(k, positions, cfg)
      # GQA: query head j reads kv head j // (h / kv), as Attention's [KV, G] reshape
      s = jnp.einsum("bthd,bshd->bhts", q * scale, jnp.repeat(k, h // kv, axis=2))
    yield jnp.where(visible[:, None], s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _weights(params, tokens, token_mask, cfg):
  return jnp.stack([jax.nn.softmax(s, -1) for s in _layer_scores(cfg, params, tokens, token_mask)])


@functools.partial(jax.jit, static_argnames=("cfg",))
def _argmax_keys(params, tokens, token_mask, cfg):  # argmax of the scores = argmax of the weights
  return jnp.stack([jnp.argmax(s, -1).astype(jnp.int32) for s in _layer_scores(cfg, params, tokens, token_mask)])


def attention_weights(cfg: ModelConfig, params, tokens, token_mask=None) -> np.ndarray:
  """tokens [B, T] -> attention weights [layers, B, heads, T (query), T (key)] float32."""
  tokens = jnp.asarray(tokens, jnp.int32)
  mask = jnp.ones(tokens.shape, bool) if token_mask is None else jnp.asarray(token_mask, bool)
  return np.asarray(_weights(params, tokens, mask, cfg))


def rank_layers(scores) -> List[int]:
  """Layers best first: by their best head's score, then their mean head score, then lower index."""
  s = np.asarray(scores, np.float64)
  return sorted(range(len(s)), key=lambda layer: (-s[layer].max(), -s[layer].mean(), layer))


def pick_layers(scores: dict, n: int) -> tuple:
  """The n layers whose best head copies most often (ties: the layer's mean head score, then the
  lower layer index), sorted ascending. scores: copy_scores' result (its 'scores' table)."""
  table = scores["scores"]
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= len(table):
    raise ValueError(f"heads: pick 1..{len(table)} layers, got {n!r}")
  return tuple(sorted(rank_layers(table)[:int(n)]))


def copy_scores(cfg: ModelConfig, params, vocab, n_prompts: int = 8, length: int = 384, seed: int = 0,
                batch: int = 4, name: str = "") -> dict:
  """Copy score of every head of `cfg`/`params` over n_prompts seeded probe prompts (`vocab` encodes
  them). Returns {'scores' [layers][heads], 'layer_scores' (best head per layer), 'ranking' (layers
  best first), 'top_heads' ([layer, head, score], best 8), 'answer_tokens', 'prompt_tokens' (mean),
  'prompts' (the first 2 texts), 'n_prompts', 'length', 'seed'}."""
  if n_prompts < 1:
    raise ValueError(f"heads: n_prompts must be positive, got {n_prompts}")
  t0 = time.time()
  rng = np.random.default_rng([int(seed), 1729])
  prompts = [make_prompt(vocab, int(length), rng) for _ in range(int(n_prompts))]
  top_id = max(int(p.ids.max()) for p in prompts)
  if top_id >= cfg.vocab_size:
    raise ValueError(f"heads: token id {top_id} is outside the model's vocabulary of {cfg.vocab_size}")
  width, batch = max(len(p.ids) for p in prompts), min(int(batch), len(prompts))
  hits = np.zeros((cfg.num_layers, cfg.num_heads))
  total = 0
  for s in range(0, len(prompts), batch):
    group = prompts[s:s + batch]
    rows = group + group[:1] * (batch - len(group))  # one compiled shape for every batch
    toks, mask = np.zeros((batch, width), np.int32), np.zeros((batch, width), bool)
    for r, p in enumerate(rows):
      toks[r, :len(p.ids)], mask[r, :len(p.ids)] = p.ids, True
    src = np.asarray(_argmax_keys(params, jnp.asarray(toks), jnp.asarray(mask), cfg))  # [L, B, H, T]
    for r, p in enumerate(group):
      lo, hi = p.needle
      for pos in range(p.answer_start, len(p.ids)):
        key = src[:, r, :, pos - 1]  # where each head looks from the position predicting token `pos`
        hits += (key >= lo) & (key < hi) & (p.ids[key] == p.ids[pos])
        total += 1
  scores = hits / total
  top = sorted(((layer, head) for layer in range(cfg.num_layers) for head in range(cfg.num_heads)),
               key=lambda lh: (-scores[lh], lh))[:8]
  out = {"scores": scores.tolist(), "layer_scores": scores.max(1).tolist(), "ranking": rank_layers(scores),
         "top_heads": [[layer, head, float(scores[layer, head])] for layer, head in top],
         "answer_tokens": int(total), "prompt_tokens": float(np.mean([len(p.ids) for p in prompts])),
         "prompts": [p.text for p in prompts[:2]], "n_prompts": int(n_prompts), "length": int(length),
         "seed": int(seed)}
  print(("[" + name + "] " if name else "") + f"heads: {len(prompts)} prompts, {total} answer tokens, best heads "
        + ", ".join(f"L{layer}.H{head} {sc:.2f}" for layer, head, sc in out["top_heads"][:4])
        + f" ({time.time() - t0:.0f}s)", flush=True)
  return out


def _text_vocab(spec: str):
  if spec == "dictionary_lookup":
    raise ValueError("heads: the probe needs a text vocabulary; 'dictionary_lookup' models have none")
  return vocab_lib.get_vocabulary(spec)


def run_heads(ctx) -> Dict:
  """The `heads` suite on a suite Context: copy scores, the `top` layers picked, W/eval/heads.png
  (ctx.out_dir)."""
  h = ctx.settings.heads
  _text_vocab(ctx.vocab_spec)
  if h.length > ctx.window:
    print(f"[{ctx.name}] heads: note: prompts of {h.length} tokens exceed the window of {ctx.window} "
          f"(one forward pass; positions past the window)", flush=True)
  out = copy_scores(ctx.cfg, ctx.params, ctx.vocab, h.n_prompts, h.length, ctx.settings.seed, name=ctx.name)
  out["top"] = min(h.top, ctx.cfg.num_layers)
  out["picked"] = list(pick_layers(out, out["top"]))
  if ctx.out_dir:
    plot_heads({ctx.name: out}, os.path.join(ctx.out_dir, "heads.png"))
  return out


def resolve_auto_layers(spec: str, checkpoint_path: str, vocab: str = "", n_prompts: int = 8,
                        length: int = 384, seed: int = 0) -> tuple:
  """'auto:N' -> the N memory layers the probe picks for a checkpoint, run with no memory layers
  (its memory-only parameters dropped); vocab: as --eval.vocab ('' = the checkpoint's own)."""
  n = parse_auto(spec)
  model = from_pretrained(checkpoint_path)
  if n > model.cfg.num_layers:
    raise ValueError(f"--mem_layers={spec}: the model has only {model.cfg.num_layers} layers")
  ck = model.checkpoint
  voc = _text_vocab(vocab_lib.checkpoint_vocab_spec(checkpoint_path, ck.meta, ck.tokenizer_path, vocab))
  cfg = dataclasses.replace(model.cfg, mem_layers=())
  params = {name: ({**p, "self_attn": {k: v for k, v in p["self_attn"].items() if k not in MEMORY_ONLY_PARAMS}}
                   if isinstance(p, dict) and "self_attn" in p else p) for name, p in model.params.items()}
  res = copy_scores(cfg, params, voc, n_prompts, length, seed, name=os.path.basename(os.path.normpath(checkpoint_path)))
  picked = pick_layers(res, n)
  best = ", ".join(f"{layer} ({res['layer_scores'][layer]:.2f})" for layer in res["ranking"][:n])
  print(f"--mem_layers={spec}: memory layers {list(picked)}: the {n} layers whose best head copies most often "
        f"in the retrieval-head probe (layer (best head's copy score): {best}; {res['answer_tokens']} answer "
        f"tokens, {n_prompts} prompts of ~{length} tokens, seed {seed})", flush=True)
  return picked
