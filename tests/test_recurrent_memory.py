"""The Memorizing Transformer and Transformer-XL training baselines (fot_jax/recurrent.py)."""
import shutil

import jax
import numpy as np
import pytest

from fot_jax import recurrent
from fot_jax.curriculum import Schedule
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel
from fot_jax.model.memory import MemoryBlock
from fot_jax.train import TrainState, make_optimizer, make_train_step, train

T = 8
CFG = get_size("tiny")  # 3 layers, memory layer 1, GQA
PARAMS = init_params(CFG, 0)
MODEL = LlamaModel(CFG)


def _tokens(shape, seed=1):
  return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, 0, CFG.vocab_size))


@pytest.mark.parametrize("impl,positions", [("dense", "first"), ("blockwise", "none")])
def test_transformer_xl_equals_a_causal_pass_over_both_windows(impl, positions):
  """The second window's logits with the first window's cached keys/values equal a plain causal
  pass over the two windows concatenated (same weights), with YaRN positions or none."""
  scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": T}
  cfg = get_size("tiny", attention_impl=impl, attention_block=4, mem_positions=positions, rope_scaling=scaling)
  model, toks = LlamaModel(cfg), _tokens((2, 2 * T))
  full, _ = model.apply({"params": PARAMS}, toks)
  rs = recurrent.recurrent_spec({"memory": "transformer_xl", "windows": 2})
  carry = recurrent.init_carry(cfg, rs, 2, T)
  first, carry = recurrent.window_forward(model, PARAMS, rs, toks[:, :T], None, carry)
  second, _ = recurrent.window_forward(model, PARAMS, rs, toks[:, T:], None, carry)
  np.testing.assert_allclose(np.asarray(first), np.asarray(full[:, :T]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(second), np.asarray(full[:, T:]), atol=1e-5)
  if impl == "dense":  # inference: the same recurrence window by window (the evaluation's path)
    xl = recurrent.XLInference(cfg, PARAMS, T)
    np.testing.assert_allclose(xl.process(toks, xl.new_memory(2)), np.asarray(full), atol=1e-5)


def _window_keys(tokens):
  """The memory layer's memory keys/values of windows seen alone (layer 1's input does not
  depend on memory, so this is independent of what the recurrent path carried)."""
  _, aux = MODEL.apply({"params": PARAMS}, tokens, want_mem_kv=True)
  return aux["mem_kv"][1]


def test_memorizing_memory_holds_the_same_documents_earlier_keys_only():
  """Slot 0 streams one document through three windows; slot 1 starts a new document in its
  third window. After three windows memory holds exactly each slot's earlier keys with their
  documents; the third window of slot 0 reads its two earlier windows (as a dense memory of the
  independently computed keys does), slot 1's new document reads nothing (as no memory does)."""
  rs = recurrent.recurrent_spec({"memory": "memorizing", "memory_tokens": 4 * T, "topk": 0})
  toks = _tokens((2, 3 * T), seed=3)
  doc = np.zeros((2, 3 * T), np.int32)
  doc[1] = 5
  doc[1, 2 * T:] = 6  # slot 1: a new document in the third window
  carry = recurrent.init_carry(CFG, rs, 2, T)
  for j in range(2):
    _, carry = recurrent.window_forward(MODEL, PARAMS, rs, toks[:, j * T:(j + 1) * T], doc[:, j * T:(j + 1) * T],
                                        carry)
  k, v, d = (np.asarray(x) for x in carry["layers_1"])
  k0, v0 = _window_keys(toks[:, :T])
  k1, v1 = _window_keys(toks[:, T:2 * T])
  np.testing.assert_allclose(k[:, 2 * T:], np.concatenate([k0, k1], 1), atol=1e-6)
  np.testing.assert_allclose(v[:, 2 * T:], np.concatenate([v0, v1], 1), atol=1e-6)
  assert (d[:, :2 * T] == -1).all() and (d[0, 2 * T:] == 0).all() and (d[1, 2 * T:] == 5).all()

  third = toks[:, 2 * T:]
  logits, _ = recurrent.window_forward(MODEL, PARAMS, rs, third, doc[:, 2 * T:], carry)
  block = MemoryBlock(np.concatenate([k0, k1], 1), np.concatenate([v0, v1], 1), np.ones((2, 2 * T), bool))
  dense, _ = MODEL.apply({"params": PARAMS}, third, memories={1: [block]}, mem_mode="dense")
  alone, _ = MODEL.apply({"params": PARAMS}, third)
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(dense[0]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(alone[1]), atol=1e-5)
  assert np.abs(np.asarray(dense[1]) - np.asarray(alone[1])).max() > 1e-3  # memory would have mattered


class _Streams:
  """One long document per slot (doc id = slot), random tokens: memory carries over steps."""

  def __init__(self, slots, windows):
    self.slots, self.windows = slots, windows

  def __call__(self, step):
    rows = self.slots * self.windows
    toks = _tokens((rows, T + 1), seed=100 + step)
    doc = np.repeat(np.arange(self.slots, dtype=np.int32), self.windows)[:, None] * np.ones((1, T), np.int32)
    return {"inputs": toks[:, :T], "targets": toks[:, 1:], "loss_mask": np.ones((rows, T), bool), "doc_ids": doc}


def _tc(steps, every=0):
  return {"steps": steps, "seed": 0, "log_every": 1, "checkpoint_every": every, "tensorboard": False,
          "optim": {"lr": 1e-2}}


def _hybrid():
  """The hybrid: crossbatch (d=2, w=1), then the Memorizing Transformer on the same packs."""
  return Schedule({"kind": "phases", "phases": [
      {"name": "fot", "spec": {"d": 2, "w": 1}, "steps": 2},
      {"name": "mt", "spec": {"memory": "memorizing", "windows": 2, "memory_tokens": 4 * T, "topk": 4}}]})


def test_hybrid_stop_and_resume_equals_uninterrupted(tmp_path):
  """Crossbatch, then memorizing: a run resumed from its step-3 checkpoint (the first
  memorizing step saved, with the memory beside the train state) ends as the uninterrupted one."""
  data = _Streams(slots=2, windows=2)
  full = train(CFG, _tc(5, every=3), _hybrid(), data, str(tmp_path / "full"))
  assert (tmp_path / "full" / "checkpoints" / "3" / "carry").is_dir()
  shutil.copytree(tmp_path / "full", tmp_path / "part")
  shutil.rmtree(tmp_path / "part" / "checkpoints" / "5")  # as if stopped after step 3
  resumed = train(CFG, _tc(5, every=3), _hybrid(), data, str(tmp_path / "part"))
  assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"][3:]]
  assert np.isnan(full["history"][-1]["rd"]) and np.isfinite(full["history"][0]["rd"])
  for a, b in zip(jax.tree_util.tree_leaves(full["params"]), jax.tree_util.tree_leaves(resumed["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_transformer_xl_accumulation_splits_slots_not_windows():
  """Transformer-XL over 2 accumulation groups of slots: the loss and carry of one batch."""
  rs = recurrent.recurrent_spec({"memory": "transformer_xl", "windows": 2})
  batch = _Streams(slots=4, windows=2)(0)
  opt = make_optimizer({"lr": 1e-2})
  out = []
  for accum in (1, 2):
    params = jax.tree_util.tree_map(jax.numpy.array, PARAMS)  # the step donates its state
    state = TrainState(jax.numpy.zeros((), jax.numpy.int32), params, opt.init(params))
    step = make_train_step(CFG, opt, accum, recurrent=rs)
    _, metrics, carry = step(state, batch, recurrent.init_carry(CFG, rs, 4, T))
    out.append((float(metrics["loss"]), np.asarray(carry["layers_2"][0])))
  np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-6)
  np.testing.assert_allclose(out[0][1], out[1][1], atol=1e-6)
  assert np.abs(out[0][1]).max() > 0  # the carry holds the last windows' keys


@pytest.mark.parametrize("spec,match", [
    ({"memory": "retro"}, "must be one of"),
    ({"memory": "memorizing"}, "memory_tokens"),
    ({"memory": "transformer_xl", "topk": 8}, "memorizing settings"),
    ({"memory": "memorizing", "memory_tokens": 64, "d": 2}, "do not mix"),
])
def test_bad_recurrent_specs_are_named(spec, match):
  with pytest.raises(ValueError, match=match):
    recurrent.recurrent_spec(spec)


def test_memory_size_must_be_whole_windows():
  with pytest.raises(ValueError, match="multiple of the window"):
    recurrent.init_carry(CFG, recurrent.recurrent_spec({"memory": "memorizing", "memory_tokens": 12}), 2, T)
