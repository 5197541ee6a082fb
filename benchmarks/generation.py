"""Generation tokens/s: fot_jax's KV-cached generate against transformers (and recomputing the window).

One random LLaMA model of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads,
3 kv heads, intermediate 1536, vocab 49152, tied embeddings; --hidden narrows it,
64 dims per head, 3 query heads per kv head) is made with `transformers`, saved,
and loaded by `fot_jax.from_pretrained` (same weights) with memory layers
--mem_layers ('first' positions, SmolLM2's FoT layout) and --impl attention.
fot_jax's window is --window: a --prompt longer than that goes through FoT memory
(Pretrained.generate prefills the earlier windows into memory window by window);
transformers gets the whole prompt. In one process, after untimed warm-up runs
(compilation), --runs alternating runs of:

  fot_jax       Pretrained.generate: prefill, then the on-device decode loop against
                the cache + memory. Decode tokens/s: batch x (new - 1) / decode time
                (its first token comes from the prefill's logits).
  transformers  LlamaForCausalLM.generate (greedy, its KV cache, torch on the same CPU)
                from a cache of prompt[:-1] (prefilled once, timed, copied per run).
                Decode tokens/s: batch x new / time (its first forward is the prompt's
                last token).

The ratio fot_jax / transformers is taken per run and reported as the median. Then,
when the prompt and a few tokens fit the window, `recompute` (the generator before the
cache: the whole padded window through the model per token, --recompute_tokens tokens).
Greedy tokens are compared (float32 both; equal unless the prompt passed through memory,
which transformers does not have, or a tie flips).

  python -m benchmarks.generation                   # prompt 200, about a minute on 2 CPU cores
  python -m benchmarks.generation --prompt 16384    # through memory, about 6 minutes
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--window", type=int, default=2048, help="fot_jax local window (SmolLM2's: 8192)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--prompt", type=int, default=200, help="prompt tokens per row")
  p.add_argument("--new", type=int, default=32, help="new tokens per row")
  p.add_argument("--runs", type=int, default=3, help="alternating timed runs; the median ratio is reported")
  p.add_argument("--recompute_tokens", type=int, default=3, help="tokens timed for the recompute baseline (0: skip)")
  p.add_argument("--layers", type=int, default=30, help="fewer layers for a quick run")
  p.add_argument("--hidden", type=int, default=576, help="a narrower model of the same structure")
  p.add_argument("--mem_layers", default="8,16,24", help="fot_jax memory layers ('' for none)")
  p.add_argument("--impl", default="blockwise", help="fot_jax attention_impl (windows of the prefill)")
  p.add_argument("--torch_threads", type=int, default=1,
                 help="torch.set_num_threads (0: torch's default; on this shared 2-core machine its 2 "
                      "threads decoded several times slower than 1)")
  return p.parse_args(argv)


def log(msg):
  print(f"[generation {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_smollm2_shape(directory, layers, hidden=576):
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  heads = hidden // 64
  cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    max_position_embeddings=8192, initializer_range=0.02)
  model = LlamaForCausalLM(cfg).eval()
  model.save_pretrained(directory)
  return model


def recompute_tokens_per_s(model, prompt, window, n):
  """The generator before the cache: the current window, padded, through the whole model per token."""
  from fot_jax.inference import forward_window
  from fot_jax.model.memory import READ_CHUNK
  b = prompt.shape[0]
  cur = prompt

  def step(cur):
    m = cur.shape[1]
    logits, _ = forward_window(model.params, jnp.asarray(np.pad(cur, [(0, 0), (0, window - m)])),
                               jnp.asarray(np.broadcast_to(np.arange(window) < m, (b, window))), None,
                               model.cfg, "dense", 32, READ_CHUNK)
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
  mem_layers = tuple(int(x) for x in a.mem_layers.split(",") if x and int(x) < a.layers)  # --layers cuts
  with tempfile.TemporaryDirectory() as tmp:
    hf = make_smollm2_shape(tmp, a.layers, a.hidden)
    model = fot_jax.from_pretrained(tmp, mem_layers=mem_layers, mem_positions="first", attention_impl=a.impl)
  log(f"model: {a.layers} layers of {a.hidden}, memory layers {mem_layers}, {a.impl} attention, window "
      f"{a.window}; batch {a.batch}, prompt {a.prompt}, new {a.new}; load average "
      f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

  def fot_run():
    out = model.generate(prompt, max_new_tokens=a.new, window=a.window)
    st = model.generation_stats
    return out, st["prefill_s"], a.batch * (a.new - 1) / st["decode_s"]

  ids = torch.as_tensor(prompt, dtype=torch.long)

  def hf_run(cache):
    t0 = time.perf_counter()
    ref = hf.generate(ids, cache=copy.deepcopy(cache), max_new_tokens=a.new, min_new_tokens=a.new,
                      do_sample=False)
    return ref.numpy(), a.batch * a.new / (time.perf_counter() - t0)

  t0 = time.perf_counter()
  fot_run()  # compile prefill + decode
  log(f"fot_jax warm-up (compilation): {time.perf_counter() - t0:.1f} s")
  with torch.no_grad():
    hf.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    cache = hf(ids[:, :-1], use_cache=True, logits_to_keep=1).cache
    hf_prefill = time.perf_counter() - t0
    log(f"transformers prefill of {a.prompt - 1} tokens: {hf_prefill:.2f} s")
    runs = []
    for r in range(a.runs):
      out, fot_prefill, fot_rate = fot_run()
      ref, hf_rate = hf_run(cache)
      runs.append((fot_prefill, fot_rate, hf_rate))
      log(f"run {r + 1}: fot_jax prefill {fot_prefill:.2f} s, {fot_rate:.2f} tokens/s; transformers "
          f"{hf_rate:.2f} tokens/s; ratio {fot_rate / hf_rate:.2f}")
  same = (ref[:, a.prompt:] == out[:, a.prompt:]).mean()
  recompute = None
  if a.recompute_tokens and a.prompt + a.recompute_tokens + 1 <= a.window:
    recompute = recompute_tokens_per_s(model, prompt, a.window, a.recompute_tokens)
  log(f"load average {os.getloadavg()[0]:.1f}")

  print(f"\n| run | fot_jax prefill s | fot_jax decode tokens/s | transformers decode tokens/s | ratio |")
  print("|---|---|---|---|---|")
  for r, (pf, fr, hr) in enumerate(runs):
    print(f"| {r + 1} | {pf:.2f} | {fr:.2f} | {hr:.2f} | {fr / hr:.2f} |")
  med = np.median(np.array(runs), 0)
  print(f"| median | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | "
        f"**{np.median([fr / hr for _, fr, hr in runs]):.2f}** |")
  print(f"\ntransformers prefill of {a.prompt - 1} tokens: {hf_prefill:.2f} s (once)")
  if recompute:
    print(f"fot_jax recompute (window {a.window}): {recompute:.3f} tokens/s; cached / recompute "
          f"{med[1] / recompute:.0f}")
  print(f"greedy tokens equal to transformers: {same:.0%} of {out[:, a.prompt:].size}")


if __name__ == "__main__":
  main()
