"""Sequence parallelism (fot_jax/model/context_parallel.py) on fake CPU devices: causal load
balance of the layouts, per-device memory of the compiled train step against the window, and
communication per device of ring, all-gather and Ulysses, next to the textbook's formulas.

1. Load imbalance (largest device's attention work over the mean) of a causal window of
   --balance_tokens tokens over --devices devices, per layout: counted (unmasked query-key
   scores per device, what the textbook section counts) and measured: XLA's FLOPs of each
   device's compiled ring forward (`_ring_forward` with that device's index static, so the
   chunk pairs the causal mask hides are dropped at compile time, as `lax.cond` skips them
   at run time in the SPMD program).
2. Per-device memory (XLA's memory analysis) of the compiled FoT train step at windows
   --lengths, at context=--devices and at context=1 (one device), ring + zigzag + blockwise.
3. Bytes each device sends per attention layer (forward, and forward + backward) for each
   strategy, counted from the compiled HLO: every collective's size times the trip count of
   the loops around it (collective-permute: its buffer; all-gather / all-to-all /
   reduce-scatter: (n-1)/n of the gathered / exchanged buffer; all-reduce: 2 (n-1)/n).

  python -m benchmarks.context_parallel                  # 210 s of CPU (2 cores)
  python -m benchmarks.context_parallel --parts comm --tokens 32768
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--parts", default="balance,memory,comm")
  p.add_argument("--balance_tokens", type=int, default=256, help="the textbook's cell: 256 tokens")
  p.add_argument("--lengths", default="1024,2048,4096")
  p.add_argument("--tokens", type=int, default=8192, help="window of the communication count")
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--dtype", default="float32", help="XLA:CPU carries bf16 collectives in float32")
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


# ----------------------------------------------------------------------------- HLO collectives

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8}
_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|f32|s32|u32|f64|s64)\[([0-9,]*)\]")
_COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "reduce-scatter", "all-reduce")


def _nbytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(type_text):
    size = 1
    for x in filter(None, dims.split(",")):
      size *= int(x)
    total += size * _BYTES[dtype]
  return total


def _group_size(line: str, default: int) -> int:
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([0-9,]+)\}", line)
  return len(m.group(1).split(",")) if m else default


def collective_bytes(hlo: str, devices: int) -> dict:
  """{op kind: bytes sent per device} of a compiled (SPMD, per-device) HLO module, each
  collective counted as often as the loops around it run."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
    elif current is not None and line.startswith(" "):
      comps[current].append(line)
  calls = defaultdict(list)  # computation -> [(callee, times)]
  own = defaultdict(lambda: defaultdict(float))
  for name, lines in comps.items():
    for line in lines:
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      body = re.search(r"body=%?([\w.\-]+)", line)
      if body:
        calls[name].append((body.group(1), int(trip.group(1)) if trip else 1))
      for ref in re.findall(r"(?:calls|to_apply|condition|true_computation|false_computation)=%?([\w.\-]+)", line):
        calls[name].append((ref, 1))
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        calls[name] += [(b.strip().lstrip("%"), 1) for b in branches.group(1).split(",")]
      m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", line)
      if not m:
        continue
      size, kind, n = _nbytes(m.group(1)), m.group(2), _group_size(line, devices)
      if kind == "collective-permute":
        sent = size
      elif kind in ("all-gather", "all-to-all"):
        sent = size * (n - 1) / n
      elif kind == "reduce-scatter":
        sent = size * (n - 1)
      else:
        sent = 2 * size * (n - 1) / n
      own[name][kind] += sent
  totals = defaultdict(float)

  def walk(name, times, depth=0):
    for kind, sent in own[name].items():
      totals[kind] += sent * times
    for callee, k in calls.get(name, []):
      if callee in comps and depth < 64:
        walk(callee, times * k, depth + 1)

  walk(entry, 1)
  return dict(totals)


# ----------------------------------------------------------------------------- parts

def balance(a, jax, jnp, np):
  from fot_jax.model import context_parallel as cp
  n, t = a.devices, a.balance_tokens
  c = t // n
  b, kv, g, d = 1, 1, 1, 16
  rows = []
  for layout in cp.LAYOUTS:
    work = cp.work_counts(t, n, layout)
    flops = []
    for me in range(n):
      def device_work(q, k, v, me=me):
        chunks = [(k[:, p * c:(p + 1) * c], v[:, p * c:(p + 1) * c], jnp.ones((b, c), bool),
                   jnp.zeros((b, c), bool)) for p in range(n)]
        return cp._ring_forward(q, None, None, None, None, True, layout, n, c, want_pos=True,  # as measured
                                me=me, chunks=chunks)[0]
      args = (jax.ShapeDtypeStruct((b, c, kv, g, d), jnp.float32),
              jax.ShapeDtypeStruct((b, t, kv, d), jnp.float32), jax.ShapeDtypeStruct((b, t, kv, d), jnp.float32))
      cost = jax.jit(device_work).lower(*args).compile().cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      flops.append(float(cost["flops"]))
    flops = np.asarray(flops)
    rows.append({"layout": layout, "counted": float(work.max() / work.mean()),
                 "flops": float(flops.max() / flops.mean()), "flops_per_device": flops.tolist(),
                 "work_per_device": work.tolist()})
    print(f"  {layout:<11} counted {rows[-1]['counted']:.2f}   compiled FLOPs {rows[-1]['flops']:.2f}   "
          f"(FLOPs per device {', '.join(f'{x:.3g}' for x in flops)})", flush=True)
  return rows


