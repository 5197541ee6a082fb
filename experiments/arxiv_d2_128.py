"""The FoT paper's arXiv setting (Section 5.2, App. E.1): d drawn from {2, 128} every step.

The 184M model with 1K-token windows (w=1), 128 slots so that d=128 finds 127
negative slots; 128K scored tokens per step. The random draw is a hash of (seed, step),
so a resumed run draws the same d's.
"""
from experiments.base_lm import base_config


def get_config():
  c = base_config()
  c.model.size = "analysis_184m"
  c.data.corpus = "arxiv"  # register with data_pipelines.tasks (e.g. jsonl:)
  c.data.vocab = "tokenizers/arxiv_32k.model"
  c.data.slots, c.data.windows_per_slot, c.data.window = 128, 2, 1024
  c.optim.lr, c.optim.warmup_steps, c.optim.total_steps = 3e-4, 1000, 500_000
  c.train.steps, c.train.loss_on = 500_000, "last"
  c.train.checkpoint_every, c.train.log_every = 5000, 100
  c.train.curriculum = {"kind": "random", "seed": 0, "choices": [{"d": 2, "w": 1}, {"d": 128, "w": 1}]}
  c.mesh.data, c.mesh.fsdp = -1, 1
  c.eval.memory_tokens = [0, 8192, 32768, 131072]
  return c
