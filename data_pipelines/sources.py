"""Document readers for local files, JSON lines and the embedded stdlib corpus.

Each reader yields one text per document, deterministically (sorted paths, then a
seeded shuffle when asked). Bad input never stops a run: unreadable paths, empty
files, invalid UTF-8 (skipped, or decoded with replacement characters) and
documents longer than `max_bytes` (truncated) are counted in a `BadInputStats`,
which the pipeline reports. A source that matches no file fails when opened,
naming the pattern.

Held-out split: `heldout(key, percent)` puts a document in `validation` when the first byte of
the SHA-256 of its key, scaled to 0-99, is below `percent` (5 by default: 13 of the 256 byte
values, 5.1%), else in `train`. The key of a file is its path relative to the corpus root (the
pattern's leading directories without wildcards: `split_paths`), the key of a JSON line its
bytes, so a document's split never depends on which other files or lines exist, and identical
JSON lines always fall in the same split.
"""
from __future__ import annotations

import collections
import glob
import gzip
import hashlib
import json
import os
import sysconfig
import threading
from typing import Iterator, List, Optional

import numpy as np

BAD_INPUT_KINDS = ("unreadable", "empty", "invalid_utf8", "truncated", "bad_json", "missing_field")
SPLITS = ("train", "validation")
HELDOUT_PERCENT = 5  # share of documents in `validation` (stdlib, files:, jsonl:)


class DataTaskError(ValueError):
  """A task that cannot be read as asked (no file matches, no such split); names the task."""


