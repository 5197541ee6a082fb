"""Model FLOPs utilisation and peak memory of one FoT training step on this machine's first device.

benchmarks/accelerator_check.sh runs each configuration in its own process, so the device's
peak-memory counter belongs to that configuration alone:

  --size 184m   the paper's 184M analysis model (analysis_184m), bf16
  --size 1b     a 1B-class model: TinyLlama-1.1B's shape (22 layers of 2048, 32 heads, 4 kv
                heads, intermediate 5632) with LongLLaMA's memory layers 6, 12, 18, bf16, remat
  --size tiny   the unit-test model with 2 layers (bf16), for --reduced

The step is fot_jax.train.make_train_step (forward, backward, AdamW; float32 parameters and
optimizer state) on --slots x (w + 1) rows of --window random tokens with the analysis plan
(d, w=1): the last window of each slot attends to d extra windows in every memory layer (rows
grouped by width: the other rows attend to none). After --warmup calls, --repeats calls are
timed (jax.block_until_ready); the median is reported.

Model FLOPs per step (PaLM's convention: what the model needs, not what remat recomputes):
6 x matmul parameters (layers and the output projection, not the embedding lookup) x tokens,
plus attention 12 x T x keys x H x D per row and layer (q.k and p.v, forward and backward; the
causal window counted in full, T keys) and the same for the live extra keys of each memory
layer. MFU = model FLOPs / step time / the device's bf16 peak (table below, or --peak_tflops);
on CPU it is n/a. XLA's own FLOP count of the compiled step is reported beside it (it counts
a scan's body once, so blockwise attention is undercounted there).

Peak memory: the device's peak_bytes_in_use (GPU, TPU) where memory_stats has it, else the
compiled step's memory_analysis (arguments + outputs + temporaries - donated).

  python -m benchmarks.accelerator_check --size 184m --d 8 --out results/
  python -m benchmarks.accelerator_check --reduced --d 2 --out results/   # CPU, seconds
  python -m benchmarks.accelerator_check --summarize results/
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

# bf16 dense peak FLOP/s per device, matched against jax's device_kind (first match wins).
PEAK_BF16 = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
    ("A100", 312e12), ("L4", 121e12),
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12),
    ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
)

DEFAULTS = {  # size -> (slots, window, impl)
    "184m": (64, 512, "blockwise"),
    "1b": (64, 512, "blockwise"),
    "tiny": (2, 16, "blockwise"),
}


def peak_flops(device_kind: str):
  for key, peak in PEAK_BF16:
    if key.lower() in device_kind.lower():
      return peak
  return None


def model_config(size: str, impl: str):
  from fot_jax.model.config import get_size
  common = dict(dtype="bfloat16", attention_impl=impl)
  if size == "184m":
    return get_size("analysis_184m", **common)
  if size == "1b":
    return get_size("openllama_3b", hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                    num_kv_heads=4, mem_layers=(6, 12, 18), remat=True, **common)
  if size == "tiny":  # 2 layers: the memory layer and one plain layer
    return get_size("tiny", num_layers=2, **common)
  raise SystemExit(f"--size: one of {sorted(DEFAULTS)}, got {size!r}")


def run(args) -> dict:
  import jax
  import numpy as np
  from fot_jax import crossbatch
  from fot_jax.train import init_state, make_optimizer, make_train_step, stacked_plan
  from fot_jax import parallel
  from fot_jax.plan import model_flops

  slots, window, impl = DEFAULTS[args.size]
  slots, window, impl = args.slots or slots, args.window or window, args.impl or impl
  cfg = model_config(args.size, impl)
  dev = jax.devices()[0]
  spec = {"d": args.d, "w": 1}
  rows = 2 * slots
  out = {"size": args.size, "d": args.d, "w": 1, "slots": slots, "rows": rows, "window": window,
         "tokens_per_step": rows * window, "impl": impl, "dtype": cfg.dtype, "remat": cfg.remat,
         "backend": jax.default_backend(), "device_kind": dev.device_kind, "jax_version": jax.__version__}
  if args.d > slots:
    raise SystemExit(f"--d {args.d}: needs at least {args.d} slots, got --slots {slots}")
  mesh = parallel.make_mesh(None, devices=[dev])
  rules = parallel.DEFAULT_RULES
  optimizer = make_optimizer({"lr": 1e-4, "weight_decay": 0.1, "clip_norm": 1.0})
  t0 = time.time()
  state = init_state(cfg, optimizer, 0, mesh, rules)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
  rng = np.random.default_rng(0)
  batch = jax.device_put({"inputs": rng.integers(0, cfg.vocab_size, (rows, window), dtype=np.int32),
                          "targets": rng.integers(0, cfg.vocab_size, (rows, window), dtype=np.int32),
                          "loss_mask": np.ones((rows, window), bool)}, dev)
  sources, positive = stacked_plan(spec, rows, 1)
  widths = crossbatch.pack_widths(sources, 2)
  plan = jax.device_put((sources, positive), dev)
  step = make_train_step(cfg, optimizer, 1, mesh, rules)
  compiled = step.lower(state, batch, *plan, widths).compile()
  out["compile_s"] = time.time() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out["xla_flops"] = float((cost or {}).get("flops", float("nan")))
  mem = compiled.memory_analysis()
  out["compiled_bytes"] = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                              - mem.alias_size_in_bytes)
  out["params"] = n_params
  out["model_flops"] = model_flops(cfg, state.params, rows, window, int((sources >= 0).sum()))

  times = []
  for i in range(args.warmup + args.repeats):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch, *plan)
    jax.block_until_ready((state, metrics))
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
  out["loss"] = float(metrics["loss"])
  out["step_s"] = statistics.median(times)
  out["times_s"] = times
  out["tokens_per_s"] = out["tokens_per_step"] / out["step_s"]
  peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(dev.device_kind)
  on_cpu = jax.default_backend() == "cpu"
  out["peak_flops"] = None if on_cpu else peak
  out["mfu"] = None if on_cpu or not peak else out["model_flops"] / out["step_s"] / peak
  stats = None
  try:
    stats = dev.memory_stats()
  except Exception:  # some backends do not implement it
    pass
  if stats and "peak_bytes_in_use" in stats:
    out["peak_bytes"], out["peak_source"] = int(stats["peak_bytes_in_use"]), "memory_stats"
  else:
    out["peak_bytes"], out["peak_source"] = out["compiled_bytes"], "memory_analysis"
  return out


def fmt(r: dict) -> str:
  if "error" in r:
    return f"{r.get('size', '?'):>5} d={r.get('d', '?'):<4} FAILED: {r['error']}"
  mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
  return (f"{r['size']:>5} d={r['d']:<4} {r['impl']:>9} {r['rows']:>4}x{r['window']:<5} "
          f"{r['step_s']:>9.4f}s {r['tokens_per_s']:>12,.0f} tok/s  model {r['model_flops']:.3e} "
          f"XLA {r['xla_flops']:.3e}  MFU {mfu:>6}  peak {r['peak_bytes'] / 2 ** 30:7.2f} GiB "
          f"({r['peak_source']})  {r['device_kind']}")


def summarize(paths) -> list:
  rows = []
  for p in paths:
    with open(p) as f:
      rows.append(json.load(f))
  rows.sort(key=lambda r: (str(r.get("size")), int(r.get("d", 0)), str(r.get("impl"))))
  print("size  d     impl      rows x T    step s     tokens/s        model FLOPs / XLA FLOPs     MFU   peak memory")
  for r in rows:
    print(fmt(r))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="184m", choices=sorted(DEFAULTS))
  p.add_argument("--d", default="8", help="analysis d (w = 1); comma-separated: one after the other in this "
                 "process (the device's peak-memory counter then covers all of them so far)")
  p.add_argument("--slots", type=int, default=0, help="batch slots (rows = 2 x slots); 0: the size's default")
  p.add_argument("--window", type=int, default=0, help="tokens per row; 0: the size's default")
  p.add_argument("--impl", default="", help="attention_impl (dense, blockwise, fused); '': blockwise")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--peak_tflops", type=float, default=0.0, help="bf16 peak per device; 0: from the table")
  p.add_argument("--reduced", action="store_true",
                 help="the CPU smoke form: --size tiny (2 layers), 1 warm-up, 2 repeats")
  p.add_argument("--out", default=None, help="write each result (or its error) to OUT/SIZE_IMPL_dD.json")
  p.add_argument("--summarize", default=None, help="print the table of the JSON results in this folder")
  args = p.parse_args(argv)
  if args.summarize is not None:
    return summarize(sorted(glob.glob(os.path.join(args.summarize, "*.json"))))
  if args.reduced:
    args.size, args.warmup, args.repeats = "tiny", 1, 2
  results = []
  for d in [int(x) for x in args.d.split(",") if x.strip()]:
    one = argparse.Namespace(**{**vars(args), "d": d})
    path = args.out and os.path.join(args.out, f"{args.size}_{args.impl or 'blockwise'}_d{d}.json")
    try:
      result = run(one)
    except Exception as e:  # written down, so one failing configuration leaves the others' table intact
      result = {"size": args.size, "d": d, "error": f"{type(e).__name__}: {e}"[:2000]}
      if path:
        with open(path, "w") as f:
          json.dump(result, f, indent=2)
      raise
    print(fmt(result), flush=True)
    if path:
      with open(path, "w") as f:
        json.dump(result, f, indent=2)
    results.append(result)
  return results


if __name__ == "__main__":
  main()
