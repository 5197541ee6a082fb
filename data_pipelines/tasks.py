"""SeqIO tasks and mixtures of raw documents, registered by name.

Every text task yields one example per document with a string feature `text`; the
vocabulary is chosen by the run (`c.data.vocab`) and applied by the pipeline
(`data_pipelines.pipeline`), so one registered task serves every tokenizer.
Token tasks (the synthetic dictionary lookup) yield int32 `tokens` instead.

Registered on import:
  stdlib             the Python standard library's own .py files (found via sysconfig),
                     splits train / validation (held-out files); no download needed
  pg19, c4           TFDS sources as they are (the user's downloaded TFDS data)
  dictionary_lookup  synthetic dictionary documents (data_pipelines.dictionary_lookup)
  passkey            synthetic passkey documents (data_pipelines.passkey)
  copy_text          the induction warm-up as text: random characters, then the same again
                     (data_pipelines.copy_task; spans of 64 to 256 characters)
Names resolved on first use:
  tfds:NAME          any TFDS text dataset with a `text` field (register_tfds_task for others)
  files:PATTERN      a directory or glob of text files, one document per file (.gz accepted)
  jsonl:PATTERN      JSON-lines files, one document per line's `text` field (.gz accepted)
Splits: stdlib, files: and jsonl: tasks hold out ~5% of their documents as `validation` and
train on the rest (`train`), never sharing a document: a file falls in `validation` by a hash
of its path relative to the corpus root, a JSON line by a hash of its bytes
(sources.heldout). register_files_task / register_jsonl_task(..., heldout_percent=N) choose
another share; heldout_percent=0 trains on every document and has no `validation` split. The
synthetic tasks draw `validation` from another seed; TFDS tasks have the splits of their
dataset. A split a task lacks fails naming the task and the splits it has (a mixture: naming the
members that lack it; seqio alone would skip them).
Mixtures: `register_mixture(name, {task: rate})` (registered: stdlib_copy = stdlib 0.8 + copy_text 0.2); `register_longllama_mixture` reproduces
LongLLaMA's proportions over whichever of its sources the user has registered.
"""
from __future__ import annotations

import functools
import hashlib
import re
from typing import Callable, Dict, Iterator, Optional

import numpy as np
import seqio
import tensorflow as tf

from data_pipelines import copy_task, passkey, sources
from data_pipelines.dictionary_lookup import DictionaryTask

TEXT, TOKENS = "text", "tokens"
_TEXT_FEATURES = {TEXT: seqio.Feature(seqio.PassThroughVocabulary(1), dtype=tf.string, rank=0,
                                      add_eos=False, required=False)}
_TOKEN_FEATURES = {TOKENS: seqio.Feature(seqio.PassThroughVocabulary(1), dtype=tf.int32, rank=1,
                                         add_eos=False, required=False)}
DataTaskError = sources.DataTaskError
BAD_INPUT: Dict[str, sources.BadInputStats] = {}  # task name -> counters of its readers
_ALIASES: Dict[str, str] = {}  # 'files:/a/b/*.txt' -> the SeqIO-valid name it is registered under

# LongLLaMA's training mixture (LongLLaMA README / FoT paper App.): source -> rate.
LONGLLAMA_PROPORTIONS = {"arxiv": 0.25, "python": 0.25, "book": 0.10, "common_crawl": 0.29, "c4": 0.05,
                         "github": 0.02, "stackexchange": 0.02, "wikipedia": 0.02}


class _PythonSource(seqio.FunctionDataSource):
  """A FunctionDataSource without seqio's 'uncached function source' warning: our readers
  shuffle their own file order from the seed, deterministically, every epoch. A split it does
  not have fails, naming the task (`label`) and its splits."""

  def __init__(self, dataset_fn, splits, label: str):
    super().__init__(dataset_fn, splits=splits)
    self.label = label

  def get_dataset(self, split="train", shuffle=True, seed=None, shard_info=None, **unused):
    if split not in self.splits:
      raise DataTaskError(f"data task {self.label!r} has no split {split!r}; its splits: {', '.join(self.splits)}")
    return self._dataset_fn(split=split, shuffle_files=shuffle, seed=seed)


def _text_dataset(make_texts: Callable[[str, Optional[int]], Iterator[str]]):
  def dataset_fn(split, shuffle_files, seed=None):
    texts = make_texts(split, seed if shuffle_files else None)  # runs now: bad patterns fail here
    first = next(texts, None)
    def gen():
      if first is not None:
        yield {TEXT: first}
        for t in texts:
          yield {TEXT: t}
    return tf.data.Dataset.from_generator(gen, output_signature={TEXT: tf.TensorSpec((), tf.string)})
  return dataset_fn


def _register(name: str, source, features=_TEXT_FEATURES, preprocessors=()):
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(name, source=source, output_features=features,
                                preprocessors=list(preprocessors), shuffle_buffer_size=256)


