"""Doc-pinned slot batching (docs/semantics.md, "Crossbatch (training)"), resumable.

A host builds `slots` slots; each slot is one token stream made of whole documents,
each written `bos doc eos` (LongLLaMA: the bos target is unscored, the eos target is
scored), concatenated when short. A batch gives every slot its next `windows`
consecutive windows of `window` tokens, so the batch is [slots * windows, window]
with row = slot * windows + j (the trainer's packs), and batch n + 1 continues each
slot's stream where batch n stopped. A document, once loaded into a slot, is consumed
there to its end.

Fields of a batch (all [B, T]):
  inputs, targets  stream[p : p + T] and stream[p + 1 : p + T + 1]
  loss_mask        the target is a document token or its eos (not a bos, not padding)
  doc_ids          the document of the input token (-1 for padding); ids are unique
                   across shards: local_index * num_shards + shard_index

Documents come from `open_epoch(epoch, skip) -> iterator of int arrays`, which must
be deterministic; the stream runs epoch after epoch (or stops, `repeat=False`, and
pads the slots that ran dry). The state (`state_dict`) is JSON: how many documents
were read and, per slot, which documents (by index) are buffered from which offset.
`load_state_dict` re-reads those documents, so a resumed run receives exactly the
batches of an uninterrupted one.
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np

STATE_VERSION = 1


class EmptySourceError(ValueError):
  pass


class _DocReader:
  """Numbered documents epoch after epoch; can reopen at any earlier document index."""

  def __init__(self, open_epoch, repeat: bool, name: str, explain: Optional[Callable[[], str]] = None):
    self.open_epoch, self.repeat, self.name = open_epoch, repeat, name
    self.explain = explain  # -> more words for the empty-source error ('' for none)
    self.epoch_starts = [0]  # local index of each epoch's first document
    self.next_index = 0
    self.done = False
    self._it = None

  def seek(self, index: int):
    epoch = max(e for e, s in enumerate(self.epoch_starts) if s <= index)
    self._it = iter(self.open_epoch(epoch, index - self.epoch_starts[epoch]))
    self._epoch, self.next_index, self.done = epoch, index, False

  def read(self):
    """-> (local index, tokens) or None when the source is exhausted (repeat=False)."""
    if self._it is None:
      self.seek(self.next_index)
    while True:
      doc = next(self._it, None)
      if doc is not None:
        self.next_index += 1
        return self.next_index - 1, doc
      if self.next_index == self.epoch_starts[self._epoch]:
        more = self.explain() if self.explain else ""
        raise EmptySourceError(f"data: {self.name} yielded no documents (epoch {self._epoch}); "
                               f"check the task name, split and paths" + (f"; {more}" if more else ""))
      if not self.repeat:
        self.done = True
        return None
      if self._epoch + 1 == len(self.epoch_starts):
        self.epoch_starts.append(self.next_index)
      self._epoch += 1
      self._it = iter(self.open_epoch(self._epoch, 0))


class SlotBatcher:
  """Callable `batcher(step) -> batch`, steps consecutive; `state_dict()` / `load_state_dict()`."""

  def __init__(self, open_epoch: Callable[[int, int], Iterator[np.ndarray]], *, slots: int, windows: int,
               window: int, bos: int, eos: int, pad: int = 0, min_doc_len: int = 1, max_doc_len: int = 0,
               repeat: bool = True, shard_index: int = 0, num_shards: int = 1, name: str = "source",
               identity: Optional[dict] = None, bad_input: Optional[Callable] = None):
    """bad_input: () -> the source's reader counters (sources.BadInputStats), kept as
    `self.bad_input` and named in the error of a source that yields nothing."""
    for field, v in (("slots", slots), ("windows_per_slot", windows), ("window", window)):
      if v <= 0:
        raise ValueError(f"data.{field}: must be positive, got {v}")
    self.slots, self.windows, self.window = slots, windows, window
    self.bos, self.eos, self.pad = bos, eos, pad
    self.min_doc_len, self.max_doc_len = max(int(min_doc_len), 1), int(max_doc_len)
    self.shard_index, self.num_shards, self.name = shard_index, num_shards, name
    self.identity = dict(identity or {})
    if bad_input is not None:
      self.bad_input = bad_input
    explain = (lambda: "bad input: " + bad_input().report() if bad_input().counts else "") if bad_input else None
    self.reader = _DocReader(open_epoch, repeat, name, explain)
    self.stats = collections.Counter()
    self.next_step = 0
    # Per slot: deque of [local index, tokens (bos doc eos), offset]; tokens before offset are consumed.
    self.buffers: List[collections.deque] = [collections.deque() for _ in range(slots)]

  # -- documents -----------------------------------------------------------
  def _accept(self, tokens) -> Optional[np.ndarray]:
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if len(tokens) < self.min_doc_len:
      return None
    if self.max_doc_len and len(tokens) > self.max_doc_len:
      tokens = tokens[:self.max_doc_len]
    return np.concatenate([[self.bos], tokens, [self.eos]]).astype(np.int32)

  def _next_doc(self, count: bool = True):
    """-> (local index, stream tokens) of the next accepted document, or None at the end."""
    while True:
      got = self.reader.read()
      if got is None:
        return None
      index, tokens = got
      n = len(tokens)
      stream = self._accept(tokens)
      if count:
        self.stats["documents_read"] += 1
        if stream is None:
          self.stats["dropped_short" if n else "dropped_empty"] += 1
        elif self.max_doc_len and n > self.max_doc_len:
          self.stats["truncated_long"] += 1
      if stream is not None:
        return index, stream
      if count and self.reader._epoch > 0 and not self.stats["documents_used"]:
        raise EmptySourceError(f"data: {self.name}: every document is shorter than data.min_doc_len="
                               f"{self.min_doc_len} tokens; lower it or use another task")

  def check_nonempty(self):
    """Fails now (not mid-run) if the source has no usable document. Fills slot 0 as batch 0
    would (slots fill in order), so the batches are the same whether or not this ran."""
    if self.next_step == 0 and not any(self.buffers):
      self._fill(0, self.windows * self.window + 1)

  def _fill(self, slot: int, need: int):
    buf = self.buffers[slot]
    have = sum(len(t) - off for _, t, off in buf)
    while have < need:
      got = self._next_doc()
      if got is None:
        if not self.stats["documents_used"]:
          raise EmptySourceError(f"data: {self.name}: no document of at least data.min_doc_len="
                                 f"{self.min_doc_len} tokens")
        return
      self.stats["documents_used"] += 1
      buf.append([got[0], got[1], 0])
      have += len(got[1])

  def _take(self, slot: int, n: int):
    """The next n + 1 stream tokens of a slot (padded at the end of a finite source), advancing n."""
    self._fill(slot, n + 1)
    toks, ids, scored, out = [], [], [], 0
    for index, stream, off in self.buffers[slot]:
      piece = stream[off:off + n + 1 - out]
      toks.append(piece)
      ids.append(np.full(len(piece), index * self.num_shards + self.shard_index, np.int64))
      sc = np.ones(len(piece), bool)
      if off == 0:
        sc[0] = False  # bos
      scored.append(sc)
      out += len(piece)
      if out == n + 1:
        break
    if out < n + 1:
      toks.append(np.full(n + 1 - out, self.pad, np.int32))
      ids.append(np.full(n + 1 - out, -1, np.int64))
      scored.append(np.zeros(n + 1 - out, bool))
    # advance by n: drop fully consumed documents (the lookahead token stays)
    left = n
    buf = self.buffers[slot]
    while buf and left:
      index, stream, off = buf[0]
      step = min(left, len(stream) - off)
      buf[0][2] += step
      left -= step
      if buf[0][2] == len(stream):
        buf.popleft()
    return np.concatenate(toks), np.concatenate(ids), np.concatenate(scored)

  @property
  def exhausted(self) -> bool:
    """True once a finite source has nothing left to score (every slot holds at most one token)."""
    return self.reader.done and all(sum(len(t) - o for _, t, o in b) <= 1 for b in self.buffers)

  # -- batches -------------------------------------------------------------
  def __call__(self, step: int) -> Dict[str, np.ndarray]:
    if step != self.next_step:
      raise ValueError(f"data: batch for step {step} requested but the pipeline is at step {self.next_step}; "
                       f"batches are consumed in order (restore its state with the checkpoint)")
    if self.exhausted:
      raise StopIteration(f"data: {self.name} is exhausted (repeat=False)")
    k, t = self.windows, self.window
    rows = {name: [] for name in ("inputs", "targets", "loss_mask", "doc_ids")}
    for s in range(self.slots):
      toks, ids, scored = self._take(s, k * t)
      rows["inputs"].append(toks[:-1].reshape(k, t))
      rows["targets"].append(toks[1:].reshape(k, t))
      rows["loss_mask"].append(scored[1:].reshape(k, t))
      rows["doc_ids"].append(ids[:-1].reshape(k, t))
    self.next_step += 1
    batch = {name: np.concatenate(v) for name, v in rows.items()}
    batch["doc_ids"] = batch["doc_ids"].astype(np.int32) if batch["doc_ids"].max(initial=0) < 2**31 \
        else batch["doc_ids"]
    return batch

  # -- resume --------------------------------------------------------------
  def state_dict(self) -> dict:
    return {"version": STATE_VERSION, "next_step": self.next_step, "next_index": self.reader.next_index,
            "epoch_starts": list(self.reader.epoch_starts), "done": self.reader.done,
            "slots": [[[int(i), int(off)] for i, _, off in b] for b in self.buffers],
            "stats": dict(self.stats),
            "layout": {"slots": self.slots, "windows": self.windows, "window": self.window,
                       "shard_index": self.shard_index, "num_shards": self.num_shards, **self.identity}}

  def load_state_dict(self, state: dict) -> None:
    mine = self.state_dict()["layout"]
    theirs = state.get("layout", {})
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    if diff:
      detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items()))
      raise ValueError(f"data: the checkpoint's pipeline state does not match this run ({detail}); "
                       f"resume with the same host count, data.slots, windows, window and task, "
                       f"or start a new workdir")
    needed = {i: off for b in state["slots"] for i, off in b}
    self.reader.epoch_starts = list(state["epoch_starts"])
    docs = {}
    if needed:
      self.reader.seek(min(needed))
      while len(docs) < len(needed):
        got = self._next_doc(count=False)
        if got is None or got[0] >= state["next_index"]:
          raise ValueError(f"data: could not re-read the documents buffered at the checkpoint from "
                           f"{self.name}; the source changed since")
        if got[0] in needed:
          docs[got[0]] = got[1]
    self.reader.seek(int(state["next_index"]))
    self.reader.done = bool(state["done"])
    self.buffers = [collections.deque([i, docs[i], off] for i, off in b) for b in state["slots"]]
    self.stats = collections.Counter(state.get("stats", {}))
    self.next_step = int(state["next_step"])

  def report(self) -> str:
    s = self.stats
    return (f"{s['documents_used']} documents used of {s['documents_read']} read; dropped {s['dropped_short']} "
            f"shorter than {self.min_doc_len} tokens and {s['dropped_empty']} empty; "
            f"truncated {s['truncated_long']} longer than {self.max_doc_len or 'inf'}")
