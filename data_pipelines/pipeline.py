"""From a registered task (or mixture) and a vocabulary to doc-pinned slot batches.

`lm_batches(...)` returns a `SlotBatcher` over this host's shard of the task
(`seqio.ShardInfo(process_index, process_count)`), tokenized with the run's
vocabulary. Epoch e reads the task with shuffle seed `seed * 1000 + e`, so every
host sees the same order and a resumed run can reopen any epoch at any document.
Typed arguments only: an experiment's data settings reach it through fot_jax/runners/lm_data.py.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import jax
import numpy as np
import seqio
import tensorflow as tf

from data_pipelines import tasks, vocab as vocab_lib
from data_pipelines.slots import SlotBatcher


def _is_token_task(provider) -> bool:
  return tasks.TOKENS in provider.output_features


def _lacks(task: seqio.Task, split: str) -> bool:
  """Does the task lack the split? False when its splits cannot be listed (TFDS data not
  prepared: reading it fails then, naming the dataset)."""
  try:
    return split not in task.splits
  except Exception:  # noqa: BLE001 (tfds raises its own kinds for missing data)
    return False


def document_tokens(task: str, vocab: seqio.Vocabulary, split: str = "train", seed: Optional[int] = 0,
                    epoch: int = 0, skip: int = 0, shard_info: Optional[seqio.ShardInfo] = None,
                    shuffle: bool = True) -> Iterator[np.ndarray]:
  """One epoch of a shard's documents as int32 token arrays (no bos/eos), from document `skip` on."""
  provider = tasks.get_provider(task)
  token_task = _is_token_task(provider)
  if token_task != isinstance(vocab, seqio.PassThroughVocabulary):
    raise ValueError(f"data.vocab: task {task!r} holds {'token ids' if token_task else 'text'}; use "
                     f"{'its own ids (data.vocab=' + repr(task) + ')' if token_task else 'byte or a SentencePiece model'}")
  mixture = isinstance(provider, seqio.Mixture)
  if mixture:  # seqio would skip a member without the split, with a warning: the mixture changes silently
    lacking = [t.name for t in provider.tasks if _lacks(t, split)]
    if lacking:
      raise tasks.DataTaskError(f"data task {task!r}: its members {lacking} have no split {split!r} (a mixture "
                                f"reads a split from every member)")
  try:
    ds = provider.get_dataset(sequence_length=None, split=split, shuffle=shuffle and seed is not None,
                              seed=None if seed is None else seed * 1000 + epoch, shard_info=shard_info,
                              num_epochs=None if mixture else 1, use_cached=False, try_in_mem_cache=False)
  except tasks.DataTaskError:  # names the task and what is wrong already
    raise
  except (ValueError, tf.errors.OpError, AssertionError) as e:
    raise ValueError(f"data.task: cannot read {task!r} split {split!r}: {str(e).splitlines()[0]}") from None
  if token_task:
    ds = ds.map(lambda ex: ex[tasks.TOKENS])
  else:
    ds = ds.map(lambda ex: tf.cast(vocab.encode_tf(ex[tasks.TEXT]), tf.int32),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds.skip(skip).prefetch(tf.data.AUTOTUNE).as_numpy_iterator()


def document_texts(task: str, split: str, n: Optional[int] = None) -> List[str]:
  """The first n (all: None) documents of a text task's split, in stored order, as strings."""
  provider = tasks.get_provider(task)
  if tasks.TEXT not in provider.output_features:
    raise ValueError(f"task {task!r} holds token ids, not text; use a text task (files:PATTERN, jsonl:PATTERN, stdlib)")
  ds = provider.get_dataset(sequence_length=None, split=split, shuffle=False, use_cached=False)
  ds = ds.map(lambda ex: ex[tasks.TEXT])
  return [t.decode("utf-8", "replace") for t in (ds if n is None else ds.take(n)).as_numpy_iterator()]


def long_documents(task: str, vocab: seqio.Vocabulary, split: str, need: int, n: int,
                   wrap: Optional[Tuple[int, int]] = None) -> List[np.ndarray]:
  """Up to n documents of at least `need` tokens, in stored order (held-out evaluation);
  wrap=(bos, eos) makes each `bos doc eos` before its length is counted."""
  out = []
  for doc in document_tokens(task, vocab, split, seed=None):
    if wrap:
      doc = np.concatenate([[wrap[0]], doc, [wrap[1]]])
    if len(doc) >= need:
      out.append(np.asarray(doc, np.int32))
      if len(out) == n:
        break
  return out


def lm_batches(task: str, vocab: seqio.Vocabulary, *, slots: int, windows: int, window: int, split: str = "train",
               seed: int = 0, min_doc_len: int = 1, max_doc_len: int = 0, repeat: bool = True,
               shard_info: Optional[seqio.ShardInfo] = None, shuffle: bool = True) -> SlotBatcher:
  """This host's slot batcher; `slots` is the host's own slot count."""
  shard_info = shard_info or seqio.ShardInfo(jax.process_index(), jax.process_count())
  ids = vocab_lib.special_ids(vocab)

  def open_epoch(epoch, skip):
    return document_tokens(task, vocab, split, seed, epoch, skip,
                           shard_info if shard_info.num_shards > 1 else None, shuffle)

  where = f"task {task!r} split {split!r}" + (f" (shard {shard_info.index} of {shard_info.num_shards})"
                                             if shard_info.num_shards > 1 else "")
  batcher = SlotBatcher(open_epoch, slots=slots, windows=windows, window=window, min_doc_len=min_doc_len,
                        max_doc_len=max_doc_len, repeat=repeat, shard_index=shard_info.index,
                        num_shards=shard_info.num_shards, name=where,
                        identity={"task": task, "split": split, "seed": seed, "vocab_size": vocab.vocab_size},
                        bad_input=lambda: tasks.bad_input(task),  # reader-level counts (files, JSON lines)
                        **ids)
  return batcher


def host_slots(global_slots: int, process_count: Optional[int] = None) -> int:
  n = jax.process_count() if process_count is None else process_count
  if global_slots % n:
    raise ValueError(f"data.slots={global_slots} must be a multiple of the host count {n} "
                     f"(each host builds its own slots)")
  return global_slots // n
