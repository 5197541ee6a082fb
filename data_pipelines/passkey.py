"""Passkey retrieval documents (LongLLaMA / Mohtashami & Jaggi 2023): a random number hidden
at a random depth in repeated filler text, asked for at the end."""
from __future__ import annotations

import numpy as np

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
QUESTION = "What is the pass key? The pass key is"


def passkey_document(rng: np.random.Generator, filler_repeats: int) -> dict:
  """One document: text, the passkey (5 digits) and the filler block it was inserted after."""
  key = int(rng.integers(10000, 100000))
  depth = int(rng.integers(0, filler_repeats + 1))
  needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
  text = PREFIX + FILLER * depth + needle + FILLER * (filler_repeats - depth) + f"{QUESTION} {key}."
  return {"text": text, "passkey": key, "depth": depth}
