"""Writing a long memory without gradient: train.memory's write (fot_jax/train/far_memory.py
write_memory) timed for a checkpoint's model.

A haystack of --tokens token ids (random over the vocabulary: the time does not depend on the text)
is run window by window through the layers up to the last memory layer, each window's memory
layers reading their top-k of the memory before it, as train.memory writes it every `refresh`
steps. Each pair of a capacity and a chunk is timed after a compiling write of 2 windows, one after
the other: the memory buffer allocated for the whole haystack at once (`full`: what write_memory
does) or grown by doubling from 1,024 entries (`grow`: inference's default; recompiles at each new
capacity); the exact top-k search scores `chunk` keys at a time and skips the chunks that hold no
entry yet (write_memory's MEMORY_CHUNK, 4,096; inference's default READ_CHUNK, 65,536, is one chunk for a 64K
buffer, so nothing is skipped and every window scores the whole buffer). Each row's seconds are
also given over the first row's.

  python -m benchmarks.memory_write --checkpoint checkpoints/smollm2-135m --mem_layers 6,17,18,20 --tokens 16384
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from benchmarks import save_json  # noqa: E402

from fot_jax.model.memory import READ_CHUNK  # noqa: E402
from fot_jax.train.far_memory import MEMORY_CHUNK  # noqa: E402

CAPACITIES = ("full", "grow")
GROW_FROM = 1024  # inference's first capacity (MemoryInference.new_memory), doubled as memory grows


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="an fot_jax checkpoint or training workdir")
  p.add_argument("--mem_layers", default="", help="e.g. 6,17,18,20 for a checkpoint without memory layers")
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--topk", type=int, default=32)
  p.add_argument("--capacities", default="full,grow")
  p.add_argument("--chunks", default=f"{MEMORY_CHUNK},{READ_CHUNK}", help="keys scored at a time by the top-k search")
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def write(cfg, params, tokens: np.ndarray, window: int, topk: int, capacity, chunk: int) -> float:
  """Seconds of write_memory (fot_jax/train/far_memory.py) with a buffer of `capacity` entries
  allocated at once (None: the haystack's length, as train.memory writes), `chunk` keys scored at a time."""
  import jax
  from fot_jax.settings import MemorySettings
  from fot_jax.train.far_memory import write_memory
  t0 = time.perf_counter()
  jax.block_until_ready(write_memory(cfg, params, tokens, MemorySettings(window=window, topk=topk), capacity, chunk))
  return time.perf_counter() - t0


def main(argv=None):
  a = parse_args(argv)
  from fot_jax.convert.api import from_pretrained
  capacities = a.capacities.split(",")
  bad = [c for c in capacities if c not in CAPACITIES]
  if bad:
    raise SystemExit(f"benchmarks.memory_write: --capacities: {bad} not in {CAPACITIES}")
  chunks = [int(c) for c in a.chunks.split(",") if c.strip().isdigit()]
  if len(chunks) != len(a.chunks.split(",")) or min(chunks) < 1:
    raise SystemExit(f"benchmarks.memory_write: --chunks must be positive integers, got {a.chunks!r}")
  if a.tokens % a.window or a.tokens < 2 * a.window:
    raise SystemExit(f"benchmarks.memory_write: --tokens must be a multiple of --window={a.window}, at least 2 windows")
  mem_layers = tuple(int(x) for x in a.mem_layers.split(",")) if a.mem_layers else None
  ck = from_pretrained(a.checkpoint, **({"mem_layers": mem_layers} if mem_layers else {}))
  if not ck.cfg.mem_layers:
    raise SystemExit("benchmarks.memory_write: the model has no memory layers: pass --mem_layers")
  tokens = np.random.default_rng(0).integers(0, ck.cfg.vocab_size, a.tokens).astype(np.int32)
  rows = []
  for capacity in capacities:
    entries = a.tokens if capacity == "full" else GROW_FROM
    for chunk in chunks:
      write(ck.cfg, ck.params, tokens[: 2 * a.window], a.window, a.topk, entries, chunk)  # compiles (grow: its first size)
      seconds = write(ck.cfg, ck.params, tokens, a.window, a.topk, entries, chunk)
      rows.append({"capacity": capacity, "chunk": chunk, "seconds": seconds, "tokens_per_s": a.tokens / seconds,
                   "over_first": seconds / rows[0]["seconds"] if rows else 1.0})
      print(f"{a.tokens:7,} tokens  {capacity:4s} chunk {chunk:6d} {seconds:8.1f} s  {a.tokens / seconds:8.1f} "
            f"tokens/s  {rows[-1]['over_first']:.2f}x the first", flush=True)
  out = {"checkpoint": a.checkpoint, "tokens": a.tokens, "window": a.window, "topk": a.topk,
         "mem_layers": list(ck.cfg.mem_layers), "rows": rows}
  return save_json(a.json, out)


if __name__ == "__main__":
  main()
