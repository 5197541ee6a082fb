"""Crossbatch plans (fot_jax/crossbatch.py) against docs/semantics.md, "Crossbatch (training)".

Row r = s * k + j is window j of slot s. A segments pair (p, n) at position j gives
the p most recent earlier windows of the row's own slot (latest first) as positives,
then n earlier windows (positions < j) of other slots as negatives, nearest slot
first (s+1, s+2, ... mod S) and, within a slot, latest window first.
"""
import itertools
import re

import numpy as np
import pytest

from fot_jax import crossbatch as cb

LONGLLAMA_3B = [(0, 0), (1, 1), (2, 1), (3, 0)]
LONGLLAMA_7B = [(0, 0), (1, 2), (2, 5), (3, 4)]


def _row(plan, r):
  """(sources, positive) of row r as plain lists, with the -1 padding kept."""
  return plan.sources[r].tolist(), plan.positive[r].tolist()


# ----------------------------------------------------------------------------- hand-built rows

def test_longllama_3b_rows_by_hand():
  plan = cb.segments_plan(32, LONGLLAMA_3B)  # 8 slots, k = 4
  assert plan.sources.shape == (32, 3) and plan.sources.dtype == np.int32
  assert plan.positive.shape == (32, 3) and plan.positive.dtype == bool
  # Slot 0, j = 0: nothing.
  assert _row(plan, 0) == ([-1, -1, -1], [False, False, False])
  # Slot 1, j = 1 (row 5): own window 0 (row 4); negative: slot 2 window 0 (row 8).
  assert _row(plan, 5) == ([4, 8, -1], [True, False, False])
  # Slot 2, j = 2 (row 10): own windows 1, 0 (rows 9, 8), latest first; negative slot 3 window 1.
  assert _row(plan, 10) == ([9, 8, 13], [True, True, False])
  # Slot 2, j = 3 (row 11): three positives, no negatives.
  assert _row(plan, 11) == ([10, 9, 8], [True, True, True])
  # Last slot wraps around to slot 0 for its negatives (row 30 -> slot 0 window 1 = row 1).
  assert _row(plan, 30) == ([29, 28, 1], [True, True, False])
  assert _row(plan, 29) == ([28, 0, -1], [True, False, False])


def test_longllama_7b_rows_by_hand():
  plan = cb.segments_plan(32, LONGLLAMA_7B)  # 8 slots, k = 4
  assert plan.sources.shape == (32, 7)
  assert _row(plan, 0) == ([-1] * 7, [False] * 7)
  # Row 1 (slot 0, j = 1): own row 0; negatives: window 0 of slots 1 and 2.
  assert _row(plan, 1) == ([0, 4, 8, -1, -1, -1, -1], [True] + [False] * 6)
  # Row 2 (slot 0, j = 2): own rows 1, 0; negatives: slot 1 windows 1, 0; slot 2 windows 1, 0;
  # slot 3 window 1 (five in all).
  assert _row(plan, 2) == ([1, 0, 5, 4, 9, 8, 13], [True, True] + [False] * 5)
  # Row 27 (slot 6, j = 3): own rows 26, 25, 24; negatives: slot 7 windows 2, 1, 0; slot 0 window 2.
  assert _row(plan, 27) == ([26, 25, 24, 30, 29, 28, 2], [True] * 3 + [False] * 4)
  # Row 30 (slot 7, j = 2): own 29, 28; then slots 0, 1, 2 (wrapping).
  assert _row(plan, 30) == ([29, 28, 1, 0, 5, 4, 9], [True, True] + [False] * 5)


@pytest.mark.parametrize("segments", [LONGLLAMA_3B, LONGLLAMA_7B])
def test_counts_per_row_and_padding(segments):
  k = len(segments)
  batch = 8 * k
  plan = cb.segments_plan(batch, segments)
  width = max(p + n for p, n in segments)
  assert plan.num_sources == width
  for r in range(batch):
    p, n = segments[r % k]
    live = plan.sources[r] >= 0
    assert live.sum() == p + n, r
    # Live entries first, then -1 padding that is never positive.
    assert live[:p + n].all() and not live[p + n:].any()
    assert (plan.sources[r, p + n:] == -1).all()
    assert plan.positive[r].sum() == p
    assert plan.positive[r, :p].all() and not plan.positive[r, p:].any()


