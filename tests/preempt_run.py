"""A tiny FoT training run for tests/test_preemption.py: python tests/preempt_run.py WORKDIR.

Each step's batch takes a little wall time (FOT_STEP_SLEEP seconds) so a SIGTERM can
land mid-run. Writes WORKDIR/final_params.npz when training reaches its last step."""
import os
import sys
import time

import numpy as np

STEPS = 10


def setup():
  from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
  from fot_jax.curriculum import Schedule
  from fot_jax.model.config import get_size
  task = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
  cfg = get_size("tiny", vocab_size=task.vocab_size, mem_layers=(1,))
  batches = DictionaryBatches(task, slots=4, window=task.doc_len // 2, seed=0)
  schedule = Schedule({"kind": "constant", "spec": {"d": 4, "w": 1}})  # one plan shape: one compile
  train_cfg = {"steps": STEPS, "seed": 0, "loss_on": "last", "log_every": 1, "checkpoint_every": 0,
               "optim": {"lr": 1e-2, "warmup_steps": 2}, "tensorboard": False}
  return cfg, batches, schedule, train_cfg


def run(workdir: str, sleep: float = 0.0):
  import jax
  from fot_jax.train import train
  cfg, batches, schedule, train_cfg = setup()

  def slow_batches(step):
    time.sleep(sleep)
    return batches(step)

  out = train(cfg, train_cfg, schedule, slow_batches, workdir)
  flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(out["params"])[0]}
  np.savez(os.path.join(workdir, "final_params.npz"), **flat)
  return out


if __name__ == "__main__":
  run(sys.argv[1], float(os.environ.get("FOT_STEP_SLEEP", "0")))
