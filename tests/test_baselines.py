"""Experiment 'baselines': the arms' curricula and one end-to-end run (fot_jax/baselines.py; Transformer-XL's
training and inference paths are tested in test_recurrent_memory.py)."""
import json

import ml_collections
import pytest

from experiments import baselines_stdlib
from fot_jax import baselines, configs

B = ml_collections.ConfigDict({"memory_tokens": 256, "topk": 8, "hybrid_steps": 5})
FOT_PHASES = [{"name": "copy", "task": "copy", "spec": {"d": 1, "w": 1}, "start": 0, "end": 7},
              {"name": "lm", "task": "lm", "spec": {"d": 8, "w": 1}, "start": 7, "end": None}]


def _phases(schedule):
  return [(p.get("name"), p["task"], p["spec"], p["steps"]) for p in schedule.phases]


def test_each_arm_follows_fots_phases_with_its_own_method():
  mt = {"memory": "memorizing", "windows": 2, "memory_tokens": 256, "topk": 8}
  xl = {"memory": "transformer_xl", "windows": 2}
  assert _phases(baselines.arm_schedule("memorizing", FOT_PHASES, 10, 2, B)) == [
      ("copy", "copy", mt, 7), ("lm", "lm", mt, 3)]
  assert _phases(baselines.arm_schedule("transformer_xl", FOT_PHASES, 10, 2, B))[1] == ("lm", "lm", xl, 3)
  assert _phases(baselines.arm_schedule("plain", FOT_PHASES, 10, 2, B))[0][2] == {}
  # the hybrid: FoT's crossbatch, its last 5 steps (reaching into the copy phase) memorizing
  assert _phases(baselines.arm_schedule("hybrid", FOT_PHASES, 10, 2, B)) == [
      ("copy", "copy", {"d": 1, "w": 1}, 5), ("memorizing", "lm", mt, 5)]
  with pytest.raises(ValueError, match="hybrid_steps"):  # no crossbatch step would be left
    baselines.arm_schedule("hybrid", FOT_PHASES, 10, 2, ml_collections.ConfigDict(dict(B, hybrid_steps=10)))


def test_bad_arms_are_named():
  c = baselines_stdlib.get_test_config()
  c.baselines.arms = ("memorizing", "fot")
  with pytest.raises(ValueError, match="baselines.arms"):
    configs.validate_baselines(c)
  c = baselines_stdlib.get_test_config()
  c.baselines.memory_tokens = 100
  with pytest.raises(ValueError, match="multiple of the window"):
    configs.validate_baselines(c)


def test_run_trains_every_arm_and_writes_the_table(tmp_path):
  c = baselines_stdlib.get_test_config()
  out = baselines.run_baselines(c, str(tmp_path))
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["complete"] and saved["memory_tokens"] == [0, 64]
  assert sorted(saved["perplexity"]) == ["fot", "hybrid"]
  assert all(len(v) == 2 and all(p > 1 for p in v) for v in saved["perplexity"].values())
  steps = {arm: t["0"]["steps"] for arm, t in out["training"].items()}
  assert len(set(steps.values())) == 1  # the same steps for every arm
  assert [p["name"] for p in out["training"]["hybrid"]["0"]["phases"]][-1] == "memorizing"
  assert (tmp_path / "baselines.png").exists()
