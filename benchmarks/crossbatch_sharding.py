"""Memory and step time of crossbatch across devices vs negatives from the same device.

With the batch split over the `data`/`fsdp` mesh axes, a row's crossbatch contexts
may live on another device. Variants, all on one mesh, one model, one batch:

  plain     no crossbatch (the empty plan)
  batch     crossbatch_scope='batch': negatives from any slot of the global batch
            (the memory layers' keys/values of other devices are gathered)
  device    crossbatch_scope='device': one plan per batch shard, so the gather
            stays on the device (a slot's negatives are the other slots of its device)

Both crossbatch variants use the same analysis plan (d, w), so each row sees the same
number of extra contexts. Reported per variant: per-device memory of the compiled
step (temporaries, from XLA's memory analysis), median step seconds, ratio to plain.
Each variant is compiled, warmed up once, then --repeats rounds run every variant
once each, round-robin, timed with block_until_ready.

Runs on 8 fake CPU devices by default (sets XLA_FLAGS before jax starts), mesh
data=2 x fsdp=2 x tensor=2. On CPU, 'devices' share the same cores and memory, so the
times measure the extra work (gather, all-gather collectives), not interconnect cost.

  python -m benchmarks.crossbatch_sharding [--devices 8] [--mesh 2,2,2] [--d 8] [--slots 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--mesh", default="2,2,2", help="data,fsdp,tensor")
  p.add_argument("--size", default="dict_cpu")
  p.add_argument("--slots", type=int, default=32)
  p.add_argument("--window", type=int, default=64)
  p.add_argument("--d", type=int, default=8)
  p.add_argument("--w", type=int, default=1)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args(argv)
  if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import numpy as np
  import optax
  from fot_jax import crossbatch, parallel
  from fot_jax.model.config import get_size
  from fot_jax.train import init_state, make_train_step, stacked_plan

  data, fsdp, tensor = (int(x) for x in a.mesh.split(","))
  mesh = parallel.make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor})
  rules = parallel.DEFAULT_RULES
  shards = parallel.batch_shards(mesh, rules)
  cfg = get_size(a.size)
  rows = a.slots * (a.w + 1)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (rows, a.window + 1)).astype(np.int32)
  batch = parallel.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                 "loss_mask": np.ones((rows, a.window), bool)}, parallel.batch_sharding(mesh, rules))
  spec = {"d": a.d, "w": a.w}
  variants = {"plain": stacked_plan({}, rows, 1), "batch": stacked_plan(spec, rows, 1),
              "device": stacked_plan(spec, rows, 1, groups=shards)}
  opt = optax.adamw(1e-3)
  step = make_train_step(cfg, opt, 1, mesh, rules)
  state = init_state(cfg, opt, 0, mesh, rules)
  print(f"mesh {parallel.describe(mesh)}; {a.size}, {rows} rows x {a.window} tokens "
        f"({rows // shards} rows per batch shard), crossbatch d={a.d} w={a.w}", flush=True)
  compiled, args = {}, {}
  for name, (src, pos) in variants.items():
    args[name] = (parallel.global_replicated(src, mesh), parallel.global_replicated(pos, mesh))
    compiled[name] = step.lower(state, batch, *args[name], crossbatch.pack_widths(src, a.w + 1)).compile()
    state, m = compiled[name](state, batch, *args[name])  # warm-up
    jax.block_until_ready(m)
  times = {n: [] for n in variants}
  order = list(variants)
  for r in range(a.repeats):
    rng.shuffle(order)
    for name in order:
      t0 = time.perf_counter()
      state, m = compiled[name](state, batch, *args[name])
      jax.block_until_ready(m)
      times[name].append(time.perf_counter() - t0)
  base_t = statistics.median(times["plain"])
  base_m = compiled["plain"].memory_analysis().temp_size_in_bytes
  print(f"{'variant':>8} | {'temp MiB/device':>15} | {'x plain':>7} | {'median s':>8} | {'x plain':>7}")
  for name in variants:
    mem = compiled[name].memory_analysis().temp_size_in_bytes
    t = statistics.median(times[name])
    print(f"{name:>8} | {mem / 2**20:>15.1f} | {mem / base_m:>7.2f} | {t:>8.4f} | {t / base_t:>7.2f}", flush=True)


if __name__ == "__main__":
  main()
