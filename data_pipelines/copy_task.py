"""Induction warm-up: copy a window of random tokens (FoT curriculum, before dictionary lookup).

A document is `span` random symbols X followed by X again. Every token of the repeat
is scored, so every scored token teaches the same two-step circuit that dictionary
lookup needs (a previous-token head feeding a content match: "find where the current
token occurred before, predict what followed it"). With `window == span` the first copy
is the previous window of the slot, i.e. reachable only through the memory layer; a
baseline with `window == 2 * span` learns the same copy inside its local window.

Measured (issue 10): a 2-layer model of width 64 jumps from chance to > 95% copy
accuracy within ~1,000 steps of 32-token spans (an induction phase change), after which
dictionary lookup through memory is learned in a few hundred steps; dictionary lookup
from scratch stays near chance for thousands of steps.

Symbols default to the dictionary task's key and value ids, so the copy circuit is
learned on the embeddings that dictionary lookup uses.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from data_pipelines.dictionary_lookup import NUM_SPECIAL, lm_example, to_windows


@dataclasses.dataclass(frozen=True)
class CopyTask:
  span: int = 32  # tokens copied (documents are 2 * span long)
  num_symbols: int = 512  # symbols are ids symbol_offset .. symbol_offset + num_symbols - 1
  symbol_offset: int = NUM_SPECIAL
  # chunks > 1: the repeat holds X's `chunks` equal pieces in a random order, and each piece's
  # first token is not scored (it cannot be predicted). The distance between a token and its
  # copy then varies, so a model with positions in its window cannot copy by a fixed offset
  # (a positional shortcut that does not transfer to lookup) and has to match content.
  chunks: int = 1
  # distinct: no symbol repeats within a span (drawn without replacement), so every token of the
  # repeat has one source and "find where this token occurred, predict what followed" is never
  # ambiguous. With few symbols and long spans (a byte-level model: 128-token spans) repeats
  # are the rule, and a one-token match picks the wrong source for most tokens.
  distinct: bool = False

  @property
  def doc_len(self) -> int:
    return 2 * self.span

  @property
  def vocab_size(self) -> int:
    return self.symbol_offset + self.num_symbols

  def validate(self):
    if self.span <= 0 or self.num_symbols < 2:
      raise ValueError(f"copy task: span and num_symbols must be positive (num_symbols >= 2), "
                       f"got span={self.span}, num_symbols={self.num_symbols}")
    if self.chunks <= 0 or self.span % self.chunks:
      raise ValueError(f"copy task: chunks={self.chunks} must divide span={self.span}")
    if self.distinct and self.num_symbols < self.span:
      raise ValueError(f"copy task: distinct symbols need num_symbols >= span, got "
                       f"num_symbols={self.num_symbols}, span={self.span}")

  def batch(self, seed: int, step: int, n_docs: int):
    """tokens and the scored mask (the repeat), [n_docs, doc_len]; a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step, 7])  # 7: another stream than dictionary batches
    if self.distinct:  # the first `span` of a random permutation of the symbols, per document
      first = np.argsort(rng.random((n_docs, self.num_symbols)), axis=1)[:, :self.span]
    else:
      first = rng.integers(0, self.num_symbols, (n_docs, self.span))
    first = first.astype(np.int32) + self.symbol_offset
    size = self.span // self.chunks
    order = np.argsort(rng.random((n_docs, self.chunks)), axis=1) if self.chunks > 1 else \
        np.zeros((n_docs, 1), np.int64)
    pieces = first.reshape(n_docs, self.chunks, size)
    repeat = np.take_along_axis(pieces, order[:, :, None], axis=1).reshape(n_docs, self.span)
    tokens = np.concatenate([first, repeat], axis=1)
    scored = np.zeros(tokens.shape, bool)
    scored[:, self.span:] = True
    if self.chunks > 1:
      scored[:, self.span::size] = False  # a piece's first token: which piece comes is random
    return tokens, scored


class CopyBatches:
  """Training batches of the copy task, one document per slot (k = doc_len / window rows)."""

  def __init__(self, task: CopyTask, slots: int, window: int, seed: int):
    task.validate()
    if task.doc_len % window:
      raise ValueError(f"copy task: window {window} must divide the document length {task.doc_len}")
    self.task, self.slots, self.window, self.seed = task, slots, window, seed

  @property
  def pack(self) -> int:
    return self.task.doc_len // self.window

  def __call__(self, step: int):
    tokens, scored = self.task.batch(self.seed, step, self.slots)
    return to_windows(lm_example(tokens, scored, scored), self.window)

  def state_dict(self):  # stateless: batch n is a pure function of (seed, n)
    return {"seed": self.seed}


class RepeatedWindows:
  """The copy task on real text: in a seeded `fraction` of each batch's slots, every window after
  the first repeats the slot's first window, so its tokens are predictable from that window,
  which the memory layer sees as its positive. `score_first=False` leaves the first window of
  those slots unscored (a pure copy task, whose training accuracy is copy accuracy).

  Measured (docs/data.md): a model that learned the copy on random ids copies stdlib text through
  memory within a few hundred steps, and keeping a share of repeated slots in the LM phase keeps
  that circuit alive on text. Batch n is a pure function of the wrapped batches' batch n and
  (seed, n); state and reports are the wrapped batcher's."""

  def __init__(self, batches, windows: int, fraction: float, seed: int, score_first: bool = True):
    if windows < 2:
      raise ValueError(f"repeated windows: need at least 2 windows per slot, got {windows}")
    if not 0.0 < fraction <= 1.0:
      raise ValueError(f"repeated windows: fraction must be in (0, 1], got {fraction}")
    self.batches, self.windows, self.fraction = batches, windows, fraction
    self.seed, self.score_first = seed, score_first

  def __call__(self, step: int):
    batch = {k: np.array(v) for k, v in self.batches(step).items()}
    slots = batch["inputs"].shape[0] // self.windows
    rng = np.random.default_rng([self.seed, step, 13])  # 13: its own stream
    chosen = np.nonzero(rng.random(slots) < self.fraction)[0]
    for a in batch.values():  # rows are slot * windows + j (the slot batcher's packs)
      by_slot = a.reshape(slots, self.windows, *a.shape[1:])
      by_slot[chosen, 1:] = by_slot[chosen, :1]
    if not self.score_first:
      batch["loss_mask"].reshape(slots, self.windows, -1)[chosen, 0] = False
    return batch

  def __getattr__(self, name):  # state_dict / load_state_dict / report / bad_input: the source's
    if name == "batches":
      raise AttributeError(name)
    return getattr(self.batches, name)


# The text form, for language-model runs (registered as the SeqIO task 'copy_text'): random
# characters, then the same characters again. Letters and digits, so the copy also covers
# what passkey retrieval asks for.
TEXT_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "


def copy_text_document(rng: np.random.Generator, min_span: int, max_span: int) -> str:
  n = int(rng.integers(min_span, max_span + 1))
  span = "".join(rng.choice(list(TEXT_ALPHABET), n))
  return f"{span}\n{span}"
