"""An LM experiment's batch sources, one per typed curriculum feed (configs.resolve made them):
text of a task in doc-pinned slots, a repeat view of it, retrieval documents, or the copy warm-up.
The seed is an argument, not the experiment's, so the baselines' extra seeds build their own."""
from __future__ import annotations

from data_pipelines import pipeline, vocab as vocab_lib
from data_pipelines.copy_task import CopyBatches, RepeatedWindows
from data_pipelines.retrieval_docs import RetrievalBatches, RetrievalSpec
from fot_jax.configs import LMExperiment
from fot_jax.settings import CopyWarmupSettings, LMDataSettings, RepeatFeed, TextFeed


def feed_batches(feed, data: LMDataSettings, seed: int, layout: str = "fot"):
  """The batch source of one typed feed in this host's slots. Text (a TextFeed, a RepeatFeed's, a
  retrieval view's natural-text slots) is read from split data.split in the run's batch shape. The
  copy warm-up's documents are two windows of `span` tokens for FoT, whatever the LM's own window
  (memory keys carry no position, so the circuit carries over; short windows make it form in a
  fraction of the steps: docs/data.md), and one whole row for the no-crossbatch `layout`."""
  if isinstance(feed, CopyWarmupSettings):
    task = feed.copy_task(layout)
    return CopyBatches(task, feed.slots, task.span if layout == "fot" else task.doc_len, seed)
  if not isinstance(feed, (TextFeed, RepeatFeed, RetrievalSpec)):
    raise TypeError(f"not an LM feed: {feed!r}")
  vocab = vocab_lib.get_vocabulary(data.vocab)
  slots = pipeline.host_slots(data.slots)
  retrieval = isinstance(feed, RetrievalSpec)
  n_text = int(feed.text_slots * slots) if retrieval else slots  # retrieval: a share of natural text
  text = None
  if n_text:
    text = pipeline.lm_batches(feed.text_task if retrieval else feed.task, vocab, slots=n_text,
                               windows=data.windows_per_slot, window=data.window, split=data.split, seed=seed,
                               min_doc_len=data.min_doc_len, max_doc_len=data.max_doc_len)
    text.check_nonempty()
  if retrieval:
    haystack = pipeline.document_texts(feed.haystack_task, data.split) if feed.reads_text else None
    return RetrievalBatches(feed, vocab, slots=slots, windows=data.windows_per_slot, window=data.window,
                            seed=seed, text_batches=text, haystack_texts=haystack)
  if isinstance(feed, RepeatFeed):
    return RepeatedWindows(text, data.windows_per_slot, feed.fraction, seed, feed.score_first)
  return text


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


def format_corpus_views(lm: LMExperiment) -> str:
  """The lines a run prints at its start: the corpus, then each view and the task it reads; a view
  reading other text than the corpus is marked, so a forgotten override shows before training."""
  data = lm.data
  lines = [f"data: corpus {data.corpus!r} (data.corpus); each view reads:"]
  for view, field, task, split in lm.views:
    mark = "" if task == data.corpus else "   <- not the corpus"
    lines.append(f"  {view:<36} {task!r} split {split!r} ({field}){mark}")
  if data.task != data.corpus and not any(v[0] == "training text" for v in lm.views):
    lines.append(f"  note: data.task={data.task!r} is read by no phase of this curriculum; data.corpus sets "
                 f"what every view reads")
  return "\n".join(lines)
