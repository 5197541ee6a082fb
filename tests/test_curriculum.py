"""Schedules of the crossbatch spec over training steps (fot_jax/curriculum.py)."""
import json

import pytest

from fot_jax import crossbatch as cb
from fot_jax.curriculum import Schedule

D2 = {"d": 2, "w": 1}
D64 = {"d": 64, "w": 1}
D128 = {"d": 128, "w": 1}
D1 = {"d": 1, "w": 1}


def test_constant():
  sched = Schedule({"kind": "constant", "spec": {"d": 8, "w": 3}})
  assert all(sched.spec(step) == {"d": 8, "w": 3} for step in (0, 1, 17, 10 ** 6))
  assert sched.pack == 4
  # The spec turns into a plan for a batch of whole packs.
  plan = cb.plan_from_spec(32, sched.spec(5))
  assert plan.sources.shape == (32, 24)


def test_constant_segments_and_default():
  segs = [(0, 0), (1, 1), (2, 1), (3, 0)]
  sched = Schedule({"kind": "constant", "spec": {"segments": segs}})
  assert sched.spec(3) == {"segments": segs} and sched.pack == 4
  # No config at all: constant without crossbatch (pack 1, empty plan).
  none = Schedule(None)
  assert none.spec(0) == {} and none.pack == 1
  assert cb.plan_from_spec(4, none.spec(0)).sources.shape == (4, 0)


def test_stages_switch_at_step():
  sched = Schedule({"kind": "stages", "stages": [(0, D2), (450, D64)]})
  assert sched.spec(0) == D2
  assert sched.spec(449) == D2
  assert sched.spec(450) == D64
  assert sched.spec(10 ** 6) == D64
  assert sched.pack == 2


def test_stages_three_and_validation():
  sched = Schedule({"kind": "stages", "stages": [(0, D1), (10, D2), (20, D64)]})
  assert [sched.spec(s)["d"] for s in (0, 9, 10, 19, 20)] == [1, 1, 2, 2, 64]
  with pytest.raises(ValueError, match="stages"):
    Schedule({"kind": "stages", "stages": [(5, D2), (10, D64)]})  # must begin at 0
  with pytest.raises(ValueError, match="stages"):
    Schedule({"kind": "stages", "stages": [(0, D2), (20, D64), (10, D128)]})  # increasing


def test_random_is_deterministic_per_step_and_seed():
  cfg = {"kind": "random", "choices": [D2, D128], "seed": 3}
  a, b = Schedule(cfg), Schedule(cfg)
  steps = list(range(50))
  seq_a = [a.spec(s)["d"] for s in steps]
  # Another instance, queried in reverse order and twice, draws the same spec per step.
  seq_b = [b.spec(s)["d"] for s in reversed(steps)][::-1]
  assert seq_a == seq_b == [a.spec(s)["d"] for s in steps]
  assert set(seq_a) == {2, 128}, "both choices must appear over 50 steps"
  # Not simply alternating / constant in blocks: both choices are drawn throughout.
  assert set(seq_a[:25]) == {2, 128} and set(seq_a[25:]) == {2, 128}
  other = [Schedule(dict(cfg, seed=4)).spec(s)["d"] for s in steps]
  assert other != seq_a, "the seed must change the draws"


def test_random_state_round_trip():
  cfg = {"kind": "random", "choices": [D2, D128], "seed": 0}
  a = Schedule(cfg)
  b = Schedule(cfg)
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  assert [a.spec(s) for s in range(100, 130)] == [b.spec(s) for s in range(100, 130)]


def _metric_cfg(**kw):
  cfg = {"kind": "metric", "before": D1, "after": D128, "metric": "accuracy",
         "threshold": 0.98, "window": 3, "max_step": None}
  cfg.update(kw)
  return cfg


def _feed(sched, start, values):
  """Train-loop order: spec(step) is used by step, then its metrics are observed."""
  used = []
  for i, v in enumerate(values):
    step = start + i
    used.append(sched.spec(step)["d"])
    sched.observe(step, {"accuracy": v, "loss": 1.0})
  return used


def test_metric_switches_the_step_after_the_average_reaches_threshold():
  sched = Schedule(_metric_cfg())
  # Moving averages over 3 steps, from step 2: .827 .977 .977 .977 .9817 -> reached at step 6.
  values = [0.5, 0.99, 0.99, 0.95, 0.99, 0.99, 0.965]
  used = _feed(sched, 0, values[:6])
  assert used == [1] * 6
  assert sched.spec(6)["d"] == 1 and sched.spec(7)["d"] == 1
  used = _feed(sched, 6, values[6:])
  assert used == [1]
  assert sched.spec(6)["d"] == 1
  assert sched.spec(7)["d"] == 128
  assert sched.spec(10 ** 5)["d"] == 128
  # Once switched it stays switched, whatever the metric does later.
  _feed(sched, 7, [0.0, 0.0, 0.0, 0.0])
  assert sched.spec(12)["d"] == 128


