"""Approximate top-k memory (jax.lax.approx_max_k) vs exact top-k: recall@k and time.

For each memory size M (--sizes), random unit-norm keys [M, D] and --queries
queries: (1) the selection op alone on the scores [Q, M]: recall@k of
approx_max_k at each --recalls target against jax.lax.top_k, and the median
time of both; (2) the memory mode end to end, fot_jax.model.memory.
topk_memory_partial (chunks of --chunk entries, exact vs approx), median time.
The exact mode searches each chunk with fot_jax.model.memory.grouped_top_k (two
small top_k calls, exact): its row times that op against jax.lax.top_k on the
same scores. On CPU and GPU XLA computes approx_max_k exactly (recall 1.0, no
speed-up); the approximation (and its speed) is the TPU's.

  python -m benchmarks.approx_topk                    # 64K entries, ~1 minute on 2 cores
  python -m benchmarks.approx_topk --sizes 65536,1048576
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from fot_jax.model.memory import READ_CHUNK, MemoryBlock, grouped_top_k, topk_memory_partial


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="65536", help="comma-separated memory sizes M")
  p.add_argument("--queries", type=int, default=64)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--k", type=int, default=32)
  p.add_argument("--recalls", default="0.9,0.95,0.99")
  p.add_argument("--chunk", type=int, default=READ_CHUNK)
  p.add_argument("--repeats", type=int, default=5)
  return p.parse_args(argv)


def timed(fn, *args, repeats):
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None):
  a = parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {a.queries} queries, dim {a.dim}, k {a.k}")
  recalls = [float(r) for r in a.recalls.split(",")]
  print("\n| M | method | recall@k | op ms | ratio to exact | memory mode ms | ratio |\n|---|---|---|---|---|---|---|")
  for m in [int(s) for s in a.sizes.split(",")]:
    rng = np.random.default_rng(0)
    keys = rng.normal(0, 1, (m, a.dim)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    q = rng.normal(0, 1, (a.queries, a.dim)).astype(np.float32)
    keys_j, q_j = jnp.asarray(keys), jnp.asarray(q)
    exact_op = jax.jit(lambda q, k: jax.lax.top_k(q @ k.T, a.k)[1])
    exact_idx = np.asarray(exact_op(q_j, keys_j))
    t_exact = timed(exact_op, q_j, keys_j, repeats=a.repeats)
    # The memory mode: one row, one kv head, all queries as a group.
    block = [MemoryBlock(keys_j[None, :, None], keys_j[None, :, None], jnp.ones((1, m), bool))]
    qm = q_j[None, None, None]  # [B=1, T=1, KV=1, G=Q, D]
    mode = lambda recall: jax.jit(lambda q: topk_memory_partial(q, block, a.k, a.chunk, recall).acc)
    t_mode_exact = timed(mode(None), qm, repeats=a.repeats)
    print(f"| {m:,} | exact top_k | 1.000 | {1e3 * t_exact:.2f} | 1.00 | {1e3 * t_mode_exact:.1f} | 1.00 |")
    grouped = jax.jit(lambda q, k: grouped_top_k(q @ k.T, a.k)[1])
    hit = np.mean([len(set(i) & set(e)) / a.k for i, e in zip(np.asarray(grouped(q_j, keys_j)), exact_idx)])
    t = timed(grouped, q_j, keys_j, repeats=a.repeats)
    print(f"| {m:,} | grouped_top_k (the exact mode's search) | {hit:.3f} | {1e3 * t:.2f} | {t / t_exact:.2f} | "
          f"(the exact row) | - |")
    for r in recalls:
      op = jax.jit(lambda q, k, r=r: jax.lax.approx_max_k(q @ k.T, a.k, recall_target=r)[1])
      idx = np.asarray(op(q_j, keys_j))
      hit = np.mean([len(set(i) & set(e)) / a.k for i, e in zip(idx, exact_idx)])
      t = timed(op, q_j, keys_j, repeats=a.repeats)
      tm = timed(mode(r), qm, repeats=a.repeats)
      print(f"| {m:,} | approx_max_k {r} | {hit:.3f} | {1e3 * t:.2f} | {t / t_exact:.2f} | {1e3 * tm:.1f} | "
            f"{tm / t_mode_exact:.2f} |")


if __name__ == "__main__":
  main()
