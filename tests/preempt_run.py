"""A tiny FoT training run for tests/test_preemption.py and tests/kill_resume.py:
python tests/preempt_run.py WORKDIR [--steps N] [--checkpoint_every K] [--sleep S].

Each step's batch takes a little wall time (--sleep seconds, default FOT_STEP_SLEEP or 0) so
a signal can land mid-run; --checkpoint_every saves often (kill_resume kills inside those
writes). Writes WORKDIR/final_params.npz (atomically: a kill while writing it leaves no file
that looks final) when training reaches its last step."""
import argparse
import os
import sys
import time

import numpy as np

STEPS = 10


def setup(steps: int = STEPS, checkpoint_every: int = 0):
  from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
  from fot_jax.curriculum import Schedule
  from fot_jax.model.config import get_size
  task = DictionaryTask(num_symbols=32, num_value_symbols=16, key_len=1, value_len=1, n_defs=8, n_queries=8)
  cfg = get_size("tiny", vocab_size=task.vocab_size, mem_layers=(1,))
  batches = DictionaryBatches(task, slots=4, window=task.doc_len // 2, seed=0)
  schedule = Schedule({"kind": "constant", "spec": {"d": 4, "w": 1}})  # one plan shape: one compile
  train_cfg = {"steps": steps, "seed": 0, "loss_on": "last", "log_every": 1, "checkpoint_every": checkpoint_every,
               "optim": {"lr": 1e-2, "warmup_steps": 2}, "tensorboard": False}
  return cfg, batches, schedule, train_cfg


def run(workdir: str, sleep: float = 0.0, steps: int = STEPS, checkpoint_every: int = 0):
  import jax
  from fot_jax.train import train
  cfg, batches, schedule, train_cfg = setup(steps, checkpoint_every)

  def slow_batches(step):
    time.sleep(sleep)
    return batches(step)

  out = train(cfg, train_cfg, schedule, slow_batches, workdir)
  flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(out["params"])[0]}
  final = os.path.join(workdir, "final_params.npz")
  with open(final + ".tmp", "wb") as f:
    np.savez(f, **flat)
  os.replace(final + ".tmp", final)
  return out


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("workdir")
  p.add_argument("--steps", type=int, default=STEPS)
  p.add_argument("--checkpoint_every", type=int, default=0)
  p.add_argument("--sleep", type=float, default=float(os.environ.get("FOT_STEP_SLEEP", "0")))
  a = p.parse_args(sys.argv[1:])
  run(a.workdir, a.sleep, a.steps, a.checkpoint_every)
