"""Reading a long prompt through FoT memory: dense memory on the device against each query's top-k
from a host index (fot_jax/host_memory.py), side by side on the same prompt.

A passkey prompt (fot_jax/eval/passkey.py's wording, key at mid depth) of each length is read
window by window with memory, logits kept for its last token only; per variant the wall time of one
read (after a first, compiling read of a short prompt), the next token it predicts (the passkey's
first digit when read right) and the host index's recall@k against exact search (on a sample of
every window's queries, and on every query of the last position, the one that reads the key). Then the
host/dense time ratios. Dense at 128K costs ~15-20 minutes on 2 CPU cores: --variants picks.

  python -m benchmarks.host_memory --checkpoint runs/smollm2_retrieval_base/fot --lengths 16384,65536
  python -m benchmarks.host_memory --checkpoint C --lengths 131072 --variants host_ivf
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from benchmarks import save_json  # noqa: E402

VARIANTS = ("dense", "host_ivf", "host_flat")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="an fot_jax checkpoint or training workdir")
  p.add_argument("--vocab", default="", help="default: the checkpoint's tokenizer")
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--lengths", default="16384,65536")
  p.add_argument("--variants", default="dense,host_ivf")
  p.add_argument("--topk", type=int, default=32)
  p.add_argument("--nprobe", type=int, default=8)
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def inference(variant: str, cfg, params, window: int, topk: int, nprobe: int):
  from fot_jax.host_memory import HostMemoryInference
  from fot_jax.inference import MemoryInference
  if variant == "dense":
    return MemoryInference(cfg, params, window, "dense")
  if variant in ("host_ivf", "host_flat"):
    return HostMemoryInference(cfg, params, window, topk, variant.split("_")[1], nprobe)
  raise ValueError(f"--variants: each must be one of {VARIANTS}, got {variant!r}")


def read(inf, tokens: np.ndarray) -> dict:
  """One prompt through memory, end-aligned as the suites read it; the last token's logits."""
  from fot_jax.inference import end_aligned
  placed, mask, _ = end_aligned([tokens], inf.window, inf.window)
  memory = inf.new_memory(1)
  t0 = time.perf_counter()
  logits = inf.process(placed, memory, mask, logits_from=placed.shape[1] - 1)
  seconds = time.perf_counter() - t0
  return {"seconds": seconds, "next_token": int(np.argmax(logits[0, -1])),
          "recall": getattr(memory, "recall", None), "scored_recall": getattr(memory, "scored_recall", None)}


def main(argv=None):
  a = parse_args(argv)
  from fot_jax.convert.api import from_pretrained
  from fot_jax.eval import passkey
  ck = from_pretrained(a.checkpoint)
  vocab = ck.vocabulary(a.vocab)
  make = passkey.make_prompt_fn(vocab)
  variants = a.variants.split(",")
  bad = [v for v in variants if v not in VARIANTS]
  if bad:
    raise SystemExit(f"benchmarks.host_memory: --variants: {bad} not in {VARIANTS}")
  warm = np.asarray(vocab.encode(make(4 * a.window, 0.5, np.random.default_rng(1))[0]), np.int32)
  rows = []
  for length in (int(x) for x in a.lengths.split(",")):
    prompt, answer = make(length, 0.5, np.random.default_rng(0))
    tokens = np.asarray([vocab.bos_id] + list(vocab.encode(prompt)), np.int32)
    for variant in variants:
      inf = inference(variant, ck.cfg, ck.params, a.window, a.topk, a.nprobe)
      read(inf, warm)  # compiles every window shape but the last's
      r = dict(length=int(len(tokens)), variant=variant, answer=answer, **read(inf, tokens))
      rows.append(r)
      recall = "" if r["recall"] is None else (f", recall@{a.topk} {r['recall']:.3f} (sampled), "
                                               f"{r['scored_recall']:.3f} (the last position's queries)")
      print(f"{r['length']:7,} tokens  {variant:9s} {r['seconds']:8.1f} s{recall}", flush=True)
  ratios = []
  for r in rows:
    d = next((x for x in rows if x["variant"] == "dense" and x["length"] == r["length"]), None)
    if r["variant"] != "dense" and d:
      ratios.append({"length": r["length"], "variant": r["variant"], "time_ratio": r["seconds"] / d["seconds"]})
      print(f"{r['length']:7,} tokens  {r['variant']}/dense: time {ratios[-1]['time_ratio']:.2f}x")
  out = {"checkpoint": a.checkpoint, "window": a.window, "topk": a.topk, "nprobe": a.nprobe,
         "mem_layers": list(ck.cfg.mem_layers), "rows": rows, "ratios": ratios}
  return save_json(a.json, out)


if __name__ == "__main__":
  main()
