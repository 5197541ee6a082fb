"""Passkey retrieval over prompt lengths x key depths (Mohtashami & Jaggi 2023; LongLLaMA):
a random 5-digit key in repeated filler, then "What is the pass key?". The wording is
data_pipelines/passkey.py's (the training task of the same name)."""
from __future__ import annotations

from typing import Tuple

import numpy as np

from data_pipelines.passkey import FILLER, PREFIX, QUESTION, needle
from fot_jax.eval.retrieval import fit_repeats


def make_prompt_fn(vocab):
  def make_prompt(length: int, depth: float, rng: np.random.Generator) -> Tuple[str, str]:
    """About `length` tokens; the key after round(depth * repeats) filler blocks."""
    key = int(rng.integers(10000, 100000))
    repeats = fit_repeats(vocab, PREFIX + needle(key) + QUESTION, FILLER, length)
    at = int(round(depth * repeats))
    return PREFIX + FILLER * at + needle(key) + FILLER * (repeats - at) + QUESTION, f" {key}"
  return make_prompt
