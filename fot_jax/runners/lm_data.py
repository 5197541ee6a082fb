"""An LM experiment's batch sources, one per typed curriculum feed (configs.resolve made them):
text of a task in doc-pinned slots, a repeat view of it, retrieval documents, or the copy warm-up.
The seed is an argument, not the experiment's, so the baselines' extra seeds build their own."""
from __future__ import annotations

from data_pipelines import pipeline, vocab as vocab_lib
from data_pipelines.copy_task import CopyBatches, RepeatedWindows
from data_pipelines.retrieval_docs import RetrievalBatches, RetrievalSpec
from fot_jax.settings import CopyWarmupSettings, LMDataSettings, RepeatFeed, TextFeed


def text_batches(data: LMDataSettings, task: str, seed: int):
  """This host's slots of `task` (split data.split) in the run's batch shape."""
  batcher = pipeline.lm_batches(task, vocab_lib.get_vocabulary(data.vocab), slots=pipeline.host_slots(data.slots),
                                windows=data.windows_per_slot, window=data.window, split=data.split, seed=seed,
                                min_doc_len=data.min_doc_len, max_doc_len=data.max_doc_len)
  batcher.check_nonempty()
  return batcher


def retrieval_batches(data: LMDataSettings, spec: RetrievalSpec, seed: int) -> RetrievalBatches:
  """Retrieval documents in this host's slots, a `text_slots` share of them natural text."""
  vocab = vocab_lib.get_vocabulary(data.vocab)
  slots = pipeline.host_slots(data.slots)
  n_text = int(spec.text_slots * slots)
  text = None
  if n_text:
    text = pipeline.lm_batches(spec.text_task, vocab, slots=n_text, windows=data.windows_per_slot,
                               window=data.window, seed=seed, min_doc_len=data.min_doc_len,
                               max_doc_len=data.max_doc_len)
    text.check_nonempty()
  return RetrievalBatches(spec, vocab, slots=slots, windows=data.windows_per_slot, window=data.window,
                          seed=seed, text_batches=text)


def copy_batches(warmup: CopyWarmupSettings, seed: int, layout: str) -> CopyBatches:
  """The copy warm-up: FoT's documents split in two windows of `span` tokens, whatever the LM's own
  window (memory keys carry no position, so the circuit carries over; short windows make it form
  in a fraction of the steps: docs/data.md); the no-crossbatch layout sees each document whole in
  one row."""
  task = warmup.copy_task(layout)
  return CopyBatches(task, warmup.slots, task.span if layout == "fot" else task.doc_len, seed)


def feed_batches(feed, data: LMDataSettings, seed: int, layout: str = "fot"):
  """The batch source of one typed feed; `layout` ('fot' or 'no_crossbatch') only shapes the copy warm-up."""
  if isinstance(feed, CopyWarmupSettings):
    return copy_batches(feed, seed, layout)
  if isinstance(feed, RetrievalSpec):
    return retrieval_batches(data, feed, seed)
  if isinstance(feed, RepeatFeed):
    return RepeatedWindows(text_batches(data, feed.task, seed), data.windows_per_slot, feed.fraction, seed,
                           feed.score_first)
  if isinstance(feed, TextFeed):
    return text_batches(data, feed.task, seed)
  raise TypeError(f"not an LM feed: {feed!r}")


def arm_batches(feeds, tasks, data: LMDataSettings, seed: int, layout: str = "fot") -> dict:
  """{task: batch source} for the curriculum tasks `tasks`. Missing data, an empty source or a bad
  vocabulary is a 'data error' (one line from fot_jax.cli, no traceback)."""
  try:
    return {task: feed_batches(feeds[task], data, seed, layout) for task in set(tasks)}
  except ValueError as e:
    raise ValueError(f"data error: {e}") from e


def train_input(sources: dict):
  """What train() takes: the one source of a curriculum over data.task alone, else {task: source}."""
  return sources[None] if list(sources) == [None] else sources