def _files_source(name, pattern, read, invalid_utf8, heldout_percent, label, suffixes=None):
  """read(paths, split, stats, seed) -> texts of `split`; the pattern is expanded when an epoch opens."""
  label = label or name
  if invalid_utf8 not in ("replace", "skip"):
    raise DataTaskError(f"data task {label!r}: invalid_utf8 must be 'replace' or 'skip', got {invalid_utf8!r}")
  sources.check_split("train", heldout_percent, f"data task {label!r}")  # the share is in range
  stats = BAD_INPUT.setdefault(name, sources.BadInputStats())

  def make_texts(split, seed):
    paths = sources.expand(pattern, suffixes)
    if not paths:
      raise DataTaskError(f"data task {label!r}: no files match {pattern!r}")
    return read(paths, split, stats, seed)
  splits = sources.SPLITS if heldout_percent > 0 else sources.SPLITS[:1]
  return _PythonSource(_text_dataset(make_texts), splits=splits, label=label)


def register_files_task(name: str, pattern: str, invalid_utf8: str = "replace", max_bytes: int = 0,
                        heldout_percent: float = sources.HELDOUT_PERCENT, label: Optional[str] = None):
  """A directory or glob of text/code files, one document per file (gzip by .gz suffix).
  `validation` holds the ~heldout_percent% of files whose path relative to the corpus root
  hashes below it (sources.split_paths), `train` the others; heldout_percent=0: `train` only,
  every file. label: the name errors use (default `name`)."""
  def read(paths, split, stats, seed):
    if heldout_percent > 0:
      kept = sources.split_paths(paths, pattern, split, heldout_percent)
      if not kept:
        raise DataTaskError(f"data task {label or name!r}: none of the {len(paths)} files matching {pattern!r} "
                            f"is in split {split!r} (validation holds out ~{heldout_percent}% of files by a hash "
                            f"of their path); add files, or register the task with another heldout_percent")
      paths = kept
    return sources.text_files(paths, stats, seed, invalid_utf8, max_bytes)
  return _register(name, _files_source(name, pattern, read, invalid_utf8, heldout_percent, label))


def register_jsonl_task(name: str, pattern: str, field: str = "text", invalid_utf8: str = "replace",
                        max_bytes: int = 0, heldout_percent: float = sources.HELDOUT_PERCENT,
                        label: Optional[str] = None):
  """JSON-lines files (gzip by .gz suffix), one document per line's `field`. `validation` holds
  the ~heldout_percent% of lines whose bytes hash below it, `train` the others, from every file;
  heldout_percent=0: `train` only, every line. label: the name errors use (default `name`)."""
  def read(paths, split, stats, seed):
    return sources.jsonl_files(paths, field, stats, seed, invalid_utf8, max_bytes,
                               split=split if heldout_percent > 0 else None, heldout_percent=heldout_percent)
  return _register(name, _files_source(name, pattern, read, invalid_utf8, heldout_percent, label))


def register_tfds_task(name: str, tfds_name: str, text_key: str = "text", data_dir: Optional[str] = None):
  """A TFDS dataset as it is (prepared beforehand: `tfds build NAME`); `text_key` names its document field."""
  pre = [] if text_key == TEXT else [functools.partial(seqio.preprocessors.rekey, key_map={TEXT: text_key})]
  # read_only: never start a download/preparation mid-run; missing data fails with tfds' message.
  return _register(name, seqio.TfdsDataSource(tfds_name=tfds_name, tfds_data_dir=data_dir, read_only=True),
                   preprocessors=pre)


def register_stdlib_task(name: str = "stdlib", heldout_percent: int = sources.HELDOUT_PERCENT):
  stats = BAD_INPUT.setdefault(name, sources.BadInputStats())

  def make_texts(split, seed):
    paths = sources.stdlib_paths(split, heldout_percent)
    if not paths:
      raise DataTaskError(f"data task {name!r}: no stdlib .py files found for split {split!r}")
    return sources.text_files(paths, stats, seed)
  return _register(name, _PythonSource(_text_dataset(make_texts), splits=sources.SPLITS, label=name))


def register_dictionary_task(name: str = "dictionary_lookup", task: DictionaryTask = DictionaryTask(),
                             docs_per_epoch: int = 10000):
  """Synthetic dictionary documents as int32 token sequences (their own id space)."""
  def dataset_fn(split, shuffle_files, seed=None):
    base = (0 if seed is None else int(seed)) + (10**6 if split == "validation" else 0)
    def gen():
      rng = np.random.default_rng(base)
      for _ in range(docs_per_epoch):
        yield {TOKENS: task.document(rng)["tokens"].astype(np.int32)}
    return tf.data.Dataset.from_generator(gen, output_signature={TOKENS: tf.TensorSpec((None,), tf.int32)})
  return _register(name, _PythonSource(dataset_fn, splits=sources.SPLITS, label=name), features=_TOKEN_FEATURES)