def test_metric_below_threshold_does_not_switch():
  sched = Schedule(_metric_cfg())
  used = _feed(sched, 0, [0.979] * 30 + [0.97, 0.99])  # averages stay below 0.98
  assert set(used) == {1}
  assert sched.spec(32)["d"] == 1 and sched.spec(10 ** 6)["d"] == 1


def test_metric_needs_a_full_window():
  # A single perfect step is not a moving average over 3 steps.
  sched = Schedule(_metric_cfg())
  _feed(sched, 0, [1.0])
  assert sched.spec(1)["d"] == 1
  _feed(sched, 1, [1.0, 1.0])
  assert sched.spec(2)["d"] == 1 and sched.spec(3)["d"] == 128


def test_metric_max_step_forces_the_switch():
  sched = Schedule(_metric_cfg(max_step=20))
  used = _feed(sched, 0, [0.1] * 25)
  assert used[:20] == [1] * 20
  assert used[20:] == [128] * 5
  assert sched.spec(19)["d"] == 1 and sched.spec(20)["d"] == 128


def test_metric_missing_metric_is_a_clear_error():
  sched = Schedule(_metric_cfg(metric="token_accuracy"))
  with pytest.raises(ValueError, match="token_accuracy"):
    sched.observe(0, {"accuracy": 1.0})


def test_metric_state_round_trip_continues_identically():
  values = [0.5, 0.99, 0.99, 0.95, 0.99, 0.99, 0.99, 0.2, 0.99]
  # Reference run, uninterrupted.
  full = Schedule(_metric_cfg())
  used_full = _feed(full, 0, values)
  assert 128 in used_full and 1 in used_full
  # Interrupted after step 4 (history .99 .95 .99; the switch comes after step 6).
  first = Schedule(_metric_cfg())
  used_first = _feed(first, 0, values[:5])
  state = json.loads(json.dumps(first.state_dict()))  # saved with a checkpoint
  resumed = Schedule(_metric_cfg())
  resumed.load_state_dict(state)
  used_resumed = _feed(resumed, 5, values[5:])
  assert used_first + used_resumed == used_full
  assert resumed.state_dict() == full.state_dict()
  # Without the restored history the resumed run would switch later: the state matters.
  fresh = Schedule(_metric_cfg())
  assert used_first + _feed(fresh, 5, values[5:]) != used_full


def test_metric_state_round_trip_after_switch():
  sched = Schedule(_metric_cfg())
  _feed(sched, 0, [0.99] * 3)
  assert sched.spec(3)["d"] == 128
  resumed = Schedule(_metric_cfg())
  assert resumed.spec(3)["d"] == 1
  resumed.load_state_dict(json.loads(json.dumps(sched.state_dict())))
  assert resumed.spec(2)["d"] == 1 and resumed.spec(3)["d"] == 128
  # A switched schedule ignores later metrics (and does not fail on missing ones).
  resumed.observe(4, {"loss": 1.0})
  assert resumed.spec(100)["d"] == 128


@pytest.mark.parametrize("cfg", [
    {"kind": "stages", "stages": [(0, {"d": 2, "w": 1}), (10, {"d": 2, "w": 3})]},
    {"kind": "random", "choices": [{"d": 2, "w": 1}, {"segments": [(0, 0), (1, 1), (2, 1)]}]},
    {"kind": "metric", "before": {"d": 1, "w": 0}, "after": {"d": 128, "w": 1},
     "threshold": 0.98, "window": 2},
])
def test_mixing_pack_sizes_is_rejected(cfg):
  with pytest.raises(ValueError) as info:
    Schedule(cfg)
  msg = str(info.value)
  assert "pack size" in msg and "curriculum" in msg, msg


def test_same_pack_size_in_both_notations_is_accepted():
  sched = Schedule({"kind": "stages", "stages": [
      (0, {"d": 2, "w": 3}), (10, {"segments": [(0, 0), (1, 1), (2, 1), (3, 0)]})]})
  assert sched.pack == 4
  assert sched.spec(10) == {"segments": [(0, 0), (1, 1), (2, 1), (3, 0)]}


