"""Needle in a haystack with a natural haystack: held-out text of a corpus task (e.g. the
stdlib sources), a needle line at a given depth, a question at the end. The multi-needle
variant (in the spirit of RULER's multi-key NIAH) hides several named keys and asks for one,
which sits at the grid depth; the others sit at seeded random depths.

Needles and question are Python comments (`style="comment"`), so they read naturally in a code
haystack, or plain lines (`style="plain"`) for a prose haystack (manuals, essays).
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from fot_jax.eval.retrieval import insert_at_depth

NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


STYLES = ("comment", "plain")


def _mark(style: str) -> str:
  if style not in STYLES:
    raise ValueError(f"niah: style must be one of {STYLES}, got {style!r}")
  return "# " if style == "comment" else ""


def needle(key: int, name: str = "", style: str = "comment") -> str:
  return f"{_mark(style)}The secret number{' for ' + name if name else ''} is {key}.\n"


def question(name: str = "", style: str = "comment") -> str:
  who = f" for {name}" if name else ""
  return f"\n{_mark(style)}Question: what is the secret number{who}? Answer: the secret number{who} is"


class Haystack:
  """Token ids of a corpus (documents joined by blank lines); prompts take seeded slices."""

  def __init__(self, vocab, texts: List[str]):
    if not texts:
      raise ValueError("niah: the haystack corpus is empty")
    self.vocab = vocab
    self.ids = np.asarray(vocab.encode("\n\n".join(texts)), np.int32)

  def slice(self, tokens: int, rng: np.random.Generator) -> str:
    if tokens > len(self.ids):
      raise ValueError(f"niah: the haystack corpus has {len(self.ids):,} tokens, fewer than the "
                       f"{tokens:,} a prompt needs; lower the lengths or use a larger corpus")
    start = int(rng.integers(0, len(self.ids) - tokens + 1))
    return self.vocab.decode(self.ids[start:start + tokens].tolist())


def make_prompt_fn(vocab, haystack: Haystack, n_needles: int = 1, style: str = "comment"):
  if not 1 <= n_needles <= len(NAMES):
    raise ValueError(f"niah: n_needles must be 1..{len(NAMES)}, got {n_needles}")

  def make_prompt(length: int, depth: float, rng: np.random.Generator) -> Tuple[str, str]:
    keys = [int(k) for k in rng.integers(10000, 100000, n_needles)]
    names = [NAMES[i] for i in rng.permutation(len(NAMES))[:n_needles]] if n_needles > 1 else [""]
    needles = [needle(k, n, style) for k, n in zip(keys, names)]
    fixed = len(vocab.encode("".join(needles) + question(names[0], style)))
    text = haystack.slice(max(1, length - 1 - fixed), rng)
    for other in needles[1:]:  # distractor needles first, the asked one last at the grid depth
      text = insert_at_depth(text, other, float(rng.uniform()))
    text = insert_at_depth(text, needles[0], depth)
    return text + question(names[0], style), f" {keys[0]}"
  return make_prompt
