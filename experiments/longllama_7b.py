"""LongLLaMA-7B: FoT fine-tuning of OpenLLaMA-7B (FoT paper Section 4, App. A.2).

As LongLLaMA-3B (experiments/longllama_3b.py) with memory layers 8/16/24, segments
[(0,0),(1,2),(2,5),(3,4)] and 3B tokens.
"""
from experiments import longllama_3b
from experiments.base_lm import segments_spec

TOKENS = 3_000_000_000
SEGMENTS = [(0, 0), (1, 2), (2, 5), (3, 4)]


def get_config():
  c = longllama_3b.get_config()
  c.model.size = "openllama_7b"
  c.data.vocab = "checkpoints/open_llama_7b/tokenizer.model"
  steps = TOKENS // (c.data.slots * c.data.windows_per_slot * c.data.window)
  c.optim.total_steps = c.train.steps = steps
  c.train.curriculum = {"kind": "constant", "spec": segments_spec(SEGMENTS)}
  c.train.init_from = "checkpoints/open_llama_7b/fot"
  c.mesh.tensor = 4
  return c