def memory(a, jax, jnp, np):
  import optax
  from fot_jax import parallel, plan
  from fot_jax.model.config import get_size
  cfg = get_size("tiny", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                 num_heads=4, num_kv_heads=2, mem_layers=(1,), attention_impl="blockwise", attention_block=128,
                 context_parallel="ring", context_layout="zigzag")
  rules = parallel.DEFAULT_RULES
  meshes = {a.devices: parallel.make_mesh({"data": 1, "context": a.devices}),
            1: parallel.make_mesh(None, devices=jax.devices()[:1])}
  rows = []
  for t in (int(x) for x in a.lengths.split(",")):
    row = {"window": t}
    for context, mesh in meshes.items():
      compiled, _ = plan.compile_step(cfg, optax.sgd(1.0), mesh, rules, 4, t, 1, {"d": 2, "w": 1})
      row[f"context{context}"] = plan.memory_per_device(compiled)
    rows.append(row)
    big, one = row[f"context{a.devices}"]["temporaries"], row["context1"]["temporaries"]
    print(f"  window {t:>6}: temporaries per device context={a.devices} {big / 2**20:8.2f} MiB, context=1 "
          f"{one / 2**20:8.2f} MiB, ratio {one / big:.2f}", flush=True)
  return rows


def comm(a, jax, jnp, np):
  import flax.linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fot_jax import parallel
  from fot_jax.model import context_parallel as cp
  n, t, h, kv, d = a.devices, a.tokens, a.heads, a.kv_heads, a.head_dim
  mesh = parallel.make_mesh({"data": 1, "context": n})
  seq = NamedSharding(mesh, P(None, "context"))
  dtype = jnp.dtype(a.dtype)
  args = (jax.ShapeDtypeStruct((1, t, kv, h // kv, d), dtype, sharding=seq),
          jax.ShapeDtypeStruct((1, t, kv, d), dtype, sharding=seq),
          jax.ShapeDtypeStruct((1, t, kv, d), dtype, sharding=seq))
  c = t // n
  formulas = {  # numbers per device per layer, forward (textbook; x (n-1)/n for what a device keeps)
      "ring": 2 * t * kv * d * (n - 1) / n, "allgather": 2 * t * kv * d * (n - 1) / n,
      "ulysses": (2 * h + 2 * kv) * d * c * (n - 1) / n}
  rows = []
  for strategy in cp.STRATEGIES:
    out = {"strategy": strategy, "formula_forward_bytes": dtype.itemsize * formulas[strategy]}
    for label, backward in (("forward", False), ("forward_backward", True)):
      def layer(q, k, v, strategy=strategy, backward=backward):
        with nn.logical_axis_rules(parallel.DEFAULT_RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
          mask = jnp.ones(k.shape[:2], bool)
          def f(q, k, v):  # a loss whose cotangents are not constants (XLA would fold their transfer)
            part = cp.attend(q, k, v, mask, causal=True, strategy=strategy, layout="zigzag", impl="blockwise",
                             block=1024)
            return jnp.sum(jnp.sin(part.acc)) + jnp.sum(jnp.sin(part.m))
          return jax.grad(f, argnums=(0, 1, 2))(q, k, v) if backward else f(q, k, v)
      hlo = jax.jit(layer).lower(*args).compile().as_text()
      out[label] = collective_bytes(hlo, n)
    rows.append(out)
    fwd, both = sum(out["forward"].values()), sum(out["forward_backward"].values())
    print(f"  {strategy:<9} forward {fwd / 2**20:8.2f} MiB (formula {out['formula_forward_bytes'] / 2**20:8.2f} MiB)"
          f"   forward+backward {both / 2**20:8.2f} MiB   "
          f"{ {k: round(v / 2**20, 2) for k, v in out['forward_backward'].items()} }", flush=True)
  return rows


def main(argv=None):
  a = parse_args(argv)
  if "jax" not in sys.modules:  # fake devices must be set before jax starts
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np
  results = {}
  for part, fn, title in (("balance", balance, f"causal load imbalance, {a.balance_tokens} tokens over "
                                                f"{a.devices} devices (largest device / mean)"),
                          ("memory", memory, "per-device memory of the compiled FoT step by window"),
                          ("comm", comm, f"bytes sent per device per attention layer, {a.tokens} tokens, "
                                         f"{a.heads} heads / {a.kv_heads} kv heads of {a.head_dim}, {a.dtype}, "
                                         f"{a.devices} devices")):
    if part in a.parts.split(","):
      t0 = time.time()
      print(f"{title}:", flush=True)
      results[part] = fn(a, jax, jnp, np)
      print(f"  ({time.time() - t0:.0f}s)", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
