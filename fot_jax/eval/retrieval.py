"""Retrieval prompts (passkey, needle in a haystack) and their scoring.

A prompt is text that ends in a question, plus the answer text. The model is scored
by teacher forcing: the answer counts when every answer token is the argmax of the
logits before it, which is exactly when greedy decoding would produce the answer (and
costs one pass instead of one per token). Prompts are processed window by window with
memory (`fot_jax.inference`), each prompt its own document.

`model` is anything with `logits(tokens [B, L] int32, mask [B, L] bool) -> [B, L, V]`:
`InferenceModel` for a real model; tests use stubs to check the scoring alone.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from fot_jax.eval.effective_length import effective_length
from fot_jax.inference import end_aligned


class InferenceModel:
  """A real model through MemoryInference: fresh memory for every batch of prompts. Each
  prompt's windows are aligned at its end (`inference.end_aligned`, LongLLaMA's
  last_context_length = the window), so the question and answer keep a full window of local
  context, as `generate` gives them; `align_end=False` starts windows at token 0."""

  def __init__(self, inference, align_end: bool = True):
    self.inference, self.align_end = inference, align_end

  def logits(self, tokens, mask):
    inf = self.inference
    if not self.align_end:
      return inf.process(tokens, inf.new_memory(len(tokens)), mask)
    return np.stack([np.pad(x, [(0, tokens.shape[1] - len(x)), (0, 0)])
                     for x in self.answer_logits(tokens, mask, [1] * len(tokens))])

  def answer_logits(self, tokens, mask, starts) -> List[np.ndarray]:
    """Per row, the logits before each token from starts[r] on ([len - start + 1, V]): only the
    windows holding them keep logits."""
    inf = self.inference
    lens = np.asarray(mask).sum(1)  # prompts are left-aligned in `tokens` (score's layout)
    rows = [np.asarray(t[:n]) for t, n in zip(tokens, lens)]
    if self.align_end and inf.window:  # window 0: one window as wide as the input (study.PlainInference)
      placed, placed_mask, pads = end_aligned(rows, inf.window, inf.window)
    else:
      placed, placed_mask, pads = np.asarray(tokens), np.asarray(mask), np.zeros(len(rows), int)
    first = int(min(p + s - 1 for p, s in zip(pads, starts)))
    skip = first // inf.window * inf.window if inf.window else 0  # the column the kept logits start at
    out = inf.process(placed, inf.new_memory(len(rows)), placed_mask, logits_from=first)
    return [out[r, p + s - 1 - skip:p + n - skip] for r, (n, p, s) in enumerate(zip(lens, pads, starts))]


def encode(vocab, prompt: str, answer: str) -> Tuple[np.ndarray, int]:
  """-> (bos + prompt + answer ids, index of the first answer token). The whole text is
  encoded at once (as a user's prompt would be) when the prompt's own ids are a prefix of
  it; otherwise (a merge across the boundary) prompt and answer are encoded apart."""
  p = list(vocab.encode(prompt))
  full = list(vocab.encode(prompt + answer))
  a = full[len(p):] if full[:len(p)] == p else list(vocab.encode(answer))
  if not a:
    raise ValueError(f"retrieval: the answer {answer!r} encodes to no tokens")
  return np.asarray([int(vocab.bos_id)] + p + a, np.int32), len(p) + 1


def score(model, examples: Sequence[Tuple[np.ndarray, int]], batch: int = 8) -> np.ndarray:
  """examples: (ids, answer_start) -> bool [n]: every answer token predicted (argmax)."""
  order = np.argsort([len(ids) for ids, _ in examples], kind="stable")  # similar lengths share a batch
  hits = np.zeros(len(examples), bool)
  for s in range(0, len(order), batch):
    idx = order[s:s + batch]
    width = max(len(examples[i][0]) for i in idx)
    toks = np.zeros((len(idx), width), np.int32)
    mask = np.zeros((len(idx), width), bool)
    for r, i in enumerate(idx):
      ids = examples[i][0]
      toks[r, :len(ids)], mask[r, :len(ids)] = ids, True
    if hasattr(model, "answer_logits"):  # only the answers' logits (a real model's are large)
      got = model.answer_logits(toks, mask, [examples[i][1] for i in idx])
    else:
      logits = model.logits(toks, mask)
      got = [logits[r, examples[i][1] - 1:] for r, i in enumerate(idx)]
    for r, i in enumerate(idx):
      ids, start = examples[i]
      pred = np.argmax(got[r][:len(ids) - start], -1)
      hits[i] = bool(np.all(pred == ids[start:]))
  return hits


PromptFn = Callable[[int, float, np.random.Generator], Tuple[str, str]]


def grid(model, vocab, make_prompt: PromptFn, lengths: Sequence[int], depths: Sequence[float],
         trials: int, seed: int, batch: int = 8, threshold: float = 0.9, name: str = "",
         suite: str = "") -> Dict:
  """Accuracy per (length, depth) cell over `trials` seeded prompts each.

  make_prompt(target_tokens, depth in [0, 1], rng) -> (prompt text, answer text).
  Returns {'lengths', 'depths', 'accuracy' [len][depth], 'tokens' (mean prompt tokens per
  length), 'accuracy_per_length' (mean over depths), 'effective_length', 'threshold'}.
  """
  acc = np.zeros((len(lengths), len(depths)))
  tokens = []
  t0 = time.time()
  for li, length in enumerate(lengths):
    examples, cells = [], []
    for di, depth in enumerate(depths):
      rng = np.random.default_rng([seed, int(length), di])
      for _ in range(trials):
        examples.append(encode(vocab, *make_prompt(int(length), float(depth), rng)))
        cells.append(di)
    hits = score(model, examples, batch)
    for di in range(len(depths)):
      acc[li, di] = hits[np.asarray(cells) == di].mean()
    tokens.append(float(np.mean([len(ids) for ids, _ in examples])))
    print(f"[{name}] {suite}: length {int(length):>7,} ({tokens[-1]:,.0f} tokens): accuracy by depth "
          f"{' '.join(f'{a:.2f}' for a in acc[li])} ({li + 1}/{len(lengths)}, {time.time() - t0:.0f}s)",
          flush=True)
  per_length = acc.mean(axis=1)
  return {"lengths": [int(x) for x in lengths], "depths": [float(d) for d in depths],
          "accuracy": acc.tolist(), "tokens": tokens, "accuracy_per_length": per_length.tolist(),
          "trials": int(trials), "seed": int(seed), "threshold": threshold,
          "effective_length": effective_length(lengths, per_length, threshold)}


def fit_repeats(vocab, fixed: str, unit: str, target_tokens: int) -> int:
  """How many copies of `unit` bring bos + fixed + copies to about target_tokens."""
  n_unit = max(1, len(vocab.encode(unit)))
  return max(0, (target_tokens - 1 - len(vocab.encode(fixed))) // n_unit)


def insert_at_depth(text: str, needle: str, depth: float, boundary: Optional[str] = "\n") -> str:
  """Inserts `needle` at fraction `depth` of `text`, moved forward to just after the next
  `boundary` (a line break keeps the haystack's lines whole); depth 1 appends."""
  at = int(round(depth * len(text)))
  if boundary and 0 < at < len(text):
    nxt = text.find(boundary, at - 1)
    at = len(text) if nxt < 0 else nxt + len(boundary)
  return text[:at] + needle + text[at:]


def depth_list(values) -> List[float]:
  out = [float(v) for v in values]
  if any(not 0.0 <= v <= 1.0 for v in out):
    raise ValueError(f"depths must lie in [0, 1], got {out}")
  return out