# ----------------------------------------------------------------------------- analysis notation

@pytest.mark.parametrize("d,w,slots", [(1, 1, 3), (2, 1, 3), (3, 2, 4), (4, 3, 4), (2, 0, 2)])
def test_analysis_equals_its_segments(d, w, slots):
  batch = slots * (w + 1)
  got = cb.analysis_plan(batch, d, w)
  want = cb.segments_plan(batch, [(0, 0)] * w + [(w, (d - 1) * w)])
  np.testing.assert_array_equal(got.sources, want.sources)
  np.testing.assert_array_equal(got.positive, want.positive)
  via_spec = cb.plan_from_spec(batch, {"d": d, "w": w})
  np.testing.assert_array_equal(via_spec.sources, want.sources)
  np.testing.assert_array_equal(via_spec.positive, want.positive)


def test_analysis_last_window_by_hand():
  # d = 3, w = 2: k = 3, 4 slots, batch 12. Row 5 (slot 1, last): own rows 4, 3;
  # negatives: the same two windows of slots 2 and 3 (nearest first, latest first).
  plan = cb.analysis_plan(12, 3, 2)
  assert _row(plan, 5) == ([4, 3, 7, 6, 10, 9], [True, True, False, False, False, False])
  assert _row(plan, 11) == ([10, 9, 1, 0, 4, 3], [True, True, False, False, False, False])


def test_analysis_rows_before_last_have_no_sources():
  w = 3
  plan = cb.analysis_plan(5 * (w + 1), 4, w)
  for r in range(plan.sources.shape[0]):
    if r % (w + 1) < w:
      assert (plan.sources[r] == -1).all() and not plan.positive[r].any()
    else:
      assert (plan.sources[r] >= 0).sum() == w * 4


def test_analysis_d1_gives_only_positives():
  plan = cb.analysis_plan(12, 1, 3)  # k = 4, 3 slots
  assert plan.num_sources == 3
  live = plan.sources >= 0
  np.testing.assert_array_equal(live, plan.positive)
  assert _row(plan, 7) == ([6, 5, 4], [True, True, True])


def test_plan_from_spec_prefers_segments_and_empty():
  plan = cb.plan_from_spec(8, {"segments": [(0, 0), (1, 1)]})
  assert _row(plan, 1) == ([0, 2], [True, False])
  for spec in ({}, None):
    e = cb.plan_from_spec(6, spec)
    assert e.sources.shape == (6, 0) and e.positive.shape == (6, 0)
  e = cb.empty_plan(5)
  assert e.sources.dtype == np.int32 and e.positive.dtype == bool and e.sources.shape == (5, 0)


def test_scored_rows():
  np.testing.assert_array_equal(cb.scored_rows(6, 3, "last"), [False, False, True] * 2)
  assert cb.scored_rows(6, 3, "all").all()
  with pytest.raises(ValueError, match="loss_on"):
    cb.scored_rows(6, 3, "first")


# ----------------------------------------------------------------------------- invalid specs

def _raises_naming(field, fn, *args):
  with pytest.raises(ValueError) as info:
    fn(*args)
  assert re.search(rf"\b{field}\b", str(info.value)), str(info.value)
  return str(info.value)


def test_more_positives_than_earlier_windows():
  msg = _raises_naming("segments", cb.segments_plan, 8, [(0, 0), (2, 0)])
  assert "positive" in msg


def test_more_negatives_than_other_slots_windows():
  # 2 slots: position 1 has exactly 1 earlier window in the one other slot.
  cb.segments_plan(4, [(0, 0), (1, 1)])
  msg = _raises_naming("segments", cb.segments_plan, 4, [(0, 0), (1, 2)])
  assert "negative" in msg
  # LongLLaMA-7B needs 5 negatives at position 2: 2 * (S - 1) >= 5, so 3 slots are too few.
  _raises_naming("segments", cb.segments_plan, 12, LONGLLAMA_7B)
  cb.segments_plan(16, LONGLLAMA_7B)


