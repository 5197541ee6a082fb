"""Wall time of a FoT training step with crossbatch vs the plain step.

In one process, on one model and one random token batch, this times the full
jitted training step of fot_jax.train.make_train_step (forward + backward +
AdamW update) for:

  plain   the empty plan: sources of shape [accum, B/accum, 0], no crossbatch;
  d=...   analysis plans (d, w) for each d in --ds: pack k = w + 1 windows per
          slot, the last window of each slot sees N = d * w extra windows
          (w of its own slot, (d - 1) * w of other slots), i.e. N * T extra
          keys per query in every memory layer.

The batch has B = slots * (w + 1) rows of --window tokens (inputs/targets random
int32 in [0, vocab), loss_mask all True, loss on all rows). Each variant is
traced, lowered and compiled first (compile time is reported), then warmed up
(--warmup calls); then --repeats rounds run every variant once each,
round-robin (in a seeded random order per round, so no variant always follows
the same one), so background load hits all variants alike. Each call is timed
with jax.block_until_ready on its outputs; the table reports the median.
One train state is threaded through all calls (the step donates it), so extra
variants cost no extra parameter/optimizer memory. The batch and plans are put
on the device once, so the timings exclude host-to-device copies.

With --memory_tokens M, each d also runs as "d=D+mem": the same step with train.memory's read
(every row's memory layers score M memory keys, shared by all rows, and read their top
--memory_topk beside the window and the crossbatch contexts; fot_jax/train/far_memory.py), the
memory random keys put on the device once (writing it is a forward pass, timed by the training
log's "memory ... written in" lines, not here).

The step gets the plan's static widths (crossbatch.pack_widths), so only the
last window of each slot attends to its N * T extra keys; with --padded every
row attends to all N plan columns (masked), as before rows paid only for their
own extra contexts, so the cost of a plan scaled with N for all B rows.

Defaults (finish in about 2.5 minutes on 2 CPU cores): --size dict_cpu (the demo
model: 2 layers of 64, one memory layer), --slots 64, --window 64, --w 1 (B = 128 rows of 64
tokens = 8192 tokens per step), --ds 1,8,64, --repeats 5, --warmup 1,
--accum 1. Real sizes go through the flags, e.g.

  python -m benchmarks.crossbatch_overhead --size analysis_184m --slots 128 \\
      --window 512 --ds 1,8,64,128 --repeats 10 --json out.json
  python -m benchmarks.crossbatch_overhead --size dict_cpu \\
      --overrides '{"num_layers": 2, "dtype": "bfloat16"}'

Columns: variant; extra keys per query: N*T extra-context keys (for the last
window of each slot), plus M memory keys (every row) for +mem; median step seconds; ratio to the plain step; the ratio the FLOP
count predicts: XLA's count of each compiled step over the plain one's (what
the program computes: extra keys for every row), and the ideal (the plain
count plus q.k and p.v FLOPs of only the live extra contexts, x3 for the
backward pass; XLA counts a loop body once, so for blockwise its count stays
low), so the gap between measured and ideal shows; tokens/s
(B * T / median); compile seconds (trace + lower + XLA compile); the compiled
step's temporaries (XLA memory_analysis).
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
import numpy as np

from fot_jax import crossbatch
from fot_jax.model.config import get_size
from fot_jax.model.init import init_params
from fot_jax.model.memory import MemoryBlock
from fot_jax.train import TrainState, make_optimizer, make_train_step, stacked_plan


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="dict_cpu", help="named model size (fot_jax.model.config.SIZES)")
  p.add_argument("--overrides", default="{}",
                 help='JSON dict of ModelConfig overrides, e.g. \'{"num_layers": 2}\'')
  p.add_argument("--slots", type=int, default=64, help="batch slots S (must be >= max d)")
  p.add_argument("--window", type=int, default=64, help="tokens per window (row length T)")
  p.add_argument("--w", type=int, default=1, help="analysis w: earlier windows per slot (pack k = w + 1)")
  p.add_argument("--ds", default="1,8,64", help="comma-separated analysis d values")
  p.add_argument("--repeats", type=int, default=5, help="timed round-robin rounds (median reported)")
  p.add_argument("--warmup", type=int, default=1, help="untimed calls per variant after compiling")
  p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--padded", action="store_true",
                 help="no static widths: every row attends to all N plan columns (masked)")
  p.add_argument("--compile_only", action="store_true",
                 help="compile and report the FLOP ratios and compiled memory, run nothing")
  p.add_argument("--memory_tokens", type=int, default=0,
                 help="also time each d with a train.memory read of this many memory tokens (0: not)")
  p.add_argument("--memory_topk", type=int, default=32, help="entries each query reads from that memory")
  p.add_argument("--json", default=None, help="write the results to this JSON file")
  return p.parse_args(argv)


def log(msg):
  print(f"[crossbatch_overhead {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None):
  args = parse_args(argv)
  t_start = time.time()
  overrides = json.loads(args.overrides)
  if not isinstance(overrides, dict):
    sys.exit(f"--overrides: must be a JSON object, got {args.overrides!r}")
  if "mem_layers" in overrides:
    overrides["mem_layers"] = tuple(overrides["mem_layers"])
  cfg = get_size(args.size, **overrides)
  ds = [int(x) for x in args.ds.split(",") if x.strip()]
  k = args.w + 1
  rows = args.slots * k
  if args.w < 1:
    sys.exit(f"--w: must be >= 1 for an analysis plan with extra contexts, got {args.w}")
  if args.slots % args.accum:
    sys.exit(f"--accum: {args.slots} slots do not split into {args.accum} groups of whole packs")
  micro_slots = args.slots // args.accum
  bad = [d for d in ds if not 1 <= d <= micro_slots]
  if bad:
    sys.exit(f"--ds: every d must be in 1..{micro_slots} (slots per accumulation group = "
             f"--slots {args.slots} / --accum {args.accum}); got {bad}")
  if args.memory_tokens < 0 or args.memory_topk < 1:
    sys.exit(f"--memory_tokens must be >= 0 and --memory_topk >= 1, got {args.memory_tokens} / {args.memory_topk}")
  if not cfg.mem_layers:
    log("WARNING: the model has no memory layers; every plan costs the same as the plain step")
  tokens = rows * args.window

  dev = jax.devices()[0]
  log(f"jax {jax.__version__} on {jax.default_backend()} ({dev.device_kind}, {jax.device_count()} device(s))")
  log(f"model {args.size} {overrides or ''}: {cfg.num_layers} layers x {cfg.hidden_size}, "
      f"{cfg.num_heads} heads, memory layers {cfg.mem_layers}, dtype {cfg.dtype}, remat {cfg.remat}")
  log(f"batch: {args.slots} slots x k={k} windows = {rows} rows x {args.window} tokens = {tokens} tokens; "
      f"accum {args.accum}; d in {ds}, w={args.w}")

  rng = np.random.default_rng(args.seed)
  batch = {"inputs": rng.integers(0, cfg.vocab_size, (rows, args.window), dtype=np.int32),
           "targets": rng.integers(0, cfg.vocab_size, (rows, args.window), dtype=np.int32),
           "loss_mask": np.ones((rows, args.window), bool)}
  batch = jax.device_put(batch)

  variants = [("plain", {}, 0)]
  for d in ds:
    variants.append((f"d={d}", {"d": d, "w": args.w}, d * args.w))
  read_memory = {name + "+mem" for name, _, _ in variants[1:]} if args.memory_tokens else set()
  variants += [(name + "+mem", spec, n) for name, spec, n in variants[1:] if name + "+mem" in read_memory]
  memories = None
  if read_memory:  # random keys/values, one block shared by every row (as train.memory's)
    m, kv, dh = args.memory_tokens, cfg.kv_heads, cfg.dim_per_head
    memories = jax.device_put({layer: [MemoryBlock(rng.standard_normal((1, m, kv, dh)).astype(np.float32),
                                                   rng.standard_normal((1, m, kv, dh)).astype(np.float32),
                                                   np.ones((1, m), bool))] for layer in cfg.mem_layers})
  plans, widths = {}, {}
  for name, spec, n in variants:
    sources, positive = stacked_plan(spec, rows, args.accum)
    assert sources.shape == (args.accum, rows // args.accum, n), (name, sources.shape)
    plans[name] = jax.device_put((sources, positive))
    widths[name] = None if args.padded else crossbatch.pack_widths(sources, k)

  optimizer = make_optimizer({"lr": 1e-4, "weight_decay": 0.1, "clip_norm": 1.0})
  t0 = time.time()
  params = init_params(cfg, args.seed)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
  state = jax.block_until_ready(state)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
  log(f"initialised {n_params:,} parameters in {time.time() - t0:.1f}s")

  step_fn = make_train_step(cfg, optimizer, args.accum)
  step_mem = make_train_step(cfg, optimizer, args.accum, memory_topk=args.memory_topk) if read_memory else None
  reads = lambda name: (memories,) if name in read_memory else ()  # the memory argument of a +mem step
  compiled, compile_s = {}, {}
  for name, spec, n in variants:
    log(f"compiling {name} (N={n}, plan {tuple(plans[name][0].shape)}, widths {widths[name]}) ...")
    t0 = time.time()
    fn = step_mem if name in read_memory else step_fn
    lowered = fn.lower(state, batch, *plans[name], *reads(name), widths[name])
    t1 = time.time()
    compiled[name] = lowered.compile()
    t2 = time.time()
    compile_s[name] = t2 - t0
    log(f"  {name}: trace+lower {t1 - t0:.1f}s, compile {t2 - t1:.1f}s")

  # What the FLOP count predicts. XLA: the compiled program's own count (extra keys computed
  # for every row, as the attention does). Ideal: the plain step's count plus the attention
  # FLOPs of only the live extra contexts (q.k and p.v, 2 x 2 x T x N_live*T x H x D per row
  # and memory layer; x3 for forward + backward).
  def xla_flops(c):
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", float("nan")))

  flops = {name: xla_flops(compiled[name]) for name, _, _ in variants}
  temp = {name: float(compiled[name].memory_analysis().temp_size_in_bytes) for name, _, _ in variants}
  if args.compile_only:
    args.warmup = args.repeats = 0
  hd = cfg.num_heads * cfg.dim_per_head
  ideal = {name: flops["plain"] + 3 * 4 * len(cfg.mem_layers) * hd * args.window ** 2
           * float((np.asarray(plans[name][0]) >= 0).sum())
           # memory: q.k over all M keys, forward only (the backward pass and p.v reach only the top-k;
           # fot_jax.plan.model_flops counts it alike)
           + (2 * len(cfg.mem_layers) * hd * rows * args.window * args.memory_tokens if name in read_memory else 0)
           for name, _, _ in variants}

  def call(name, state):
    t0 = time.perf_counter()
    state, metrics = compiled[name](state, batch, *plans[name], *reads(name))
    jax.block_until_ready((state, metrics))
    return state, metrics, time.perf_counter() - t0

  warm_s = {}
  for name, _, _ in variants:
    for _ in range(args.warmup):
      state, metrics, dt = call(name, state)
    warm_s[name] = dt if args.warmup else float("nan")
    if args.warmup:
      log(f"warm-up {name}: {dt:.3f}s, loss {float(metrics['loss']):.3f}")

  times = {name: [] for name, _, _ in variants}
  order_rng = np.random.default_rng(args.seed + 1)
  for r in range(args.repeats):
    line = []
    # A fresh order each round: no variant always runs right after the same one
    # (e.g. plain after the largest plan, whose freed buffers slow the next call).
    for i in order_rng.permutation(len(variants)):
      name = variants[i][0]
      state, metrics, dt = call(name, state)
      times[name].append(dt)
      line.append(f"{name} {dt:.3f}s")
    log(f"round {r + 1}/{args.repeats}: " + ", ".join(line))

  plain_med = statistics.median(times["plain"]) if times["plain"] else float("nan")
  results = []
  for name, spec, n in variants:
    ts = times[name]
    med = statistics.median(ts) if ts else float("nan")
    keys = n * args.window + (args.memory_tokens if name in read_memory else 0)
    results.append({"variant": name, "spec": spec, "num_sources": n, "extra_keys_per_query": keys,
                    "median_s": med, "min_s": min(ts) if ts else float("nan"),
                    "max_s": max(ts) if ts else float("nan"), "ratio_to_plain": med / plain_med,
                    "tokens_per_s": tokens / med, "compile_s": compile_s[name],
                    "xla_flops": flops[name], "xla_flop_ratio": flops[name] / flops["plain"],
                    "ideal_flop_ratio": ideal[name] / flops["plain"], "temp_bytes": temp[name],
                    "warmup_last_s": warm_s[name], "times_s": ts})

  header = f"{'variant':<12} {'extra keys':>10} {'median s':>9} {'min s':>8} {'max s':>8} {'ratio':>7} " \
           f"{'XLA FLOPs':>9} {'ideal':>7} {'tokens/s':>11} {'compile s':>10} {'temp GiB':>9}"
  print()
  print(f"{args.size} {overrides or ''} | B={rows} rows x T={args.window} ({tokens} tokens), w={args.w}, "
        f"accum={args.accum}, {args.repeats} repeats, {jax.default_backend()}"
        f"{', padded' if args.padded else ''}")
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['variant']:<12} {r['extra_keys_per_query']:>10} {r['median_s']:>9.3f} {r['min_s']:>8.3f} "
          f"{r['max_s']:>8.3f} {r['ratio_to_plain']:>6.2f}x {r['xla_flop_ratio']:>8.2f}x "
          f"{r['ideal_flop_ratio']:>6.2f}x {r['tokens_per_s']:>11,.0f} {r['compile_s']:>10.1f} "
          f"{r['temp_bytes'] / 2 ** 30:>9.2f}")
  total = time.time() - t_start
  print(f"\ntotal wall time {total:.1f}s", flush=True)

  if args.json:
    out = {"args": vars(args), "model": dataclasses.asdict(cfg),
           "num_params": n_params, "rows": rows, "window": args.window, "tokens_per_step": tokens,
           "backend": jax.default_backend(), "device_kind": dev.device_kind, "jax_version": jax.__version__,
           "host": platform.node(), "total_wall_s": total, "results": results}
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
    log(f"wrote {args.json}")
  return results


if __name__ == "__main__":
  main()
