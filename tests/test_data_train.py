"""The trainer with the slot pipeline: its position is checkpointed, so a stopped and resumed
run gets exactly the batches of the uninterrupted one; the LM job end to end."""
import json

import numpy as np
import pytest

from data_pipelines.slots import SlotBatcher
from experiments import stdlib_lm_tiny
from fot_jax import configs
from fot_jax.runners import lm
from tests.test_raw_config import assert_only_listed_readers, record_config_reads
from fot_jax.curriculum import Schedule
from fot_jax.model.config import get_size
from fot_jax.train import train

CFG = get_size("tiny")


class Recording:
  """Wraps a batch source, recording what the trainer asked for (and forwarding its state)."""

  def __init__(self, inner):
    self.inner, self.seen = inner, {}

  def __call__(self, step):
    batch = self.inner(step)
    self.seen[step] = batch
    return batch

  def state_dict(self):
    return self.inner.state_dict()

  def load_state_dict(self, state):
    self.inner.load_state_dict(state)


def _source():
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 64, int(rng.integers(5, 60))) for _ in range(40)]
  return Recording(SlotBatcher(lambda epoch, skip: iter(docs[skip:]), slots=4, windows=2, window=8, bos=1,
                               eos=2, repeat=True))


def _cfg(steps, every):
  return {"steps": steps, "seed": 0, "loss_on": "all", "log_every": 1, "checkpoint_every": every,
          "optim": {"lr": 1e-2}}


def test_resumed_training_gets_the_uninterrupted_batches(tmp_path):
  sched = lambda: Schedule({"kind": "constant", "spec": {"d": 2, "w": 1}})
  uninterrupted = _source()
  expected = [uninterrupted(step) for step in range(5)]
  part = _source()
  train(CFG, _cfg(3, 3), sched(), part, str(tmp_path))
  saved = json.loads((tmp_path / "checkpoints" / "3" / "extra" / "metadata").read_text())
  assert saved["data"]["next_step"] == 3
  resumed = _source()  # a new process: fresh pipeline, its state from the checkpoint
  train(CFG, _cfg(5, 3), sched(), resumed, str(tmp_path))
  assert sorted(resumed.seen) == [3, 4]
  for step in (3, 4):
    for k in expected[step]:
      np.testing.assert_array_equal(resumed.seen[step][k], expected[step][k])


def test_curriculum_over_two_pipelines_resumes_each_position(tmp_path):
  """Phases over two stateful pipelines: each task's batches are consumed in order (its own
  numbering), and a run stopped inside the second phase resumes both pipelines' positions."""
  sched = lambda: Schedule({"kind": "phases", "phases": [
      {"task": "a", "spec": {"d": 2, "w": 1}, "steps": 2}, {"task": "b", "spec": {"d": 2, "w": 1}}]})
  full = {"a": _source(), "b": _source()}
  train(CFG, _cfg(5, 0), sched(), full, str(tmp_path / "full"), model_meta={"window": 99})
  assert sorted(full["a"].seen) == [0, 1] and sorted(full["b"].seen) == [0, 1, 2]
  # The window evaluation reads is the run's, not the first phase's row length (a warm-up with
  # its own window gave the stdlib LM's checkpoint a 32-token window).
  assert json.loads((tmp_path / "full" / "fot_jax_model.json").read_text())["window"] == 99
  part = {"a": _source(), "b": _source()}
  train(CFG, _cfg(4, 4), sched(), part, str(tmp_path / "part"))  # stops at step 4: b has given 2 batches
  resumed = {"a": _source(), "b": _source()}
  train(CFG, _cfg(5, 4), sched(), resumed, str(tmp_path / "part"))
  assert not resumed["a"].seen and sorted(resumed["b"].seen) == [2]
  for k in full["b"].seen[2]:
    np.testing.assert_array_equal(resumed["b"].seen[2][k], full["b"].seen[2][k])


def test_lm_job_writes_perplexity_results_and_plot(tmp_path):
  config = stdlib_lm_tiny.get_test_config()
  with record_config_reads() as readers:  # the experiment's ConfigDict is read by configs.resolve alone
    results = lm.run(configs.resolve(config), str(tmp_path))
  assert_only_listed_readers(readers)
  saved = json.loads((tmp_path / "results.json").read_text())
  for arm in ("fot", "no_crossbatch"):
    assert saved[arm]["memory_tokens"] == [0, 64, 128]
    assert all(np.isfinite(p) and p > 1 for p in saved[arm]["perplexity"])
    assert saved[arm]["tokens"] == [64, 64, 64]
  assert (tmp_path / "perplexity_vs_memory.png").stat().st_size > 1000
  # The curriculum over tasks: the synthetic copy warm-up (its own window), the stdlib text
  # copy (a repeat view, twice), then stdlib with a share of repeated slots; the baseline mirrors
  # FoT's phases without crossbatch.
  assert [(p["task"], p["start"], p["end"]) for p in saved["fot"]["phases"]] == [
      ("copy", 0, 1), ("repeat", 1, 2), ("repeat", 2, 3), ("mixed", 3, 4),
      ("stdlib_pk", 4, 5)]
  assert [(p["task"], p["spec"]) for p in saved["no_crossbatch"]["phases"]] == [
      ("copy", {}), ("repeat", {}), ("repeat", {}), ("mixed", {}), ("stdlib_pk", {})]
  assert sorted(saved["data"]["fot"]) == ["mixed", "repeat", "stdlib_pk"]  # the warm-up has none
  assert "documents used" in saved["data"]["fot"]["mixed"]["pipeline"]
  assert results["fot"]["perplexity"] == saved["fot"]["perplexity"]


@pytest.mark.parametrize("field,value,message", [
    ("model.overrides.vocab_size", 100, "260 tokens.*model.vocab_size=100"),
    ("data.task", "nope", "unknown task or mixture 'nope'"),
    ("data.windows_per_slot", 3, "windows_per_slot=3"),
    ("data.vocab", "/no/such.model", "data.vocab"),
    ("train.init_from", "/no/such/ckpt", "train.init_from: no checkpoint at '/no/such/ckpt'"),
    ("train.init_from", "runs/no_such_stage/fot", "another training run's model; train that run first .*'runs/no_such_stage'"),
    ("train.trainable", ("memory_attention", "nope/.*"), r"train.trainable: 'nope/.\*' matches no parameter"),
    ("data.repeats.mixed.fraction", 0.0, r"data.repeats.mixed: .*fraction in \(0, 1\]"),
    ("data.repeats.repeat.task", "nope", "unknown task or mixture 'nope'"),
])
def test_lm_validate_names_the_problem(field, value, message):
  config = stdlib_lm_tiny.get_config()
  config.update_from_flattened_dict({field: value})
  with pytest.raises(ValueError, match=message):
    configs.resolve(config)


def test_shared_context_perplexity_equals_a_pass_per_memory_size():
  """The one-pass evaluation (single memory layer) against plain window-by-window processing."""
  from fot_jax.eval import perplexity
  from fot_jax.inference import MemoryInference
  from fot_jax.model.init import init_params
  cfg = get_size("tiny", mem_layers=(1,))
  inference = MemoryInference(cfg, init_params(cfg, 3), window=8)
  streams = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 61))
  shared = perplexity.shared_context_nll(inference, streams, [0, 16, 40], score_tokens=12)
  for m in (0, 16, 40):
    np.testing.assert_allclose(shared[m], perplexity.span_nll(inference, streams, m, 12), rtol=1e-5, atol=1e-5)
  assert not np.allclose(shared[0], shared[40])  # memory changes the prediction
