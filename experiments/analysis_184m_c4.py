"""The FoT paper's 184M analysis model on C4 (Sections 5.1-5.4, App. E.1), from scratch.

12 layers of 1024, memory layer 8 without positions, 512-token windows. Crossbatch
d=2 for 450K steps, then d=64 for the last 50K (the paper's 'd=2 -> 64'). Every step
scores 32K tokens (the paper's batch): 64 slots whose last window is scored, seeing the
w earlier windows of its own slot and of d-1 others. `get_sweep()` runs w=1 and w=2,
and the d=1 (no negatives) comparison of Fig. 6 for each.
"""
import ml_collections

from experiments.base_lm import base_config

STEPS, SWITCH = 500_000, 450_000


def get_config():
  c = base_config()
  c.model.size = "analysis_184m"
  c.data.corpus = "c4"
  # A 32K SentencePiece model: python -m data_pipelines.train_tokenizer --task=c4 --output=...
  c.data.vocab = "tokenizers/c4_32k.model"
  c.data.slots, c.data.windows_per_slot, c.data.window = 64, 2, 512
  c.optim.lr, c.optim.warmup_steps, c.optim.total_steps = 3e-4, 1000, STEPS
  c.train.steps, c.train.loss_on = STEPS, "last"
  c.train.checkpoint_every, c.train.log_every = 5000, 100
  c.train.curriculum = d_schedule(2, 64, w=1)
  c.mesh.data, c.mesh.fsdp = -1, 1  # 184M: plain data parallelism
  c.eval.memory_tokens = [0, 2048, 8192, 32768, 65536]
  return c


def d_schedule(first: int, then: int, w: int):
  stages = [(0, {"d": first, "w": w})]
  if then != first:
    stages.append((SWITCH, {"d": then, "w": w}))
  return ml_collections.ConfigDict({"kind": "stages", "stages": stages})


def get_sweep():
  """w in {1, 2} x {d=2 -> 64, d=1}: named runs of overrides (launch/sweep.py)."""
  runs = []
  for w in (1, 2):
    for name, (a, b) in (("d2to64", (2, 64)), ("d1", (1, 1))):
      runs.append({"name": f"{name}_w{w}", "data.windows_per_slot": w + 1,
                   "train.curriculum": d_schedule(a, b, w).to_dict()})
  return runs
