"""Dictionary lookup data and evaluation (the demo's task)."""
import numpy as np
import pytest

from data_pipelines.dictionary_lookup import NUM_SPECIAL, DictionaryBatches, DictionaryTask, lm_example
from fot_jax.eval import dictionary
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params

TASK = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=2, value_len=2, n_defs=8, n_queries=4)


def test_vkv_layout_scores_closing_values():
  task = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=4,
                        n_queries=4, layout="vkv")
  doc = task.document(np.random.default_rng(0))
  defs = doc["tokens"][:task.defs_len].reshape(4, 3)
  np.testing.assert_array_equal(defs[:, 0], defs[:, 2])  # v k v
  assert (defs[:, 1] < task.value_offset).all()
  assert doc["lm_mask"][:task.defs_len].reshape(4, 3)[:, 2].all()
  assert not doc["value_mask"][:task.defs_len].any()
  with pytest.raises(ValueError, match="layout"):
    DictionaryTask(layout="kvk").validate()


def test_document_layout_and_scoring():
  doc = TASK.document(np.random.default_rng(0))
  toks, vmask = doc["tokens"], doc["value_mask"]
  assert len(toks) == TASK.doc_len == 8 * 4 + 4 * 4
  defs = toks[:TASK.defs_len].reshape(8, 4)
  table = {tuple(e[:2]): tuple(e[2:]) for e in defs}
  assert len(table) == 8  # distinct keys
  for e in toks[TASK.defs_len:].reshape(4, 4):
    assert table[tuple(e[:2])] == tuple(e[2:])  # every query asks a defined key
  assert (defs[:, :2] < TASK.value_offset).all() and (defs[:, 2:] >= TASK.value_offset).all()
  assert (toks >= NUM_SPECIAL).all()
  assert vmask.sum() == 4 * 2 and not vmask[:TASK.defs_len].any()
  ex = lm_example(toks[None], vmask[None])
  # A scored position's target is a value token of a query.
  assert (ex["targets"][ex["loss_mask"]] >= TASK.value_offset).all()


def test_batches_are_deterministic_and_packed():
  b = DictionaryBatches(TASK, slots=3, window=TASK.doc_len // 2, seed=7)
  x, y = b(5), b(5)
  np.testing.assert_array_equal(x["inputs"], y["inputs"])
  assert x["inputs"].shape == (6, TASK.doc_len // 2)
  assert not np.array_equal(b(5)["inputs"], b(6)["inputs"])
  # Rows 2s and 2s+1 are the two windows of one document.
  assert x["loss_mask"][0::2].sum() == 0 and x["loss_mask"][1::2].sum() == 3 * 4 * 2


def test_difficulty_curriculum_repeats_definitions():
  b = DictionaryBatches(TASK, slots=2, window=TASK.doc_len, seed=0, distinct_start=2, distinct_every=10)
  assert b.distinct(0) == 2 and b.distinct(10) == 4 and b.distinct(100) == 8
  defs = b(0)["inputs"][0][:TASK.defs_len].reshape(8, 4)
  assert len({tuple(e[:2]) for e in defs}) == 2


def test_eval_set_targets_are_unique_in_memory():
  ev = dictionary.DictionaryEvalSet(TASK, n_docs=3, max_context=4 * TASK.defs_len, seed=0)
  target_keys = {tuple(k) for d in ev.docs for k in d["keys"]}
  pool_keys = {tuple(e[:2]) for e in ev.pool.reshape(-1, 4)}
  assert not target_keys & pool_keys
  s = ev.stream(1, 4 * TASK.defs_len)
  assert len(s) == 4 * TASK.defs_len + TASK.queries_len
  c = ev.depths(4 * TASK.defs_len)[1]
  np.testing.assert_array_equal(s[c * TASK.defs_len:(c + 1) * TASK.defs_len], ev.docs[1]["tokens"][:TASK.defs_len])


@pytest.mark.parametrize("mode", ["dense", "topk"])
def test_fast_path_equals_window_by_window_inference(mode):
  cfg = get_size("tiny", vocab_size=TASK.vocab_size, mem_layers=(1,))
  params = init_params(cfg, 0)
  import jax
  params = jax.tree_util.tree_map(lambda x: x * 5.0 if x.ndim == 2 else x, params)  # peaky attention
  window = TASK.defs_len  # 32: the query block (16) starts a window of its own
  ev = dictionary.DictionaryEvalSet(TASK, n_docs=3, max_context=6 * TASK.defs_len, seed=3)
  for context in (2 * TASK.defs_len, 6 * TASK.defs_len):
    fast = dictionary.evaluate(cfg, params, ev, window, [context], mode=mode, topk=8, batch=2,
                               chunk=64, log=lambda s: None)
    ref = dictionary.evaluate_generic(cfg, params, ev, window, context, mode=mode, topk=8, chunk=64)
    assert fast["accuracy"][0] == pytest.approx(ref.mean())
    assert fast["tokens_in_memory"][0] == context


def test_fast_path_logits_equal_generic_logits():
  """Stronger than equal accuracy: the query-window logits are the same."""
  import jax
  from fot_jax.inference import MemoryInference
  cfg = get_size("tiny", vocab_size=TASK.vocab_size, mem_layers=(1,))
  params = jax.tree_util.tree_map(lambda x: x * 5.0 if x.ndim == 2 else x, init_params(cfg, 1))
  window, context = TASK.defs_len, 4 * TASK.defs_len
  ev = dictionary.DictionaryEvalSet(TASK, n_docs=2, max_context=context, seed=4)
  infer = MemoryInference(cfg, params, window, "dense")
  stream = np.stack([ev.stream(i, context) for i in range(2)])
  ref = infer.process(stream, infer.new_memory(2))[:, context:]
  captured = {}
  real = dictionary._query_accuracy

  def spy(task, logits_q, docs):
    captured.setdefault("logits", []).append(logits_q)
    return real(task, logits_q, docs)

  dictionary._query_accuracy = spy
  try:
    dictionary.evaluate(cfg, params, ev, window, [context], mode="dense", batch=2, chunk=64, log=lambda s: None)
  finally:
    dictionary._query_accuracy = real
  np.testing.assert_allclose(captured["logits"][0], ref, atol=2e-5, rtol=1e-5)


def test_bad_context_sizes_are_rejected():
  cfg = get_size("tiny", vocab_size=TASK.vocab_size, mem_layers=(1,))
  ev = dictionary.DictionaryEvalSet(TASK, n_docs=1, max_context=4 * TASK.defs_len, seed=0)
  with pytest.raises(ValueError, match="memory_tokens"):
    dictionary.evaluate(cfg, init_params(cfg, 0), ev, TASK.defs_len, [TASK.defs_len + 1], log=lambda s: None)
  with pytest.raises(ValueError, match="memory_tokens"):
    dictionary.DictionaryEvalSet(TASK, n_docs=1, max_context=TASK.defs_len + 3)
