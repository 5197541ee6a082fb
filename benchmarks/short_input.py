"""A short input through a model with a long window: what memory inference costs against a small window.

`m.logits_with_memory(tokens)` reads its input window by window; the last window is padded to a
small power-of-two bucket (fot_jax/inference.py, `padded_width`), so 2,048 tokens through a
checkpoint whose window is 8,192 should cost about what they cost with `window=512`, not a whole
8,192-token window (issue 33 measured 391 s and 12.2 GB against 16 s before the bucket). Each
variant runs in its own process, as a user's script would (load, compile, one call), and reports
its wall time and peak resident memory; then the ratios default window / window=512.

  python -m benchmarks.short_input                                   # checkpoints/smollm2-135m (make smollm2)
  python -m benchmarks.short_input --checkpoint CKPT --tokens 2048 --small_window 512
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(checkpoint: str, tokens: int, window: int) -> dict:
  """In this process: load, then one logits_with_memory call on `tokens` random ids (window 0:
  the checkpoint's). Wall seconds of the call (compilation included, as a user sees it)."""
  import numpy as np
  import fot_jax
  m = fot_jax.from_pretrained(checkpoint)
  ids = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (1, tokens))
  t0 = time.perf_counter()
  logits = m.logits_with_memory(ids, **({"window": window} if window else {}))
  seconds = time.perf_counter() - t0
  return {"window": window or int(m.window), "call_s": seconds, "logits_shape": list(np.shape(logits)),
          "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "smollm2-135m"))
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--small_window", type=int, default=512)
  p.add_argument("--out", default="", help="write the result as JSON here")
  p.add_argument("--_one", type=int, default=None, help=argparse.SUPPRESS)  # the child: its window
  a = p.parse_args(argv)
  if a._one is not None:
    print(json.dumps(one(a.checkpoint, a.tokens, a._one)))
    return
  if not os.path.isdir(a.checkpoint):
    sys.exit(f"benchmarks.short_input: no checkpoint at {a.checkpoint} (make smollm2)")
  rows = {}
  for name, window in (("default_window", 0), ("small_window", a.small_window)):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.short_input", "--checkpoint", a.checkpoint,
                           "--tokens", str(a.tokens), "--_one", str(window)], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    rows[name] = dict(json.loads(proc.stdout.strip().splitlines()[-1]), process_s=time.perf_counter() - t0)
    print(f"{name}: window {rows[name]['window']:,}: call {rows[name]['call_s']:.1f} s, process "
          f"{rows[name]['process_s']:.1f} s, peak RSS {rows[name]['peak_rss_gib']:.2f} GiB", flush=True)
  d, s = rows["default_window"], rows["small_window"]
  result = {"checkpoint": a.checkpoint, "tokens": a.tokens, **rows,
            "call_ratio": d["call_s"] / s["call_s"], "peak_rss_ratio": d["peak_rss_gib"] / s["peak_rss_gib"]}
  print(f"default / small window: call time {result['call_ratio']:.2f}x, peak RSS {result['peak_rss_ratio']:.2f}x")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
