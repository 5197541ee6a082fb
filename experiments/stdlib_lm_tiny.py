"""A tiny FoT language model on the Python standard library's sources, on CPU.

Byte vocabulary, a 3-layer model (hidden 64) with one memory layer, 128-token windows,
8 slots x 2 windows (2K tokens a step), 300 steps per model. FoT trains with crossbatch under a d curriculum (d=2, then d=8: the last
window of each slot sees its own previous window and those of d-1 other slots); the
baseline is the same model trained without crossbatch. Both are evaluated on held-out
stdlib files (single-document mode): perplexity of each file's last 512 bytes with
0, 2K, 8K and 32K earlier bytes in memory.
"""
import ml_collections

from experiments.base_lm import base_config

STEPS = 300


def get_config():
  c = base_config()
  c.model.size = "tiny"
  c.model.overrides = ml_collections.ConfigDict({
      "vocab_size": 260, "hidden_size": 64, "intermediate_size": 192, "num_layers": 3, "num_heads": 4,
      "num_kv_heads": 4, "mem_layers": (1,), "mem_positions": "first"})
  c.data.task, c.data.vocab, c.data.eval_task = "stdlib", "byte", "stdlib"
  c.data.slots, c.data.windows_per_slot, c.data.window = 8, 2, 128
  c.data.min_doc_len = 64
  c.optim.lr, c.optim.warmup_steps, c.optim.total_steps = 3e-3, 20, STEPS
  c.train.steps, c.train.checkpoint_every, c.train.log_every = STEPS, 100, 10
  c.train.curriculum = ml_collections.ConfigDict({
      "kind": "stages", "stages": [(0, {"d": 2, "w": 1}), (STEPS // 2, {"d": 8, "w": 1})]})
  c.eval.memory_tokens = [0, 2048, 8192, 32768]
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 512, 16, 8
  return c


def get_test_config():
  """A few-second variant for tests: 2-layer model, 3 steps, small memories."""
  c = get_config()
  c.model.overrides.update({"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "mem_layers": (1,)})
  c.data.slots, c.data.window = 4, 32
  c.train.steps, c.train.checkpoint_every, c.train.log_every = 3, 0, 1
  c.optim.total_steps = 3
  c.train.curriculum.stages = [(0, {"d": 2, "w": 1}), (2, {"d": 4, "w": 1})]
  c.eval.memory_tokens = [0, 64, 128]
  c.eval.score_tokens, c.eval.n_docs, c.eval.batch = 32, 2, 2
  return c