def test_batch_not_multiple_of_pack():
  _raises_naming("segments", cb.segments_plan, 10, LONGLLAMA_3B)
  _raises_naming("w", cb.analysis_plan, 10, 2, 3)
  _raises_naming("w", cb.plan_from_spec, 10, {"d": 2, "w": 3})


def test_d_larger_than_slots():
  cb.analysis_plan(8, 4, 1)  # 4 slots: fine
  _raises_naming("d", cb.analysis_plan, 8, 5, 1)


@pytest.mark.parametrize("segments", [[(0, 0), (-1, 0)], [(0, 0), (0, -1)], [(0, -1)]])
def test_negative_segment_counts(segments):
  _raises_naming("segments", cb.segments_plan, 8, segments)


def test_negative_d():
  _raises_naming("d", cb.analysis_plan, 8, 0, 1)
  _raises_naming("d", cb.analysis_plan, 8, -1, 1)


@pytest.mark.parametrize("w", [-1, -2])
def test_negative_w(w):
  _raises_naming("w", cb.analysis_plan, 8, 2, w)


def test_empty_segments_and_missing_spec_keys():
  _raises_naming("segments", cb.segments_plan, 8, [])
  _raises_naming("spec", cb.plan_from_spec, 8, {"d": 2})


# ----------------------------------------------------------------------------- invariants

_CASES = [
    ("segments", 32, LONGLLAMA_3B),
    ("segments", 32, LONGLLAMA_7B),
    ("segments", 9, [(0, 0), (1, 2), (1, 1)]),
    ("segments", 15, [(0, 0), (0, 3), (2, 4)]),
    ("analysis", 12, (3, 2)),
    ("analysis", 16, (8, 1)),
    ("analysis", 9, (1, 2)),
]


@pytest.mark.parametrize("kind,batch,spec", _CASES)
def test_plan_invariants(kind, batch, spec):
  if kind == "segments":
    plan, k = cb.segments_plan(batch, spec), len(spec)
    segments = spec
  else:
    d, w = spec
    plan, k = cb.analysis_plan(batch, d, w), w + 1
    segments = [(0, 0)] * w + [(w, (d - 1) * w)]
  slots = batch // k
  src, pos = plan.sources, plan.positive
  assert src.shape == pos.shape and src.shape[0] == batch
  assert ((src >= -1) & (src < batch)).all()
  for r in range(batch):
    s, j = divmod(r, k)
    p, n = segments[j]
    live = src[r][src[r] >= 0]
    assert r not in live
    assert len(set(live.tolist())) == len(live), "a source appears twice"
    src_slot, src_j = live // k, live % k
    # Every source is an earlier window of its slot; positive <=> same slot.
    assert (src_j < j).all()
    np.testing.assert_array_equal(pos[r][src[r] >= 0], src_slot == s)
    assert not pos[r][src[r] < 0].any()
    # Positives: the p latest earlier windows of the own slot, latest first.
    np.testing.assert_array_equal(live[:p], [s * k + j - 1 - i for i in range(p)])
    # Negatives: nearest other slot first, latest window first within a slot.
    neg = live[p:]
    order = [((sl - s) % slots, -jj) for sl, jj in zip(neg // k, neg % k)]
    assert order == sorted(order)
    assert all(o[0] != 0 for o in order)
    # ...and they are exactly the first n of that enumeration (no gaps).
    want = [((s + o) % slots) * k + jj for o in range(1, slots) for jj in range(j - 1, -1, -1)][:n]
    np.testing.assert_array_equal(neg, want)


def test_all_valid_small_segments_are_accepted_and_invalid_rejected():
  """Exhaustive over small specs: accepted iff p <= j and n <= j * (S - 1)."""
  slots = 3
  for k in (1, 2, 3):
    options = list(itertools.product(range(0, 4), range(0, 6)))
    for segs in itertools.islice(itertools.product(options, repeat=k), 0, None, 7):
      ok = all(p <= j and n <= j * (slots - 1) for j, (p, n) in enumerate(segs))
      if ok:
        plan = cb.segments_plan(slots * k, list(segs))
        assert ((plan.sources >= 0).sum(1) == [p + n for _ in range(slots) for p, n in segs]).all()
      else:
        with pytest.raises(ValueError, match="segments"):
          cb.segments_plan(slots * k, list(segs))
