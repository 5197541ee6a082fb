"""Fine-tuning memory with a position strategy: the compiled training step, dense against blockwise.

value_and_grad of the next-token loss of one window of L tokens through a model of the given
shape (random weights; a small vocabulary, so the logits do not hide the attention), with plain
RoPE attention and with the position strategies (Self-Extend, LM-Infinite; the settings of
benchmarks/long_forward.py). `dense` materialises each layer's [T, T] scores and keeps them for
the backward pass; `blockwise` streams (query chunk, key block) pairs in both passes, the
strategies through `attention_rotated.attend_rotated` and its custom VJP. The step is compiled, not
run: per variant, the temporaries of XLA's memory analysis, then the dense/blockwise ratio.

  python -m benchmarks.position_strategy_memory                   # SmolLM2-135M's layer shape, 2 layers, 8K
  python -m benchmarks.position_strategy_memory --length 4096 --variants self_extend --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.long_forward import VARIANTS  # noqa: E402
from benchmarks import save_json  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", default="smollm2_135m", help="a fot_jax.model.config size")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--vocab", type=int, default=256, help="small, so the logits do not hide the attention")
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--variants", default="plain,self_extend,lm_infinite")
  p.add_argument("--impls", default="dense,blockwise")
  p.add_argument("--block", type=int, default=512)
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def step_memory(cfg, length: int) -> dict:
  """Compiles value_and_grad of the loss over one row of `length` tokens -> temporaries."""
  from fot_jax.model.llama import LlamaModel
  model = LlamaModel(cfg)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"])
  tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)

  def loss(p, t):
    logits = model.apply({"params": p}, t)[0][:, :-1].astype(jnp.float32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], -1)
    return -jnp.mean(logp)

  t0 = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
  return {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
          "compile_s": time.perf_counter() - t0}


def main(argv=None):
  a = parse_args(argv)
  from fot_jax.model.config import get_size
  base = get_size(a.size, num_layers=a.layers, attention_block=a.block, mem_layers=(), vocab_size=a.vocab)
  rows = []
  for variant in a.variants.split(","):
    for impl in a.impls.split(","):
      cfg = dataclasses.replace(base, position_strategy=VARIANTS[variant], attention_impl=impl)
      cfg.validate()
      r = dict(variant=variant, impl=impl, **step_memory(cfg, a.length))
      rows.append(r)
      print(f"L={a.length} {variant:12s} {impl:9s} temp {r['temp_bytes'] / 2**30:7.3f} GiB"
            f"  (compile {r['compile_s']:.0f} s)", flush=True)
  ratios = []
  for variant in a.variants.split(","):
    by_impl = {r["impl"]: r["temp_bytes"] for r in rows if r["variant"] == variant}
    if "dense" in by_impl and "blockwise" in by_impl:
      ratios.append({"variant": variant, "dense_gib": by_impl["dense"] / 2**30,
                     "blockwise_gib": by_impl["blockwise"] / 2**30,
                     "ratio": by_impl["dense"] / max(by_impl["blockwise"], 1)})
  if ratios:
    print(f"\n| variant (L={a.length}) | dense GiB | blockwise GiB | dense / blockwise |\n|---|---|---|---|")
    for r in ratios:
      print(f"| {r['variant']} | {r['dense_gib']:.3f} | {r['blockwise_gib']:.3f} | {r['ratio']:.1f}x |")
  out = {"size": a.size, "layers": a.layers, "vocab": a.vocab, "length": a.length, "block": a.block,
         "backend": jax.default_backend(), "jax": jax.__version__, "rows": rows, "ratios": ratios}
  return save_json(a.json, out)


if __name__ == "__main__":
  main()
