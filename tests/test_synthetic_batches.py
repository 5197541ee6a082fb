"""The synthetic training tasks of the demo's curriculum: the copy warm-up and dictionary
batches whose documents share no key (so crossbatch negatives are true negatives)."""
import numpy as np
import pytest

from data_pipelines.copy_task import CopyBatches, CopyTask, RepeatedWindows
from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask


def test_copy_batches_repeat_the_previous_window_and_score_the_repeat():
  task = CopyTask(span=8, num_symbols=20, symbol_offset=8)
  batch = CopyBatches(task, slots=3, window=8, seed=0)(5)
  assert batch["inputs"].shape == (6, 8)  # 3 slots x 2 windows
  first, second = batch["inputs"][0::2], batch["inputs"][1::2]
  np.testing.assert_array_equal(first, second)
  assert batch["inputs"].min() >= 8 and batch["inputs"].max() < 28
  # Within the repeat, every position predicts the next copied token, scored; the last
  # position of the document predicts EOS (unscored); the first window is not scored.
  assert not batch["loss_mask"][0::2, :-1].any() and batch["loss_mask"][0::2, -1].all()
  assert batch["loss_mask"][1::2, :-1].all() and not batch["loss_mask"][1::2, -1].any()
  np.testing.assert_array_equal(batch["targets"][1::2, :-1], second[:, 1:])
  np.testing.assert_array_equal(batch["accuracy_mask"], batch["loss_mask"])
  # Deterministic per (seed, step); other steps and seeds differ.
  again = CopyBatches(task, 3, 8, 0)
  np.testing.assert_array_equal(again(5)["inputs"], batch["inputs"])
  assert not np.array_equal(again(6)["inputs"], batch["inputs"])
  # A window of the whole document (the baseline) holds both copies.
  whole = CopyBatches(task, 3, 16, 0)(5)
  np.testing.assert_array_equal(whole["inputs"][:, :8], whole["inputs"][:, 8:])
  with pytest.raises(ValueError, match="window"):
    CopyBatches(task, 3, 5, 0)


def test_dictionary_batches_with_disjoint_keys():
  task = DictionaryTask(num_symbols=64, num_value_symbols=16, key_len=1, value_len=1, n_defs=16, n_queries=16)
  shared = 0
  for step in range(3):
    tokens, _, _ = task.batch(0, step, 4, disjoint_keys=True)
    keys = [set(doc[:task.defs_len:2].tolist()) for doc in tokens]
    assert all(len(k) == 16 for k in keys)
    assert len(set().union(*keys)) == 64, "4 documents x 16 keys use all 64 key symbols exactly once"
    tokens, _, _ = task.batch(0, step, 4)
    keys = [set(doc[:task.defs_len:2].tolist()) for doc in tokens]
    shared += 64 - len(set().union(*keys))
  assert shared > 0, "without the option, documents do share keys (the check above is not vacuous)"
  batches = DictionaryBatches(task, 4, 32, 0, disjoint_keys=True)
  assert batches(0)["inputs"].shape == (8, 32)
  with pytest.raises(ValueError, match="distinct keys"):
    DictionaryBatches(task, 5, 32, 0, disjoint_keys=True)


def test_chunked_copy_shuffles_pieces_and_skips_their_first_tokens():
  task = CopyTask(span=8, num_symbols=50, chunks=4)
  tokens, scored = task.batch(0, 3, 16)
  first, repeat = tokens[:, :8], tokens[:, 8:]
  moved = 0
  for f, r in zip(first, repeat):
    pieces = [tuple(f[i:i + 2]) for i in range(0, 8, 2)]
    got = [tuple(r[i:i + 2]) for i in range(0, 8, 2)]
    assert sorted(got) == sorted(pieces)  # the same pieces, in some order
    moved += got != pieces
  assert moved > 8, "the order must vary between documents"
  assert not scored[:, :8].any()
  np.testing.assert_array_equal(scored[0, 8:], [False, True] * 4)
  with pytest.raises(ValueError, match="chunks"):
    CopyTask(span=8, chunks=3).validate()


def test_distinct_copy_never_repeats_a_symbol_within_a_span():
  task = CopyTask(span=16, num_symbols=16, symbol_offset=3, distinct=True)
  tokens, _ = task.batch(0, 1, 64)
  first = tokens[:, :16]
  assert all(sorted(row.tolist()) == list(range(3, 19)) for row in first)  # a permutation of all 16
  assert len({tuple(row) for row in first}) == 64
  np.testing.assert_array_equal(tokens[:, 16:], first)
  plain, _ = CopyTask(span=16, num_symbols=16, symbol_offset=3).batch(0, 1, 64)
  assert any(len(set(row[:16].tolist())) < 16 for row in plain), "without it, symbols do repeat"
  with pytest.raises(ValueError, match="num_symbols >= span"):
    CopyTask(span=16, num_symbols=15, distinct=True).validate()


class _Slots:
  """A stand-in slot batcher: [slots * windows, T] rows numbered by (step, row), with state."""

  def __init__(self, slots=6, windows=3, T=5):
    self.shape, self.state = (slots * windows, T), {"pos": 0}

  def __call__(self, step):
    inputs = np.arange(np.prod(self.shape)).reshape(self.shape) + 1000 * step
    return {"inputs": inputs, "targets": inputs + 1, "loss_mask": np.ones(self.shape, bool),
            "doc_ids": inputs // 100}

  def state_dict(self):
    return self.state


def test_repeated_windows_copy_the_first_window_of_chosen_slots():
  src = _Slots()
  rep = RepeatedWindows(src, windows=3, fraction=0.5, seed=1, score_first=False)
  b, orig = rep(4), src(4)
  by_slot = {k: v.reshape(6, 3, 5) for k, v in b.items()}
  o = {k: v.reshape(6, 3, 5) for k, v in orig.items()}
  chosen = [s for s in range(6) if not np.array_equal(by_slot["inputs"][s, 1], o["inputs"][s, 1])]
  assert 0 < len(chosen) < 6  # a seeded share of the slots
  for s in range(6):
    if s in chosen:  # every later window repeats the first, targets and doc ids included
      for k in ("inputs", "targets", "doc_ids"):
        for j in (1, 2):
          np.testing.assert_array_equal(by_slot[k][s, j], o[k][s, 0])
      assert not by_slot["loss_mask"][s, 0].any() and by_slot["loss_mask"][s, 1:].all()
    else:
      for k in b:
        np.testing.assert_array_equal(by_slot[k][s], o[k][s])
  np.testing.assert_array_equal(rep(4)["inputs"], b["inputs"])  # a pure function of the step
  assert rep.state_dict() is src.state  # the source's state is what checkpoints save
  full = RepeatedWindows(src, windows=3, fraction=1.0, seed=1)(0)
  assert full["loss_mask"].all() and (full["inputs"].reshape(6, 3, 5)[:, 2] == full["inputs"].reshape(6, 3, 5)[:, 0]).all()
  with pytest.raises(ValueError, match="fraction"):
    RepeatedWindows(src, windows=3, fraction=0.0, seed=1)
  with pytest.raises(ValueError, match="2 windows"):
    RepeatedWindows(src, windows=1, fraction=1.0, seed=1)