def test_unknown_kind_is_rejected():
  with pytest.raises(ValueError, match="kind"):
    Schedule({"kind": "cosine"})


# -- phases: a curriculum over data tasks (copy warm-up -> lookup at d=1 -> negatives) --
def _phases_cfg(**kw):
  cfg = {"kind": "phases", "stop_after_last": True, "phases": [
      {"name": "copy", "task": "copy", "spec": D1, "metric": "accuracy", "threshold": 0.9, "window": 2,
       "max_steps": 10},
      {"name": "lookup", "task": "dictionary", "spec": D1, "metric": "accuracy", "threshold": 0.9, "window": 2},
      {"name": "negatives", "task": "dictionary", "spec": D64, "steps": 3}]}
  cfg.update(kw)
  return cfg


def _feed_phases(sched, start, values):
  used = []
  for i, v in enumerate(values):
    step = start + i
    if sched.finished(step):
      break
    used.append((sched.task(step), sched.spec(step)["d"]))
    sched.observe(step, {"accuracy": v})
  return used


def test_phases_switch_task_and_spec_on_thresholds_then_stop():
  sched = Schedule(_phases_cfg())
  assert sched.tasks() == ["copy", "dictionary", "dictionary"] and sched.pack == 2
  used = _feed_phases(sched, 0, [0.1, 0.95, 0.95, 0.5, 0.92, 0.93, 0.0, 0.0, 0.0, 0.0, 0.0])
  # copy: average over 2 reaches 0.9 after step 2; lookup from step 3, reached after step 5;
  # negatives for 3 steps (6, 7, 8), then the run stops before step 9.
  assert used == [("copy", 1)] * 3 + [("dictionary", 1)] * 3 + [("dictionary", 64)] * 3
  assert sched.starts == [0, 3, 6] and sched.finished_at == 9
  assert sched.finished(9) and not sched.finished(8)
  assert [(p["name"], p["start"], p["end"]) for p in sched.summary()] == [
      ("copy", 0, 3), ("lookup", 3, 6), ("negatives", 6, 9)]
  # Past steps keep the phase they trained in.
  assert sched.task(2) == "copy" and sched.spec(5)["d"] == 1 and sched.spec(6)["d"] == 64
  # Each task's batches are numbered in order: the dictionary's stream starts at step 3.
  assert [sched.task_step(s) for s in range(9)] == [0, 1, 2, 0, 1, 2, 3, 4, 5]


def test_phases_max_steps_forces_the_switch_and_history_restarts():
  sched = Schedule(_phases_cfg())
  used = _feed_phases(sched, 0, [0.0] * 9 + [0.95] + [0.95])
  # copy never reaches 0.9 on average: max_steps ends it after 10 steps; the lookup phase's
  # moving average starts afresh (the 0.95 of step 9 belongs to copy's window).
  assert used[:10] == [("copy", 1)] * 10 and used[10] == ("dictionary", 1)
  assert sched.starts == [0, 10]
  sched.observe(11, {"accuracy": 0.95})
  assert sched.starts == [0, 10, 12]


def test_phases_state_round_trip_resumes_mid_phase():
  values = [0.1, 0.95, 0.95, 0.5, 0.92, 0.93, 0.0, 0.0, 0.0]
  full = Schedule(_phases_cfg())
  used_full = _feed_phases(full, 0, values)
  first = Schedule(_phases_cfg())
  used_first = _feed_phases(first, 0, values[:4])
  resumed = Schedule(_phases_cfg())
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  assert used_first + _feed_phases(resumed, 4, values[4:]) == used_full
  assert resumed.state_dict() == full.state_dict()


def test_fixed_length_phases_match_stages_without_observing():
  sched = Schedule({"kind": "phases", "phases": [{"spec": D1, "steps": 5}, {"spec": D2, "steps": 5},
                                                 {"spec": D64}]})
  assert [sched.spec(s)["d"] for s in (0, 4, 5, 9, 10, 10 ** 6)] == [1, 1, 2, 2, 64, 64]
  assert sched.task_step(12) == 12  # one (unnamed) task: its stream is the steps themselves
  assert not sched.finished(10 ** 6)


@pytest.mark.parametrize("phases,message", [
    ([], "at least one phase"),
    ([{"spec": D1, "steps": 3, "threshold": 0.5}], "either 'steps'"),
    ([{"spec": D1, "step": 3}], "unknown field"),
    ([{"spec": D1, "steps": 0}], "steps"),
])
def test_phases_validation_names_the_field(phases, message):
  with pytest.raises(ValueError, match=message):
    Schedule({"kind": "phases", "phases": phases})
