"""Dictionary lookup (FoT paper, App. F / Figure 10), sized for a 2-core CPU.

FoT: 256-token local window, documents of 512 tokens (a definition window, then
a query window), crossbatch with d=1 until the training accuracy reaches 98%,
then d = all 8 slots (the paper: d=1 -> 128, with a far larger batch). Baseline: the same model trained as
a standard transformer on whole 512-token documents, then given the same memory.
Both are evaluated with memory from 256 tokens up to 1M tokens (exact top-k).
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.experiment = "dictionary_lookup"
  c.seed = 0
  c.model = ml_collections.ConfigDict({
      "size": "dict_cpu",
      # Anything of fot_jax.model.config.ModelConfig, e.g. {"num_layers": 6}.
      "overrides": ml_collections.ConfigDict({}),
  })
  c.data = ml_collections.ConfigDict({  # data_pipelines.dictionary_lookup.DictionaryTask
      "num_symbols": 256, "num_value_symbols": 256, "key_len": 2, "value_len": 2,
      "n_defs": 64, "n_queries": 64, "layout": "kv",
  })
  c.optim = ml_collections.ConfigDict({
      "lr": 3e-3, "warmup_steps": 20, "schedule": "constant", "total_steps": 0,
      "weight_decay": 0.0, "clip_norm": 1.0, "b1": 0.9, "b2": 0.95,
  })
  c.fot = ml_collections.ConfigDict({
      "window": 256, "slots": 8, "steps": 400, "loss_on": "last", "accum_steps": 1,
      "log_every": 10, "checkpoint_every": 100,
      "curriculum": ml_collections.ConfigDict({
          "kind": "metric", "before": {"d": 1, "w": 1}, "after": {"d": 8, "w": 1},
          "metric": "accuracy", "threshold": 0.98, "window": 5, "max_step": None,
      }),
  })
  c.baseline = ml_collections.ConfigDict({
      "enabled": True, "window": 512, "slots": 8, "steps": 400, "log_every": 10,
      "checkpoint_every": 100,
  })
  # Device mesh (fot_jax.parallel): the 3M-parameter model is simply data parallel.
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.eval = ml_collections.ConfigDict({
      "memory_tokens": [256, 1024, 4096, 16384, 65536, 262144, 1048576],
      "n_docs": 8, "mode": "topk", "topk": 32, "batch": 8, "chunk": 8192, "seed": 1234,
  })
  return c


def get_test_config():
  """A few-second variant for tests: tiny model, short training, small memories."""
  c = get_config()
  c.model.overrides = ml_collections.ConfigDict({"num_layers": 2, "hidden_size": 32,
                                                 "intermediate_size": 64, "mem_layers": (1,)})
  c.fot.steps = c.baseline.steps = 4
  c.fot.slots = c.baseline.slots = 4
  c.fot.curriculum.after = {"d": 4, "w": 1}
  c.fot.curriculum.max_step = 2
  c.eval.memory_tokens = [256, 1024, 2048]
  c.eval.n_docs = 4
  return c
