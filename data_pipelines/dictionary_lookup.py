"""Synthetic dictionary lookup (FoT paper, App. F).

A document is a block of definitions followed by a block of queries, each an
entry of K key tokens then V value tokens (keys and values use disjoint symbol
ranges, so no marker tokens are needed):

  k1 .. kK v1 .. vV   (n_defs times)   k1 .. kK v1 .. vV   (n_queries times)

Queries ask keys defined earlier in the same document, each at most once, in a
random order (so no positional shortcut exists: retrieval is by content). Only the
query value tokens are scored; a query counts as answered when every value token
is predicted (teacher-forced argmax). With the default sizes a document is 512
tokens: 32 definitions (256 tokens, the first local window) then 32 queries, so
with a 256-token local window every answer has to come from the memory layer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 8  # ids below this are reserved


@dataclasses.dataclass(frozen=True)
class DictionaryTask:
  num_symbols: int = 256  # key symbols
  num_value_symbols: int = 256
  key_len: int = 2
  value_len: int = 2
  n_defs: int = 64
  n_queries: int = 64
  # How definitions are written (queries are always "k.. v.."): "kv" = k.. v..;
  # "vkv" = v.. k.. v.. (value, key, value again; the closing value is scored by the LM
  # loss). "vkv" was tried as an easier-to-learn layout; it did not learn faster here.
  layout: str = "kv"

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + self.num_symbols + self.num_value_symbols

  @property
  def value_offset(self) -> int:
    return NUM_SPECIAL + self.num_symbols

  @property
  def def_len(self) -> int:
    return self.key_len + self.value_len * (2 if self.layout == "vkv" else 1)

  @property
  def query_len(self) -> int:
    return self.key_len + self.value_len

  def _definitions(self, keys, values):
    parts = [values, keys, values] if self.layout == "vkv" else [keys, values]
    return np.concatenate(parts, axis=1)

  @property
  def defs_len(self) -> int:
    return self.n_defs * self.def_len

  @property
  def queries_len(self) -> int:
    return self.n_queries * self.query_len

  @property
  def doc_len(self) -> int:
    return self.defs_len + self.queries_len

  def validate(self):
    if self.layout not in ("kv", "vkv"):
      raise ValueError(f"data.layout: must be 'kv' or 'vkv', got {self.layout!r}")
    if self.n_queries > self.n_defs:
      raise ValueError(f"data.n_queries={self.n_queries} exceeds data.n_defs={self.n_defs}: "
                       f"each query asks a distinct defined key")
    if self.key_space < 4 * self.n_defs:
      raise ValueError(f"data.num_symbols ** data.key_len = {self.key_space} "
                       f"is too small for {self.n_defs} distinct keys")

  @property
  def key_space(self) -> int:
    """How many distinct keys exist."""
    return self.num_symbols ** self.key_len

  def check_disjoint(self, n_docs: int, field: str = "slots"):
    space = self.key_space
    if n_docs * self.n_defs > space:
      raise ValueError(f"data: {n_docs} {field} x {self.n_defs} definitions need {n_docs * self.n_defs} distinct "
                       f"keys, but num_symbols ** key_len = {space}; raise data.num_symbols or lower {field}")

  # -- generation ----------------------------------------------------------
  def key_codes(self, keys) -> np.ndarray:
    """Token keys [n, K] -> integer codes (base num_symbols)."""
    digits = np.asarray(keys, np.int64) - NUM_SPECIAL
    return digits @ (self.num_symbols ** np.arange(self.key_len - 1, -1, -1, dtype=np.int64))

  def _random_keys(self, rng, n, exclude=None, distinct=True):
    """n random keys [n, K]; pairwise distinct if `distinct`; none whose code is in `exclude`."""
    space = self.key_space
    exclude = np.zeros(0, np.int64) if exclude is None else np.asarray(exclude, np.int64)
    codes = np.zeros(0, np.int64)
    while len(codes) < n:
      draw = rng.integers(0, space, 2 * (n - len(codes)) + 8)
      draw = draw[~np.isin(draw, exclude)]
      codes = np.concatenate([codes, draw])
      if distinct:
        _, first = np.unique(codes, return_index=True)
        codes = codes[np.sort(first)]
    codes = codes[:n]
    digits = (codes[:, None] // self.num_symbols ** np.arange(self.key_len - 1, -1, -1)) % self.num_symbols
    return digits.astype(np.int32) + NUM_SPECIAL

  def definitions(self, rng, n, exclude=None, distinct=True):
    """n definitions (keys pairwise distinct if `distinct`, none with a code in `exclude`):
    tokens [n * def_len], keys [n, K], values [n, V]."""
    keys = self._random_keys(rng, n, exclude, distinct)
    values = rng.integers(0, self.num_value_symbols, (n, self.value_len)).astype(np.int32)
    values += self.value_offset
    return self._definitions(keys, values).reshape(-1), keys, values

  def document(self, rng, exclude=None, distinct=None):
    """One document: dict(tokens [doc_len], value_mask [doc_len], keys [n_defs, K]).

    distinct < n_defs repeats `distinct` definitions to fill the block (an easier
    document, for a difficulty curriculum); queries then repeat keys too.
    """
    distinct = self.n_defs if distinct is None else min(int(distinct), self.n_defs)
    defs, keys, values = self.definitions(rng, distinct, exclude)
    if distinct < self.n_defs:
      pick = np.concatenate([rng.permutation(distinct) for _ in range(-(-self.n_defs // distinct))])
      pick = pick[:self.n_defs]
      keys, values = keys[pick], values[pick]
      defs = self._definitions(keys, values).reshape(-1)
    order = rng.permutation(self.n_defs)[: self.n_queries]
    queries = np.concatenate([keys[order], values[order]], axis=1)
    tokens = np.concatenate([defs, queries.reshape(-1)])
    # Scored positions: a value token of a query is the *target* of the previous position.
    mask = np.zeros(self.doc_len, bool)
    qmask = np.zeros((self.n_queries, self.query_len), bool)
    qmask[:, self.key_len:] = True
    mask[self.defs_len:] = qmask.reshape(-1)
    lm_mask = mask.copy()  # what training scores: query values (+ closing values in "vkv")
    if self.layout == "vkv":
      closing = np.zeros((self.n_defs, self.def_len), bool)
      closing[:, self.value_len + self.key_len:] = True
      lm_mask[:self.defs_len] = closing.reshape(-1)
    return {"tokens": tokens, "value_mask": mask, "lm_mask": lm_mask, "keys": keys}

  def batch(self, seed: int, step: int, n_docs: int, distinct=None, disjoint_keys: bool = False):
    """Deterministic documents for a training step: tokens, lm_mask, value_mask [n_docs, doc_len].

    disjoint_keys: no key is defined in two documents of the batch, so another document's
    definitions never answer a query (crossbatch negatives are true negatives)."""
    rng = np.random.default_rng([seed, step])
    if disjoint_keys:
      self.check_disjoint(n_docs)
    docs, used = [], np.zeros(0, np.int64)
    for _ in range(n_docs):
      docs.append(self.document(rng, exclude=used if disjoint_keys else None, distinct=distinct))
      if disjoint_keys:
        used = np.concatenate([used, self.key_codes(docs[-1]["keys"])])
    return (np.stack([d["tokens"] for d in docs]), np.stack([d["lm_mask"] for d in docs]),
            np.stack([d["value_mask"] for d in docs]))


def _shift(mask):
  return np.concatenate([mask[:, 1:], np.zeros((mask.shape[0], 1), bool)], axis=1)


def lm_example(tokens, lm_mask, value_mask=None):
  """Next-token example from documents: inputs, targets, loss_mask (+ accuracy_mask), [N, L].

  The target of position i is token i+1; the last position predicts EOS, unscored.
  loss_mask scores the tokens of lm_mask; accuracy_mask the query values.
  """
  n, l = tokens.shape
  targets = np.concatenate([tokens[:, 1:], np.full((n, 1), EOS, tokens.dtype)], axis=1)
  out = {"inputs": tokens, "targets": targets, "loss_mask": _shift(lm_mask)}
  if value_mask is not None:
    out["accuracy_mask"] = _shift(value_mask)
  return out


def to_windows(example, window: int):
  """[N, L] documents -> [N * (L // window), window] rows: the windows of a doc stay a pack."""
  out = {}
  for name, x in example.items():
    n, l = x.shape
    if l % window:
      raise ValueError(f"data: document length {l} is not a multiple of the window {window}")
    out[name] = x.reshape(n * (l // window), window)
  return out


class DictionaryBatches:
  """Training batches: each slot holds one whole document per step (k = doc_len / window)."""

  def __init__(self, task: DictionaryTask, slots: int, window: int, seed: int,
               distinct_start: int = 0, distinct_every: int = 0, disjoint_keys: bool = False):
    """distinct_start/every: difficulty curriculum; documents hold distinct_start distinct
    definitions, doubling every distinct_every steps up to n_defs (0: off). disjoint_keys:
    no key shared between the documents of a batch (see DictionaryTask.batch)."""
    task.validate()
    if disjoint_keys:
      task.check_disjoint(slots)
    self.task, self.slots, self.window, self.seed = task, slots, window, seed
    self.disjoint_keys = disjoint_keys
    self.distinct_start, self.distinct_every = distinct_start, distinct_every
    if task.doc_len % window:
      raise ValueError(f"data.window={window} must divide the document length {task.doc_len}")

  @property
  def pack(self) -> int:
    return self.task.doc_len // self.window

  def distinct(self, step: int):
    if not self.distinct_start:
      return None
    return min(self.task.n_defs, self.distinct_start * 2 ** (step // max(self.distinct_every, 1)))

  def __call__(self, step: int):
    tokens, lm_mask, vmask = self.task.batch(self.seed, step, self.slots, self.distinct(step), self.disjoint_keys)
    return to_windows(lm_example(tokens, lm_mask, vmask), self.window)

  def state_dict(self):  # stateless: batch n is a pure function of (seed, n)
    return {"seed": self.seed}
