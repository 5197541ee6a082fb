"""Train-step tokens/s with the experiment's `train.trainable` subset next to all parameters.

For one LM experiment config: its model (random weights: speed does not depend on them, so no
checkpoint is needed), its batch shape (data.slots x windows_per_slot rows of data.window tokens,
random token ids) and its curriculum's last crossbatch spec; the jitted FoT train step with only the
`train.trainable` parameters differentiated and updated, then with all of them, each timed over
--steps steps after compilation (and a first run), in one process. Prints tokens/s of both, the
compiled step's memory (XLA's arguments + outputs + temporaries - donated) and the tokens/s ratio.

  nice -n 10 python -m benchmarks.trainable_speed --config experiments/smollm2_fot.py --steps 5
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def time_steps(cfg, optimizer, trainable, params, batch, spec, steps: int):
  """(seconds per step after compilation, compile seconds, last loss, XLA's bytes of the step)."""
  from fot_jax import crossbatch
  from fot_jax.train import TrainState, make_train_step, stacked_plan
  rows = batch["inputs"].shape[0]
  sources, positive = stacked_plan(spec, rows, 1)
  widths = crossbatch.pack_widths(sources, crossbatch.pack_size(spec))
  step_fn = make_train_step(cfg, optimizer, 1, trainable=trainable)
  p = jax.tree_util.tree_map(jnp.array, params)  # a copy: the step donates its state
  state = TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p if trainable is None else trainable.select(p)))
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, batch, sources, positive, widths).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  nbytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
  state, m = compiled(state, batch, sources, positive)  # the first run allocates
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = compiled(state, batch, sources, positive)
  jax.block_until_ready(m)
  return (time.perf_counter() - t0) / steps, compile_s, float(m["loss"]), nbytes


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="experiments/smollm2_fot.py")
  p.add_argument("--steps", type=int, default=5)
  a = p.parse_args()
  from fot_jax import configs
  from fot_jax.model.init import init_params
  from fot_jax.train import count_trainable, make_optimizer, resolve_trainable
  config = configs.load_module(a.config).get_config()
  exp = configs.resolve(config, check_data=False)
  cfg = exp.model
  rows, window, _ = exp.train_shape()
  spec = exp.schedule().all_specs()[-1]
  trainable = resolve_trainable(exp.train.trainable, cfg)
  if trainable is None:
    raise SystemExit(f"{a.config}: train.trainable selects every parameter; nothing to compare")
  optimizer = make_optimizer(exp.train.optim)
  params = jax.jit(lambda: init_params(cfg, 0))()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, window + 1)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((rows, window), bool)}
  n_train, n_total = count_trainable(cfg, trainable)
  print(f"config {a.config}: {rows} rows x {window} tokens, crossbatch {spec}, {jax.devices()[0].platform}")
  out = {}
  for name, t in (("trainable", trainable), ("all", None)):
    step_s, compile_s, loss, nbytes = time_steps(cfg, optimizer, t, params, batch, spec, a.steps)
    out[name] = rows * window / step_s
    n = n_train if t is not None else n_total
    print(f"{name:>9}: {n:>12,} parameters  {out[name]:>9,.0f} tokens/s  ({step_s:.2f} s/step over {a.steps} "
          f"steps; compile {compile_s:.0f} s; step memory {nbytes / 2**30:.2f} GiB; loss {loss:.3f})", flush=True)
  print(f"trainable ({', '.join(trainable.patterns)}) / all = {out['trainable'] / out['all']:.2f}x tokens/s")


if __name__ == "__main__":
  main()
