"""Compile time of the training gradient with scanned layers vs unrolled layers.

In one process this traces, lowers and compiles (jax.jit(...).lower(...).compile(), wall
seconds) the gradient of the training loss (jax.value_and_grad of the summed token
cross-entropy, fot_jax.train.lm_loss_sums, plus the model's r_d sum) over LlamaModel for:

  unrolled  model.scan_layers=False: every layer is its own copy in the program;
  scanned   model.scan_layers=True: each run of consecutive non-memory layers is one
            lax.scan over their stacked weights (docs/scan_and_remat.md); memory layers
            stay unrolled.

The batch has --rows rows of --window tokens with the analysis crossbatch plan (--d, --w), so
the memory layers attend to extra contexts as in training. Parameters and the batch are
abstract (jax.ShapeDtypeStruct): nothing is allocated or run. Each round compiles every
variant once, alternating which goes first, so background load hits both alike; every
compile builds a fresh function (no trace cache) and the persistent compilation cache is off.
The table reports medians over --repeats rounds.

Defaults: SmolLM2-135M's shape (--size smollm2_135m: 30 layers, memory layers 8/16/24), 2 rows
of 256 tokens, d=1 w=1 (the second row sees the first), 3 rounds. Other settings go through the
flags, e.g.

  python -m benchmarks.compile_time --overrides '{"remat": true, "dtype": "bfloat16"}' \\
      --repeats 2 --json out.json

Columns: variant; median trace+lower seconds; median XLA compile seconds; median total; the
compiled program's temporaries (XLA memory_analysis); the optimised HLO's text size.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from fot_jax import crossbatch
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.llama import LlamaModel
from fot_jax.train import lm_loss_sums

VARIANTS = (("unrolled", False), ("scanned", True))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="smollm2_135m", help="named model size (fot_jax.model.config.SIZES)")
  p.add_argument("--overrides", default="{}",
                 help='JSON dict of ModelConfig overrides, e.g. \'{"remat": true}\'')
  p.add_argument("--rows", type=int, default=2, help="batch rows B")
  p.add_argument("--window", type=int, default=256, help="tokens per row T")
  p.add_argument("--d", type=int, default=1, help="analysis plan d (slots seen, own included)")
  p.add_argument("--w", type=int, default=1, help="analysis plan w (earlier windows per slot)")
  p.add_argument("--repeats", type=int, default=3, help="rounds, each compiling every variant once")
  p.add_argument("--json", "--out", dest="json", default=None, help="write the results to this JSON file")
  return p.parse_args(argv)


def log(msg):
  print(f"[compile_time {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def grad_fn(cfg, plan):
  """A fresh function each call, so every lowering traces anew."""
  model = LlamaModel(cfg)

  def loss(params, inputs, targets):
    logits, aux = model.apply({"params": params}, inputs, plan=plan)
    loss_sum, _, count = lm_loss_sums(logits, targets, jnp.ones(targets.shape, bool))
    return loss_sum / count + aux["rd_num"]

  return jax.jit(jax.value_and_grad(loss))


def main(argv=None):
  args = parse_args(argv)
  t_start = time.time()
  overrides = json.loads(args.overrides)
  if not isinstance(overrides, dict):
    sys.exit(f"--overrides: must be a JSON object, got {args.overrides!r}")
  if "mem_layers" in overrides:
    overrides["mem_layers"] = tuple(overrides["mem_layers"])
  if args.repeats < 1:
    sys.exit(f"--repeats: must be >= 1, got {args.repeats}")
  base = get_size(args.size, **overrides)
  try:
    plan = crossbatch.analysis_plan(args.rows, args.d, args.w).as_tuple()
  except ValueError as e:
    sys.exit(f"--rows/--d/--w: {e}")
  log(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
  log(f"model {args.size} {overrides or ''}: {base.num_layers} layers x {base.hidden_size}, memory layers "
      f"{base.mem_layers}, dtype {base.dtype}, remat {base.remat} ({base.remat_policy}); batch {args.rows} x "
      f"{args.window}, plan d={args.d} w={args.w} (widths {plan[2]})")
  params = jax.eval_shape(lambda: init_params(base, 0))
  tokens = jax.ShapeDtypeStruct((args.rows, args.window), jnp.int32)

  lower_s = {name: [] for name, _ in VARIANTS}
  compile_s = {name: [] for name, _ in VARIANTS}
  compiled = {}
  cache_was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # every compile is a real one
  try:
    for r in range(args.repeats):
      order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
      for name, scan in order:
        cfg = dataclasses.replace(base, scan_layers=scan)
        t0 = time.perf_counter()
        lowered = grad_fn(cfg, plan).lower(params, tokens, tokens)
        t1 = time.perf_counter()
        compiled[name] = lowered.compile()
        t2 = time.perf_counter()
        lower_s[name].append(t1 - t0)
        compile_s[name].append(t2 - t1)
        log(f"round {r + 1}/{args.repeats} {name}: trace+lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s")
  finally:  # a caller in the same process (the tests) keeps its cache
    jax.config.update("jax_enable_compilation_cache", cache_was)

  results = []
  for name, scan in VARIANTS:
    totals = [a + b for a, b in zip(lower_s[name], compile_s[name])]
    results.append({"variant": name, "scan_layers": scan, "lower_s": lower_s[name], "compile_s": compile_s[name],
                    "total_s": totals, "median_lower_s": statistics.median(lower_s[name]),
                    "median_compile_s": statistics.median(compile_s[name]),
                    "median_total_s": statistics.median(totals),
                    "temp_bytes": int(compiled[name].memory_analysis().temp_size_in_bytes),
                    "hlo_chars": len(compiled[name].as_text())})
  by = {r["variant"]: r for r in results}
  ratio = by["unrolled"]["median_total_s"] / by["scanned"]["median_total_s"]

  header = f"{'variant':<9} {'lower s':>8} {'compile s':>10} {'total s':>8} {'temp MiB':>9} {'HLO chars':>10}"
  print()
  print(f"{args.size} {overrides or ''} | value_and_grad, B={args.rows} x T={args.window}, plan d={args.d} "
        f"w={args.w}, median of {args.repeats}, {jax.default_backend()}")
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['variant']:<9} {r['median_lower_s']:>8.1f} {r['median_compile_s']:>10.1f} {r['median_total_s']:>8.1f} "
          f"{r['temp_bytes'] / 2 ** 20:>9.1f} {r['hlo_chars']:>10,}")
  print(f"unrolled / scanned total: {ratio:.2f}x")
  total = time.time() - t_start
  print(f"\ntotal wall time {total:.1f}s", flush=True)

  out = {"args": vars(args), "model": dataclasses.asdict(base), "backend": jax.default_backend(),
         "device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__, "host": platform.node(),
         "total_wall_s": total, "results": results, "unrolled_over_scanned": ratio}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
    log(f"wrote {args.json}")
  return out


if __name__ == "__main__":
  main()
