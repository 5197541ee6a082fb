"""Experiment 'baselines': the arms' curricula and one end-to-end run (fot_jax/runners/baselines.py; Transformer-XL's
training and inference paths are tested in test_recurrent_memory.py)."""
import dataclasses
import json

import pytest

from experiments import baselines_stdlib
from fot_jax import configs
from fot_jax.runners import baselines
from fot_jax.settings import BaselinesSettings

B = BaselinesSettings.from_dict({"arms": ("fot", "memorizing", "hybrid"), "seeds": (0,), "memory_tokens": 256,
                                 "topk": 8, "hybrid_steps": 5})
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
    baselines.arm_schedule("hybrid", FOT_PHASES, 10, 2, dataclasses.replace(B, hybrid_steps=10))


def test_bad_arms_are_named():
  c = baselines_stdlib.get_test_config()
  c.baselines.arms = ("memorizing", "fot")
  with pytest.raises(ValueError, match="baselines.arms"):
    configs.resolve(c, check_data=False)
  c = baselines_stdlib.get_test_config()
  c.baselines.memory_tokens = 100
  with pytest.raises(ValueError, match="multiple of the window"):
    configs.resolve(c, check_data=False)
  c = baselines_stdlib.get_test_config()
  c.baselines.seeds = (0, 1)  # the file's extra_seed_arms name arms this run leaves out: allowed
  configs.resolve(c, check_data=False)
  for extra in (("memorizing",), ("fot", "memorising")):  # FoT missing; a misspelt arm
    c.baselines.extra_seed_arms = extra
    with pytest.raises(ValueError, match="baselines.extra_seed_arms"):
      configs.resolve(c, check_data=False)


def test_run_trains_every_arm_and_writes_the_table(tmp_path):
  c = baselines_stdlib.get_test_config()
  out = baselines.run(configs.resolve(c), str(tmp_path))
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["complete"] and saved["memory_tokens"] == [0, 64]
  assert sorted(saved["perplexity"]) == ["fot", "hybrid"]
  assert all(len(v) == 2 and all(p > 1 for p in v) for v in saved["perplexity"].values())
  steps = {arm: t["0"]["steps"] for arm, t in out["training"].items()}
  assert len(set(steps.values())) == 1  # the same steps for every arm
  assert [p["name"] for p in out["training"]["hybrid"]["0"]["phases"]][-1] == "memorizing"
  assert (tmp_path / "baselines.png").exists()


def _part(arms_seeds, mems=(0, 64)):
  """A results dict as run_baselines writes it, for the arm-seeds given (perplexity = seed + arm index)."""
  order = list(baselines.ARMS)
  seeds = {a: {str(s): [float(s + order.index(a) + i) for i in range(len(mems))] for s in ss}
           for a, ss in arms_seeds.items()}
  return {"config": {"baselines": {"arms": order}}, "memory_tokens": list(mems), "n_docs": 2,
          "eval_mode": "topk (top-32)", "seeds": seeds, "wall_seconds": 10.0,
          "training": {a: {s: {"steps": 1} for s in v} for a, v in seeds.items()},
          "rd": {a: {"d": [2], "r_d": [0.1 * order.index(a)]} for a in arms_seeds},
          "passkey": {a: {"lengths": [256], "accuracy_per_length": [0.5]} for a in arms_seeds}}


def test_merge_joins_arms_and_seeds_run_apart(tmp_path):
  """Arms and seeds split over processes merge into one table: per-seed values kept, means and
  spreads over all seeds, arms in the experiment's order; overlaps and other evaluations refused."""
  a = _part({"fot": (0,), "transformer_xl": (0,)})
  b = _part({"plain": (0,), "memorizing": (0,)})
  c = _part({"fot": (1,), "memorizing": (1,)})
  m = baselines.merge_results([a, b, c])
  assert list(m["perplexity"]) == ["fot", "memorizing", "transformer_xl", "plain"]
  assert m["seeds"]["fot"] == {"0": [0.0, 1.0], "1": [1.0, 2.0]}
  assert m["perplexity"]["fot"] == [0.5, 1.5] and m["spread"]["fot"] == [1.0, 1.0]
  assert m["spread"]["plain"] == [0.0, 0.0] and m["rd"]["memorizing"] == {"d": [2], "r_d": [0.1]}
  assert m["wall_seconds"] == 30.0 and m["merged_from"] == 3
  again = _part({"fot": (0,), "hybrid": (0,)})  # FoT again, as each process runs it before its arms
  assert baselines.merge_results([a, again])["seeds"]["fot"] == {"0": [0.0, 1.0]}
  again["seeds"]["fot"]["0"] = [0.0, 1.5]
  with pytest.raises(ValueError, match="fot seed 0 is in more than one part with other perplexities"):
    baselines.merge_results([a, again])
  with pytest.raises(ValueError, match=r"part 1 evaluates differently from part 0 in \['memory_tokens'\]"):
    baselines.merge_results([a, _part({"plain": (0,)}, mems=(0, 128))])
  for i, part in enumerate((a, c)):
    (tmp_path / f"p{i}").mkdir()
    (tmp_path / f"p{i}" / "results.json").write_text(json.dumps(part))
  (tmp_path / "p2").mkdir()  # FoT seed 0 again, with other perplexities
  (tmp_path / "p2" / "results.json").write_text(json.dumps(again))
  (tmp_path / "dict").mkdir()  # a dictionary-lookup run's results
  (tmp_path / "dict" / "results.json").write_text(json.dumps({"fot": {"accuracy": [1.0]}}))
  for bad in (["p0", "p2"], ["p0", "nowhere"], ["p0", "dict"]):  # disagree, no results, not a baselines run
    with pytest.raises(SystemExit) as exit_:  # one line, exit status 2, nothing written
      baselines.main(["--out", str(tmp_path / "bad")] + [str(tmp_path / p) for p in bad])
    assert exit_.value.code == 2 and not (tmp_path / "bad").exists()
  baselines.main(["--out", str(tmp_path / "all"), str(tmp_path / "p0"), str(tmp_path / "p1")])
  out = json.loads((tmp_path / "all" / "results.json").read_text())
  assert out["complete"] and out["seeds"]["memorizing"] == {"1": [2.0, 3.0]}
  assert (tmp_path / "all" / "baselines.png").exists()
  table = (tmp_path / "all" / "baselines.md").read_text()
  assert "| fot | 1 | 1.000 | 2.000 |" in table and "| fot | mean | **0.500** | **1.500** |" in table
  assert "| memorizing | 0.100 |" in table and "- fot: 256: 0.50" in table
