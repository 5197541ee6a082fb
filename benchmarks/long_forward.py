"""One long causal window, dense against streamed (blockwise) attention, side by side.

What the study's plain methods pay at long lengths (fot_jax.study: the whole input in one
window): a forward of one sequence of L tokens through a model of the given shape (random
weights; the logits left out so the attention shows), with plain RoPE attention and with the
position strategies (Self-Extend, LM-Infinite). `dense` materialises the [T, T] scores of a
layer at once; `blockwise` streams query chunks x key blocks and skips the future
(fot_jax/model/attention_ops.py; the strategies: attention_rotated.py). Per length and variant:
the compiled forward's temporaries (XLA's memory analysis) and the median wall time of --runs
runs after a first one; then the blockwise/dense ratios.

  python -m benchmarks.long_forward                          # SmolLM2-135M's layer shape, 2 layers
  python -m benchmarks.long_forward --layers 30 --lengths 16384 --variants plain --impls blockwise
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks import save_json  # noqa: E402

VARIANTS = {
    "plain": {},
    "self_extend": {"kind": "self_extend", "window": 1024, "group": 64},  # the study's LLaMA-2 settings
    "lm_infinite": {"kind": "lm_infinite", "global_tokens": 10, "local_window": 4096, "max_distance": 4096},
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="smollm2_135m", help="a fot_jax.model.config size")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--vocab", type=int, default=256, help="small, so the logits do not hide the attention")
  p.add_argument("--lengths", default="2048,4096,8192")
  p.add_argument("--variants", default="plain,self_extend,lm_infinite")
  p.add_argument("--impls", default="dense,blockwise")
  p.add_argument("--block", type=int, default=512)
  p.add_argument("--runs", type=int, default=2)
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def measure(cfg, params, length: int, runs: int) -> dict:
  from fot_jax.model.llama import LlamaModel
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, length)), jnp.int32)
  fwd = jax.jit(lambda p, t: jnp.sum(LlamaModel(cfg).apply({"params": p}, t)[0]))
  t0 = time.perf_counter()
  compiled = fwd.lower(params, tokens).compile()
  compile_s = time.perf_counter() - t0
  temp = compiled.memory_analysis().temp_size_in_bytes
  jax.block_until_ready(compiled(params, tokens))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(params, tokens))
    times.append(time.perf_counter() - t0)
  return {"seconds": float(np.median(times)), "temp_bytes": int(temp), "compile_s": compile_s}


def main(argv=None):
  a = parse_args(argv)
  from fot_jax.model.config import get_size
  from fot_jax.model.llama import LlamaModel
  base = get_size(a.size, num_layers=a.layers, attention_block=a.block, mem_layers=(), vocab_size=a.vocab)
  params = None
  rows = []
  for length in (int(x) for x in a.lengths.split(",")):
    for variant in a.variants.split(","):
      for impl in a.impls.split(","):
        cfg = dataclasses.replace(base, position_strategy=VARIANTS[variant], attention_impl=impl)
        cfg.validate()
        if params is None:
          params = LlamaModel(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
        r = dict(length=length, variant=variant, impl=impl, **measure(cfg, params, length, a.runs))
        rows.append(r)
        print(f"L={length:6d} {variant:12s} {impl:9s} {r['seconds']:8.2f} s  temp {r['temp_bytes'] / 2**30:6.2f} GiB"
              f"  (compile {r['compile_s']:.0f} s)", flush=True)
  ratios = []
  for r in rows:
    if r["impl"] != "dense":
      d = next((x for x in rows if x["impl"] == "dense" and x["length"] == r["length"]
                and x["variant"] == r["variant"]), None)
      if d:
        ratios.append({"length": r["length"], "variant": r["variant"], "impl": r["impl"],
                       "time_ratio": r["seconds"] / d["seconds"], "temp_ratio": r["temp_bytes"] / max(d["temp_bytes"], 1)})
        print(f"L={r['length']:6d} {r['variant']:12s} {r['impl']}/dense: time {ratios[-1]['time_ratio']:.2f}x, "
              f"temporaries {ratios[-1]['temp_ratio']:.3f}x")
  out = {"size": a.size, "layers": a.layers, "block": a.block, "backend": jax.default_backend(),
         "rows": rows, "ratios": ratios}
  return save_json(a.json, out)


if __name__ == "__main__":
  main()
