"""Doc-pinned slot batching against an independent re-derivation of the slot streams."""
import collections

import numpy as np
import pytest

from data_pipelines.slots import EmptySourceError, SlotBatcher

BOS, EOS, PAD = 1, 2, 0


def _docs(n, seed=0, max_len=90):
  """Documents whose tokens encode (document, position) uniquely: 10 + 1000 * d + i."""
  rng = np.random.default_rng(seed)
  return [10 + 1000 * d + np.arange(int(rng.integers(0, max_len))) for d in range(n)]


def _opener(docs, shuffle_seed=None):
  def open_epoch(epoch, skip):
    order = np.arange(len(docs))
    if shuffle_seed is not None:
      order = np.random.default_rng([shuffle_seed, epoch]).permutation(len(docs))
    return iter([docs[i] for i in order[skip:]])
  return open_epoch


def _batcher(docs, repeat=False, shuffle_seed=None, **kw):
  args = dict(slots=3, windows=2, window=8, bos=BOS, eos=EOS, pad=PAD, min_doc_len=1, repeat=repeat)
  args.update(kw)
  return SlotBatcher(_opener(docs, shuffle_seed), **args)


def _drain(batcher, start=0, limit=10000):
  out = []
  for step in range(start, limit):
    try:
      out.append(batcher(step))
    except StopIteration:
      break
  return out


def _slot_streams(batches, slots, windows):
  """Per slot: its rows in order (batch by batch, window by window) -> flat inputs/targets/ids/mask."""
  streams = collections.defaultdict(lambda: collections.defaultdict(list))
  for b in batches:
    for s in range(slots):
      for key, x in b.items():
        streams[s][key].append(x[s * windows:(s + 1) * windows].reshape(-1))
  return {s: {k: np.concatenate(v) for k, v in d.items()} for s, d in streams.items()}


def test_each_slot_gets_consecutive_windows_of_one_stream():
  docs = _docs(40)
  batcher = _batcher(docs, slots=3, windows=2, window=8)
  batches = _drain(batcher)
  assert all(b["inputs"].shape == (6, 8) for b in batches)
  owners = collections.defaultdict(set)
  for s, st in _slot_streams(batches, 3, 2).items():
    # targets are the inputs shifted by one, across rows and across batches
    np.testing.assert_array_equal(st["targets"][:-1], st["inputs"][1:])
    real = st["doc_ids"] >= 0
    # the slot's stream is whole documents, `bos doc eos`, in the order they entered the slot
    order = list(dict.fromkeys(st["doc_ids"][real]))
    expected = np.concatenate([np.concatenate([[BOS], docs[d], [EOS]]) for d in order])
    np.testing.assert_array_equal(st["inputs"][real], expected[:real.sum()])
    # a document never changes slot and its tokens are contiguous in the stream
    ids = st["doc_ids"][real]
    assert all((ids == d).sum() == np.ptp(np.flatnonzero(ids == d)) + 1 for d in order)
    for d in order:
      owners[d].add(s)
  assert all(len(v) == 1 for v in owners.values())  # a document never changes slot


def test_every_token_is_scored_exactly_once_and_bos_never():
  docs = _docs(50, seed=1)
  batches = _drain(_batcher(docs, slots=4, windows=3, window=5))
  seen = collections.Counter()
  for b in batches:
    m = b["loss_mask"]
    seen.update(zip(b["doc_ids"][m].tolist(), b["targets"][m].tolist()))
    assert not (b["targets"][m] == BOS).any()
  expected = collections.Counter((d, int(t)) for d, doc in enumerate(docs) if len(doc)
                                 for t in np.concatenate([doc, [EOS]]))
  assert seen == expected  # each document token and its eos exactly once (empty documents dropped)


def test_stop_and_resume_gives_the_same_batches_across_epochs():
  docs = _docs(12, seed=2)
  full = _drain(_batcher(docs, repeat=True, shuffle_seed=5), limit=40)  # several epochs
  first = _batcher(docs, repeat=True, shuffle_seed=5)
  _drain(first, limit=17)
  state = first.state_dict()
  resumed = _batcher(docs, repeat=True, shuffle_seed=5)
  resumed.load_state_dict(state)
  rest = _drain(resumed, start=17, limit=40)
  assert len(rest) == 23
  for a, b in zip(full[17:], rest):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_finite_checksum_holds_across_stop_and_resume():
  docs = _docs(30, seed=3)
  first = _batcher(docs)
  part = _drain(first, limit=5)
  resumed = _batcher(docs)
  resumed.load_state_dict(first.state_dict())
  batches = part + _drain(resumed, start=5)
  seen = collections.Counter()
  for b in batches:
    m = b["loss_mask"]
    seen.update(zip(b["doc_ids"][m].tolist(), b["targets"][m].tolist()))
  assert seen == collections.Counter((d, int(t)) for d, doc in enumerate(docs) if len(doc)
                                     for t in np.concatenate([doc, [EOS]]))


def test_resume_with_another_slot_or_host_count_fails_clearly():
  docs = _docs(10)
  a = _batcher(docs)
  _drain(a, limit=2)
  for kw in ({"slots": 4}, {"num_shards": 2}):
    with pytest.raises(ValueError, match="does not match this run.*(slots|num_shards)"):
      _batcher(docs, **kw).load_state_dict(a.state_dict())


def test_batches_must_be_requested_in_order():
  b = _batcher(_docs(5))
  b(0)
  with pytest.raises(ValueError, match="step 5 requested but the pipeline is at step 1"):
    b(5)


def test_min_length_filter_and_truncation_are_counted():
  docs = _docs(30, seed=4)
  b = _batcher(docs, min_doc_len=20, max_doc_len=50)
  batches = _drain(b)
  lengths = [len(d) for d in docs]
  assert b.stats["dropped_short"] == sum(0 < n < 20 for n in lengths)
  assert b.stats["dropped_empty"] == lengths.count(0)
  assert b.stats["truncated_long"] == sum(n > 50 for n in lengths)
  used = {int(d) for x in batches for d in np.unique(x["doc_ids"]) if d >= 0}
  assert used == {d for d, n in enumerate(lengths) if n >= 20}
  assert "dropped" in b.report()


def test_empty_source_fails_at_start_naming_it():
  with pytest.raises(EmptySourceError, match="my-source yielded no documents"):
    _batcher([], name="my-source").check_nonempty()
  with pytest.raises(EmptySourceError, match="min_doc_len=1000"):
    _batcher(_docs(5), repeat=True, min_doc_len=1000).check_nonempty()
