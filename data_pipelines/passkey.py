"""Passkey retrieval documents (LongLLaMA / Mohtashami & Jaggi 2023): a random number hidden
at a random depth in repeated filler text, asked for at the end."""
from __future__ import annotations

import numpy as np

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
QUESTION = "What is the pass key? The pass key is"


SENTENCES = [s + ". " for s in FILLER.strip().rstrip(".").split(". ")]


def needle(key: int) -> str:
  return f"The pass key is {key}. Remember it. {key} is the pass key.\n"


def passkey_document(rng: np.random.Generator, filler_repeats: int) -> dict:
  """One document: text, the passkey (5 digits) and the filler block it was inserted after."""
  key = int(rng.integers(10000, 100000))
  depth = int(rng.integers(0, filler_repeats + 1))
  text = PREFIX + FILLER * depth + needle(key) + FILLER * (filler_repeats - depth) + f"{QUESTION} {key}."
  return {"text": text, "passkey": key, "depth": depth}


def short_passkey_document(rng: np.random.Generator, max_bytes: int, min_bytes: int = 0) -> dict:
  """A passkey document of about `min_bytes` to at most `max_bytes` bytes, without the prefix:
  whole filler sentences (the filler's cycle from a random sentence) with the needle after a
  random one of them, then the question and the key. Training documents that fit a few
  windows, so the question's window has the needle in the same window or in memory."""
  key = int(rng.integers(10000, 100000))
  tail = f"\n{QUESTION} {key}."
  fixed = len(needle(key)) + len(tail)
  budget = max_bytes - fixed  # bytes of filler at most
  if budget < 0:
    raise ValueError(f"passkey: max_bytes={max_bytes} is shorter than the needle and question "
                     f"({fixed} bytes)")
  first = int(rng.integers(len(SENTENCES)))
  fill = int(rng.integers(min(budget, max(0, min_bytes - fixed)), budget + 1))
  sentences, used = [], 0
  while used + len(nxt := SENTENCES[(first + len(sentences)) % len(SENTENCES)]) <= fill:
    sentences.append(nxt)
    used += len(nxt)
  depth = int(rng.integers(0, len(sentences) + 1))
  text = "".join(sentences[:depth]) + needle(key) + "".join(sentences[depth:]).rstrip() + tail
  return {"text": text, "passkey": key, "depth": depth}
