"""Generation tokens/s: fot_jax with the key/value cache vs recomputing the window vs transformers.

One random LLaMA model of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads,
3 kv heads, intermediate 1536, vocab 49152, tied embeddings) is made with
`transformers`, saved, and loaded by `fot_jax.from_pretrained` (same weights).
With a --batch x --prompt token prompt, in one process:

  cached      Pretrained.generate (fot_jax.inference: prefill, then one query per
              new token against the window's key/value cache + memory);
  recompute   the previous generator: every new token runs the whole padded
              window (--window tokens) through the model (timed over
              --recompute_tokens tokens, it is slow);
  transformers  LlamaForCausalLM.generate (greedy, its own KV cache), torch on the
              same CPU.

Each fot_jax variant runs once untimed first (compilation), then timed. Greedy
tokens of cached and transformers are compared (float32 both; ties can flip).

  python -m benchmarks.generation                      # ~5 minutes on 2 CPU cores
  python -m benchmarks.generation --window 8192 --new 64
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--window", type=int, default=1024, help="fot_jax local window (SmolLM2: 8192)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
  p.add_argument("--new", type=int, default=32, help="new tokens per row")
  p.add_argument("--recompute_tokens", type=int, default=3, help="tokens timed for the recompute baseline")
  p.add_argument("--layers", type=int, default=30, help="fewer layers for a quick run")
  p.add_argument("--torch_threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
  return p.parse_args(argv)


def log(msg):
  print(f"[generation {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_smollm2_shape(directory, layers):
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192, initializer_range=0.02)
  model = LlamaForCausalLM(cfg).eval()
  model.save_pretrained(directory)
  return model


def recompute_tokens_per_s(model, prompt, window, n):
  """The generator before the cache: the current window, padded, through the whole model per token."""
  from fot_jax.inference import forward_window
  b = prompt.shape[0]
  cur = prompt

  def step(cur):
    m = cur.shape[1]
    logits, _ = forward_window(model.params, jnp.asarray(np.pad(cur, [(0, 0), (0, window - m)])),
                               jnp.asarray(np.broadcast_to(np.arange(window) < m, (b, window))), None,
                               model.cfg, "dense", 32, 65536)
    return np.concatenate([cur, np.asarray(logits[:, m - 1]).argmax(-1)[:, None].astype(np.int32)], 1)

  cur = step(cur)  # compile
  t0 = time.perf_counter()
  for _ in range(n):
    cur = step(cur)
  return b * n / (time.perf_counter() - t0)


def main(argv=None):
  a = parse_args(argv)
  import torch
  import fot_jax
  if a.torch_threads:
    torch.set_num_threads(a.torch_threads)
  log(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
      f"({torch.get_num_threads()} threads)")
  prompt = np.random.default_rng(0).integers(0, 49152, (a.batch, a.prompt)).astype(np.int32)
  with tempfile.TemporaryDirectory() as tmp:
    hf = make_smollm2_shape(tmp, a.layers)
    model = fot_jax.from_pretrained(tmp)
  log(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
  log(f"model: {a.layers} layers of 576, window {a.window}, batch {a.batch}, prompt {a.prompt}, new {a.new}")

  model.generate(prompt, max_new_tokens=2, window=a.window)  # compile prefill + decode
  out = model.generate(prompt, max_new_tokens=a.new, window=a.window)
  st = model.generation_stats
  cached = st["tokens_per_s"]
  log(f"cached: prefill {st['prefill_s']:.2f} s, {cached:.2f} tokens/s")

  recompute = recompute_tokens_per_s(model, prompt, a.window, a.recompute_tokens)
  log(f"recompute: {recompute:.3f} tokens/s")

  with torch.no_grad():
    ids = torch.as_tensor(prompt, dtype=torch.long)
    hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    ref = hf.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False).numpy()
    tf_s = time.perf_counter() - t0
  tf_rate = a.batch * a.new / tf_s  # includes its prefill, which is small here
  log(f"transformers: {tf_rate:.2f} tokens/s (prefill included)")
  same = (ref[:, a.prompt:] == out[:, a.prompt:]).mean()

  print(f"\n| variant | tokens/s | cached / variant |\n|---|---|---|")
  print(f"| fot_jax cached | {cached:.2f} | 1.00 |")
  print(f"| fot_jax recompute (window {a.window}) | {recompute:.3f} | {cached / recompute:.1f} |")
  print(f"| transformers (torch CPU) | {tf_rate:.2f} | {cached / tf_rate:.2f} |")
  print(f"\ngreedy tokens equal to transformers: {same:.0%} of {out[:, a.prompt:].size}")


if __name__ == "__main__":
  main()
