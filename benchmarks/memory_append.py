"""Appending one window to inference memory: a copying update against the in-place (donated)
update that fot_jax.inference uses, side by side in one run. Prints the time ratio.

  python -m benchmarks.memory_append
"""
import time

import jax
import jax.numpy as jnp


def _append(buf, k, at):
  return jax.lax.dynamic_update_slice_in_dim(buf, k, at, axis=1)


def main(batch=8, capacity=65536, window=128, kv=4, dim=16, steps=50):
  timings = {}
  for name, fn in (("copy", jax.jit(_append)),
                   ("donated", jax.jit(_append, donate_argnums=(0,)))):
    buf = jnp.zeros((batch, capacity, kv, dim))
    k = jnp.ones((batch, window, kv, dim))
    buf = fn(buf, k, 0).block_until_ready()  # compile
    t0 = time.perf_counter()
    for i in range(steps):
      buf = fn(buf, k, (i * window) % capacity)
    buf.block_until_ready()
    timings[name] = (time.perf_counter() - t0) / steps
  print(f"memory [{batch}, {capacity}, {kv}, {dim}] float32, one {window}-token window per append: "
        f"copy {timings['copy'] * 1e3:.2f} ms, donated {timings['donated'] * 1e3:.3f} ms, "
        f"ratio {timings['copy'] / timings['donated']:.0f}x")


if __name__ == "__main__":
  main()
