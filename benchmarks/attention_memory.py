"""Per-device memory of the compiled training step, dense vs blockwise attention, by window.

fot_jax.plan.plan (what `--mode=plan` reports) compiles one training step against
abstract shapes, here on the one CPU device, for a proxy of LongLLaMA-3B's
training (its segments plan [(0,0),(1,1),(2,1),(3,0)], remat, bf16, 3 memory
layers; a smaller model and vocabulary so that 4 windows x 2 implementations compile
in minutes and the logits do not dwarf the attention)
at windows of --windows tokens with the same tokens per step (rows = tokens /
window). Dense attention keeps [T, T] (and [T, N*T]) float32 scores, so its
temporaries grow with the window at fixed tokens; blockwise keeps [T, block].

  python -m benchmarks.attention_memory                # ~5 minutes on 2 CPU cores
  python -m benchmarks.attention_memory --windows 2048 --hidden 3200 --layers 26 --heads 32

With --experiment, the experiment's own step on --devices fake CPU devices instead
(what `--mode=plan` prints), e.g. LongLLaMA-3B with blockwise attention:

  python -m benchmarks.attention_memory --experiment experiments/longllama_3b.py \
      --devices 256 --impls blockwise
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

from experiments.base_lm import base_config, segments_spec
from fot_jax import configs, plan

LONGLLAMA_3B_SEGMENTS = [(0, 0), (1, 1), (2, 1), (3, 0)]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--windows", default="1024,2048,4096,8192")
  p.add_argument("--tokens", type=int, default=65536, help="tokens per step (rows x window)")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--vocab", type=int, default=8192, help="small, so the logits do not hide the attention")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--block", type=int, default=512, help="blockwise key block")
  p.add_argument("--impls", default="dense,blockwise")
  p.add_argument("--json", default=None)
  p.add_argument("--experiment", default=None, help="an experiment file: plan its own step instead")
  p.add_argument("--devices", type=int, default=1, help="fake CPU devices for --experiment")
  return p.parse_args(argv)


def config_for(a, window, impl):
  c = base_config()
  c.model.size = "openllama_3b"
  c.model.overrides = {"vocab_size": a.vocab, "hidden_size": a.hidden, "intermediate_size": int(a.hidden * 2.7),
                       "num_layers": a.layers, "num_heads": a.heads,
                       "mem_layers": [a.layers // 4, a.layers // 2, 3 * a.layers // 4],
                       "attention_impl": impl, "attention_block": a.block}
  c.data.windows_per_slot = len(LONGLLAMA_3B_SEGMENTS)
  c.data.slots = a.tokens // window // c.data.windows_per_slot
  c.data.window = window
  c.train.curriculum = {"kind": "constant", "spec": segments_spec(LONGLLAMA_3B_SEGMENTS)}
  c.mesh.data = 1
  return c


def plan_experiment(a):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}")  # before jax starts
  spec = importlib.util.spec_from_file_location("experiment", a.experiment)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for impl in a.impls.split(","):
    config = module.get_config()
    config.model.overrides.attention_impl = impl
    config.model.overrides.attention_block = a.block
    print(f"attention_impl={impl} (block {a.block})\n{plan.format_plan(plan.plan(configs.resolve(config, check_data=False)))}\n", flush=True)


def main(argv=None):
  a = parse_args(argv)
  if a.experiment:
    return plan_experiment(a)
  gib = 1 << 30
  rows = []
  print("| window | rows | impl | temporaries GiB | total GiB | compile s |\n|---|---|---|---|---|---|")
  for window in [int(w) for w in a.windows.split(",")]:
    for impl in a.impls.split(","):
      t0 = time.time()
      p = plan.plan(configs.resolve(config_for(a, window, impl), check_data=False))
      m = p["memory_per_device"]
      rows.append({"window": window, "impl": impl, "rows": p["rows"], **m})
      print(f"| {window} | {p['rows']} | {impl} | {m['temporaries'] / gib:.3f} | {m['total'] / gib:.3f} | "
            f"{time.time() - t0:.0f} |", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