def register_passkey_task(name: str = "passkey", filler_repeats: int = 200, docs_per_epoch: int = 10000,
                          max_bytes: int = 0, min_bytes: int = 0):
  """max_bytes > 0: short documents (passkey.short_passkey_document) instead of the prefix and
  `filler_repeats` filler blocks."""
  def make_texts(split, seed):
    rng = np.random.default_rng((0 if seed is None else int(seed)) + (10**6 if split == "validation" else 0))
    if max_bytes:
      return (passkey.short_passkey_document(rng, max_bytes, min_bytes)["text"] for _ in range(docs_per_epoch))
    return (passkey.passkey_document(rng, filler_repeats)["text"] for _ in range(docs_per_epoch))
  return _register(name, _PythonSource(_text_dataset(make_texts), splits=sources.SPLITS, label=name))


def register_copy_text_task(name: str = "copy_text", min_span: int = 64, max_span: int = 256,
                            docs_per_epoch: int = 10000):
  def make_texts(split, seed):
    rng = np.random.default_rng((0 if seed is None else int(seed)) + (10**6 if split == "validation" else 0))
    return (copy_task.copy_text_document(rng, min_span, max_span) for _ in range(docs_per_epoch))
  return _register(name, _PythonSource(_text_dataset(make_texts), splits=sources.SPLITS, label=name))


def register_mixture(name: str, rates: Dict[str, float]):
  if name in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove(name)
  for task in rates:
    get_provider(task)  # resolves and validates every member now
  return seqio.MixtureRegistry.add(name, [(t, float(r)) for t, r in rates.items()])


def register_longllama_mixture(name: str = "longllama", available: Optional[Dict[str, str]] = None):
  """LongLLaMA's proportions over the sources the user has: available maps a LongLLaMA source
  ('arxiv', 'python', ...) to a registered task name; rates are renormalised over those given."""
  available = available or {}
  unknown = sorted(set(available) - set(LONGLLAMA_PROPORTIONS))
  if unknown or not available:
    raise ValueError(f"longllama mixture: map some of {sorted(LONGLLAMA_PROPORTIONS)} to task names; "
                     f"got {sorted(available)}")
  return register_mixture(name, {task: LONGLLAMA_PROPORTIONS[src] for src, task in available.items()})


def get_provider(name: str):
  """A registered task or mixture by name; 'tfds:', 'files:' and 'jsonl:' names register on first use."""
  if name in seqio.MixtureRegistry.names():
    return seqio.MixtureRegistry.get(name)
  if name in _ALIASES:
    return seqio.TaskRegistry.get(_ALIASES[name])
  if name not in seqio.TaskRegistry.names():
    kind, _, arg = name.partition(":")
    # SeqIO task names allow only [\w.:#]: paths and TFDS names get a registered alias.
    alias = f"{kind}:" + re.sub(r"[^\w.]", "_", arg)[-60:] + "#" + hashlib.sha1(arg.encode()).hexdigest()[:8]
    if kind == "tfds" and arg:
      register_tfds_task(alias, arg)
    elif kind == "files" and arg:
      register_files_task(alias, arg, label=name)
    elif kind == "jsonl" and arg:
      register_jsonl_task(alias, arg, label=name)
    else:
      raise ValueError(f"data.task: unknown task or mixture {name!r}; registered: "
                       f"{sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))} "
                       f"(or use tfds:NAME, files:PATTERN, jsonl:PATTERN)")
    _ALIASES[name] = alias
    return seqio.TaskRegistry.get(alias)
  return seqio.TaskRegistry.get(name)


def bad_input(name: str) -> sources.BadInputStats:
  """Bad-input counters of a task, or of all members of a mixture, merged."""
  provider = get_provider(name)
  merged = sources.BadInputStats()
  members = [t.name for t in provider.tasks] if isinstance(provider, seqio.Mixture) else [provider.name]
  for m in members:
    s = BAD_INPUT.get(m)
    if s is not None:
      merged.counts.update(s.counts)
      for k, v in s.examples.items():
        merged.examples.setdefault(k, v)
  return merged


register_stdlib_task()
register_tfds_task("pg19", "pg19:0.1.1", text_key="book_text")
register_tfds_task("c4", "c4/en:3.1.0")
register_dictionary_task()
register_passkey_task()
register_copy_text_task()
# The stdlib corpus with a share of copy documents: keeps the copy circuit in use while the
# model learns the language (experiments/stdlib_lm_tiny.py).
register_mixture("stdlib_copy", {"stdlib": 0.8, "copy_text": 0.2})
# Passkey documents of 192-256 bytes (two 128-byte windows) beside the stdlib corpus. Rates are per
# document and a stdlib file lasts ~62 such steps of a slot, a passkey document one: 0.95 makes about
# one slot-step in four a passkey once the slots settle (experiments/stdlib_lm_tiny.py).
register_passkey_task("passkey_short", max_bytes=256, min_bytes=192)
register_mixture("stdlib_passkey", {"stdlib": 0.05, "passkey_short": 0.95})