class BadInputStats:
  """Thread-safe counters of skipped / truncated input (tf.data runs readers in threads)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.counts = collections.Counter()
    self.examples = {}  # kind -> first path seen, for the report

  def add(self, kind: str, where: str):
    with self._lock:
      self.counts[kind] += 1
      self.examples.setdefault(kind, where)

  def report(self) -> str:
    if not self.counts:
      return "no bad input"
    return "; ".join(f"{k}: {n} (e.g. {self.examples[k]})" for k, n in sorted(self.counts.items()))


def expand(pattern: str, suffixes=None) -> List[str]:
  """A directory (all files below it), a glob, or a file -> sorted file paths."""
  pattern = os.path.expanduser(pattern)
  if os.path.isdir(pattern):
    paths = [os.path.join(d, f) for d, _, fs in os.walk(pattern) for f in fs]
  else:
    paths = glob.glob(pattern, recursive=True)
  if suffixes:
    paths = [p for p in paths if p.endswith(tuple(suffixes))]
  return sorted(paths)


def heldout(key, percent: float) -> bool:
  """Is the document with this key (str or bytes) in the held-out `validation` split?"""
  if isinstance(key, str):
    key = key.encode("utf-8", errors="surrogatepass")
  return hashlib.sha256(key).digest()[0] * 100 // 256 < percent


def check_split(split: str, percent: float, what: str):
  """A split of a held-out corpus: 'train' always, 'validation' when percent > 0."""
  if not 0 <= percent < 100:
    raise DataTaskError(f"{what}: heldout_percent must be in [0, 100), got {percent!r}")
  have = SPLITS if percent > 0 else SPLITS[:1]
  if split not in have:
    raise DataTaskError(f"{what} has no split {split!r}; its splits: {', '.join(have)}")


def pattern_root(pattern: str) -> str:
  """The corpus root of a pattern: a directory itself, else its leading directories that hold no
  wildcard (`/data/c/**/*.txt` -> `/data/c`; a single file -> its directory)."""
  pattern = os.path.expanduser(pattern)
  if os.path.isdir(pattern):
    return pattern
  parts = pattern.split(os.sep)
  fixed = []
  for part in parts[:-1]:
    if glob.has_magic(part):
      break
    fixed.append(part)
  return os.sep.join(fixed) or (os.sep if pattern.startswith(os.sep) else ".")


def split_paths(paths: List[str], pattern: str, split: str, percent: float) -> List[str]:
  """The files of `split`: keyed by their path relative to pattern_root(pattern)."""
  root = pattern_root(pattern)
  return [p for p in paths if heldout(os.path.relpath(p, root), percent) == (split == "validation")]


def _read_bytes(path: str, stats: BadInputStats) -> Optional[bytes]:
  try:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
      return f.read()
  except (OSError, EOFError) as e:  # unreadable, vanished, corrupt gzip
    stats.add("unreadable", f"{path}: {e.__class__.__name__}")
    return None


def decode(data: bytes, where: str, stats: BadInputStats, invalid_utf8: str = "replace",
           max_bytes: int = 0) -> Optional[str]:
  """bytes -> text, or None if skipped; truncation at max_bytes (0: none)."""
  if not data:
    stats.add("empty", where)
    return None
  truncated = bool(max_bytes) and len(data) > max_bytes
  if truncated:
    stats.add("truncated", where)
    data = data[:max_bytes]
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    if truncated and e.start >= len(data) - 3:  # the cut split a character: drop its head
      try:
        return data[:e.start].decode("utf-8")
      except UnicodeDecodeError:
        pass
    stats.add("invalid_utf8", where)
    if invalid_utf8 == "skip":
      return None
    return data.decode("utf-8", errors="replace")


def shuffled(paths: List[str], seed: Optional[int]) -> List[str]:
  if seed is None:
    return list(paths)
  order = np.random.default_rng(seed).permutation(len(paths))
  return [paths[i] for i in order]


def text_files(paths: List[str], stats: BadInputStats, seed: Optional[int] = None, invalid_utf8: str = "replace",
               max_bytes: int = 0) -> Iterator[str]:
  """One document per file (gzip by suffix)."""
  for path in shuffled(paths, seed):
    data = _read_bytes(path, stats)
    if data is not None:
      text = decode(data, path, stats, invalid_utf8, max_bytes)
      if text is not None:
        yield text


def jsonl_files(paths: List[str], field: str, stats: BadInputStats, seed: Optional[int] = None,
                invalid_utf8: str = "replace", max_bytes: int = 0, split: Optional[str] = None,
                heldout_percent: float = 0) -> Iterator[str]:
  """One document per JSON line, its `field` (files in a seeded order, lines in file order).
  split: only the lines of that split (`heldout` keyed by the line's bytes, surrounding
  whitespace stripped); None: every line."""
  for path in shuffled(paths, seed):
    data = _read_bytes(path, stats)
    if data is None:
      continue
    for n, line in enumerate(data.splitlines(), 1):
      line = line.strip()
      if not line:
        continue
      if split is not None and heldout(line, heldout_percent) != (split == "validation"):
        continue
      where = f"{path}:{n}"
      try:
        record = json.loads(line)
      except (ValueError, UnicodeDecodeError):
        stats.add("bad_json", where)
        continue
      text = record.get(field) if isinstance(record, dict) else None
      if not isinstance(text, str):
        stats.add("missing_field", f"{where} (no string field {field!r})")
        continue
      text = decode(text.encode("utf-8", errors="surrogatepass"), where, stats, invalid_utf8, max_bytes)
      if text is not None:
        yield text


# -- the embedded corpus: the Python standard library's own sources ------------
def stdlib_paths(split: str, heldout_percent: int = HELDOUT_PERCENT) -> List[str]:
  """The stdlib's .py files (not its test suite, not site-packages), split by `heldout` of the
  path relative to the stdlib root: `validation` is ~heldout_percent% of files, `train` the rest."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "__pycache__", "idle_test"))
    paths.extend(os.path.join(d, f) for f in files if f.endswith(".py"))
  check_split(split, heldout_percent, "data task 'stdlib'")
  return sorted(p for p in paths if heldout(os.path.relpath(p, root), heldout_percent) == (split == "validation"))
