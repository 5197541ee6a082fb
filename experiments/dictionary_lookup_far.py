"""The demo's dictionary model trained for the far end (`make demo-16m`): experiments/dictionary_lookup.py
with a longer last phase (NEGATIVES steps with every other slot's definitions as negatives, instead
of 300), FoT only (the baseline is the demo's). The demo's 300-step phase left its model at
0.873 with 16M tokens in memory; this one answers 0.979 there (docs/evaluation.md, "Dictionary
lookup at 16M tokens"). Then `python -m fot_jax.eval.far_end --workdir=runs/demo_far`.
"""
from experiments import dictionary_lookup

NEGATIVES = 2000


def get_config():
  c = dictionary_lookup.get_config()
  phases = c.fot.curriculum.phases
  phases[2]["steps"] = NEGATIVES
  c.fot.curriculum.phases = phases
  c.fot.steps = 2500 + 1000 + NEGATIVES  # an upper bound: the curriculum ends the run
  c.baseline.enabled = False
  c.eval.memory_tokens = (32, 1024, 65536, 1048576)
  c.eval.rd_ds = (1, 16, 64)
  return c
