"""Data pipeline tokens/s next to the tokens/s the trainer consumes, for one experiment config.

In one process: (1) the doc-pinned slot pipeline of the config (its task, vocabulary,
slots x windows x window) produces --batches batches, timed after the first (which
opens the source); (2) the jitted FoT train step of the same model (its curriculum's
final, widest crossbatch spec) runs --steps steps on those batches, timed after
compilation. The ratio pipeline/trainer says how much headroom the input side has:
above 1 the pipeline is not the bottleneck.

  python -m benchmarks.data_throughput                         # experiments/stdlib_lm_tiny.py
  python -m benchmarks.data_throughput --config experiments/stdlib_lm_tiny.py --batches 200 --steps 20
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _load(path):
  spec = importlib.util.spec_from_file_location("experiment", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="experiments/stdlib_lm_tiny.py")
  p.add_argument("--batches", type=int, default=100)
  p.add_argument("--steps", type=int, default=10)
  a = p.parse_args()
  from fot_jax import configs, crossbatch
  from fot_jax.runners import lm_data
  from fot_jax.model.init import init_params
  from fot_jax.train import TrainState, make_optimizer, make_train_step, stacked_plan
  config = _load(a.config)
  exp = configs.resolve(config)
  batcher = lm_data.feed_batches(exp.lm.feeds[None], exp.lm.data, exp.train.seed)  # the LM task's own slots
  batches = [batcher(0)]
  t0 = time.perf_counter()
  for step in range(1, a.batches):
    batches.append(batcher(step))
  data_s = time.perf_counter() - t0
  rows, seq = batches[0]["inputs"].shape
  data_tps = (a.batches - 1) * rows * seq / data_s

  cfg = exp.model
  spec = exp.schedule().all_specs()[-1]
  optimizer = make_optimizer(exp.train.optim)
  params = init_params(cfg, 0)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  step_fn = make_train_step(cfg, optimizer, 1)
  sources, positive = stacked_plan(spec, rows, 1)
  widths = crossbatch.pack_widths(sources, crossbatch.pack_size(spec))
  keys = ("inputs", "targets", "loss_mask")
  state, m = step_fn(state, {k: batches[0][k] for k in keys}, sources, positive, widths)  # compile
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for i in range(a.steps):
    state, m = step_fn(state, {k: batches[(i + 1) % len(batches)][k] for k in keys}, sources, positive, widths)
  jax.block_until_ready(m)
  train_s = time.perf_counter() - t0
  train_tps = a.steps * rows * seq / train_s
  print(f"config {a.config}: batch [{rows}, {seq}] ({config.data.slots} slots x {config.data.windows_per_slot} "
        f"windows), task {config.data.task!r}, vocab {config.data.vocab!r}, crossbatch {spec}")
  print(f"pipeline  {data_tps:>12,.0f} tokens/s  ({a.batches - 1} batches in {data_s:.2f}s)")
  print(f"trainer   {train_tps:>12,.0f} tokens/s  ({a.steps} steps in {train_s:.2f}s, {jax.devices()[0].platform})")
  print(f"pipeline / trainer = {data_tps / train_tps:.1f}x")


if __name__ == "__main__":
  main()
