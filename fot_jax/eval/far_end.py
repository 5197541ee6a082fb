"""Dictionary lookup far out: the demo's trained FoT model with up to 16M tokens of other
dictionaries' definitions in memory (`make demo-16m`; docs/evaluation.md). The FoT paper reports
above 92% at 16M tokens.

Sizes first. The demo's memory layer has 4 kv heads of 16 dims, so 16M tokens of memory are
16M x 4 x 16 x 4 B = 4 GiB of keys and as much of values in float32. The suite's host path
(fot_jax.eval.dictionary, retrieval='flat') holds both and faiss's own copy of the keys (12 GiB),
and concatenates its encoded chunks (16 GiB at the peak), on a 24 GiB machine shared with other
jobs, and it searches row by row (a selector per row for the row's own window). Here nothing of
the memory is kept: it is encoded chunk by chunk and each chunk goes through faiss's exact inner-product
search for every question's memory queries at once (host_index.StreamedTopK), merged into a
running top-(k + window) per query: RAM is one chunk plus those entries, whatever the memory
size. The queries are known before the memory is read, as the memory layer's queries do not
depend on memory (no layer below it reads memory).

Contexts are prefixes of one distractor pool (as in the suite), so one pass over the largest
evaluates every context on the way. At each, a row leaves out the shared copy of its own window
(at most `window` entries, hence k + window kept) and reads that window from its own forward, as
the suite does; the device takes the exact top-k of the union of the row's retrieved entries.
The index is thus exact (`flat`); recall@k against a NumPy brute force on a sample of queries
checks it.
"""
from __future__ import annotations

import argparse
import functools
import os
import resource
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from data_pipelines.dictionary_lookup import DictionaryTask
from fot_jax import checkpoint, jsonio, plots
from fot_jax.eval import dictionary, host_index
from fot_jax.inference import forward_window
from fot_jax.model.config import ModelConfig

CONTEXTS = (1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24)
PAPER = 0.92  # FoT paper: above 92% with 16M tokens in memory


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def scored_positions(cfg: ModelConfig, task: DictionaryTask) -> np.ndarray:
  """Positions of the query block whose retrieval can change a scored prediction. With the memory
  layer last, an output depends on memory only through its own position's queries, so only the
  positions predicting a value token (token t is predicted at t - 1) need to retrieve; otherwise
  every position does."""
  if cfg.mem_layers[0] != cfg.num_layers - 1:
    return np.arange(task.queries_len)
  doc = task.document(np.random.default_rng(0))
  return np.flatnonzero(doc["value_mask"][task.defs_len:][1:])


def evaluate_streamed(cfg: ModelConfig, params, evalset: dictionary.DictionaryEvalSet, window: int,
                      contexts: Sequence[int], topk: int = 32, batch: int = 16, chunk: int = 8192,
                      stream_tokens: int = 1 << 18, recall_queries: int = 64,
                      log: Optional[Callable[[str], None]] = None, name: str = "") -> Dict[str, List]:
  """Accuracy against memory size with the memory streamed through exact host retrieval. Returns
  lists per context: memory_tokens, accuracy, seconds (from the start of the stream: what a run
  stopping at that context costs), recall (on the sample), peak_rss_gib (of the process so far)."""
  task = evalset.task
  log = log or functools.partial(print, flush=True)
  if len(cfg.mem_layers) != 1:
    raise NotImplementedError("the streamed dictionary evaluation needs exactly one memory layer")
  layer = cfg.mem_layers[0]
  contexts = sorted(int(c) for c in contexts)
  if window % task.defs_len or task.queries_len > window:
    raise ValueError(f"streamed dictionary: the window ({window}) must hold whole definition blocks "
                     f"({task.defs_len} tokens) and the query block ({task.queries_len} tokens)")
  for c in contexts:
    if c <= 0 or c % window or c > len(evalset.pool):
      raise ValueError(f"memory_tokens: {c} must be a multiple of the window {window} and at most the "
                       f"distractor pool ({len(evalset.pool)})")
  n = len(evalset.docs)
  queries = np.stack([d["tokens"][task.defs_len:] for d in evalset.docs])
  pos = scored_positions(cfg, task)
  q = np.concatenate([np.asarray(host_index.memory_queries(params, jnp.asarray(queries[s:s + batch]), cfg, layer))
                      for s in range(0, n, batch)])[:, pos]
  stream = host_index.StreamedTopK(q, topk + window, recall_queries)
  log(f"[{name}] streamed dictionary: {n} documents ({n * task.n_queries} questions), {len(pos)} query "
      f"positions x {cfg.kv_heads} kv heads per document retrieve, exact top-{topk}")
  results = {"memory_tokens": [], "accuracy": [], "seconds": [], "recall": [], "peak_rss_gib": []}
  t0 = last_log = time.time()
  for context in contexts:
    while stream.size < context:
      part = evalset.pool[stream.size:min(context, stream.size + stream_tokens)]
      for k, v in dictionary.window_kv(cfg, params, part, window, layer, chunk, stream_tokens // window):
        stream.add(k, v)
      if time.time() - last_log > 30:
        last_log = time.time()
        rate = stream.size / (last_log - t0)
        log(f"[{name}] streamed {stream.size:,} of {contexts[-1]:,} tokens ({rate:,.0f} tokens/s, ETA "
            f"{(contexts[-1] - stream.size) / rate:.0f}s), peak RSS {peak_rss_gib():.2f} GiB")
    own_w = (evalset.depths(context) * task.defs_len) // window
    exclude = [(w * window, (w + 1) * window) for w in own_w]
    hits = []
    for s in range(0, n, batch):
      rows = list(range(s, min(n, s + batch)))
      own = dictionary.own_window_block(cfg, params, evalset, rows, own_w[rows], context, window, layer, chunk)
      cand = stream.candidates(topk, [exclude[i] for i in rows], rows)
      logits, _ = forward_window(params, jnp.asarray(queries[rows]), jnp.ones(queries[rows].shape, bool),
                                 {layer: [cand, own]}, cfg, "topk", topk, chunk)
      hits.append(dictionary._query_accuracy(task, np.asarray(logits), [evalset.docs[i] for i in rows]))
    acc, rec, dt, rss = float(np.concatenate(hits).mean()), stream.recall(topk, exclude), time.time() - t0, peak_rss_gib()
    for key, val in (("memory_tokens", context), ("accuracy", acc), ("seconds", dt), ("recall", rec),
                     ("peak_rss_gib", rss)):
      results[key].append(val)
    log(f"[{name}] dictionary (streamed flat): {context:>10,} tokens in memory: accuracy {acc:.3f}, "
        f"recall@{topk} {rec:.3f} ({dt:.0f}s so far, peak RSS {rss:.2f} GiB)")
  return results


def plot(path: str, demo: dict, far: dict) -> None:
  """The demo's accuracy curve (results.json) extended by the streamed points."""
  plt = plots.pyplot()
  if plt is None:
    return
  fig, ax = plt.subplots(figsize=(7, 4.2))
  n = len(demo["seeds"]["seeds"])
  questions = demo["config"]["eval"]["n_docs"] * demo["config"]["task"]["n_queries"]
  plots.plot_dictionary_accuracy(ax, demo, f"FoT, demo evaluation ({questions} questions"
                     + (f", mean of {n} seeds)" if n > 1 else ")"), None, ", demo evaluation")
  ax.plot(far["memory_tokens"], far["accuracy"], marker="D", color="C2",
          label=f"FoT, streamed exact retrieval ({far['questions']} questions, keys split)")
  ax.axhline(PAPER, color="k", linestyle="--", linewidth=1, label="FoT paper: above 0.92 at 16M tokens")
  ax.set_title(f"Dictionary lookup up to {far['memory_tokens'][-1]:,} tokens of memory (top-k {far['topk']})")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default="runs/demo", help="the demo's workdir (`make demo`)")
  p.add_argument("--arm", default="fot", help="the trained arm under workdir to evaluate")
  p.add_argument("--memory_tokens", default=",".join(map(str, CONTEXTS)))
  p.add_argument("--n_docs", type=int, default=128, help="target documents (16 questions each)")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--stream_tokens", type=int, default=1 << 18, help="memory tokens per chunk")
  p.add_argument("--recall_queries", type=int, default=64, help="sampled queries checked against NumPy")
  p.add_argument("--seed", type=int, default=1234)
  args = p.parse_args(argv)
  results_path = os.path.join(args.workdir, "results.json")
  if not os.path.isfile(results_path):
    raise SystemExit(f"{results_path}: not found; train the demo first (`make demo`)")
  demo = jsonio.read_json(results_path)
  ck = checkpoint.load(os.path.join(args.workdir, args.arm))
  task = DictionaryTask(**demo["config"]["task"])
  topk, contexts = int(demo["config"]["eval"]["topk"]), [int(c) for c in args.memory_tokens.split(",")]
  # More targets than the demo's 16 would use up the 256 keys, leaving distractors only the few
  # keys no target has: targets take the first half of the keys, distractors the second.
  evalset = dictionary.DictionaryEvalSet(task, args.n_docs, max(contexts), args.seed, split_keys=True)
  t0 = time.time()
  far = evaluate_streamed(ck.cfg, ck.params, evalset, ck.window, contexts, topk, args.batch,
                          stream_tokens=args.stream_tokens, recall_queries=args.recall_queries, name=args.arm)
  # The demo's own evaluation set at its largest context through this path: it ties the two curves
  # (and must give results.json's number).
  de = demo["config"]["eval"]
  at = max(de["memory_tokens"])
  demo_set = dictionary.DictionaryEvalSet(task, de["n_docs"], at, de["seed"])
  anchor = evaluate_streamed(ck.cfg, ck.params, demo_set, ck.window, [at], topk, args.batch,
                             stream_tokens=args.stream_tokens, name=f"{args.arm}, the demo's set")
  far["demo_set"] = {"memory_tokens": at, "questions": de["n_docs"] * task.n_queries,
                     "accuracy": anchor["accuracy"][0],
                     "results_json": demo[args.arm]["accuracy"][demo[args.arm]["memory_tokens"].index(at)]}
  far.update(index=f"flat: exact (faiss inner-product search per {args.stream_tokens:,}-token chunk, "
                   f"running top-(k + window)); recall on {args.recall_queries} sampled queries against NumPy",
             questions=args.n_docs * task.n_queries, n_docs=args.n_docs, topk=topk, window=ck.window,
             split_keys=True, wall_seconds=time.time() - t0,
             demo_baseline={k: demo["baseline"][k] for k in ("memory_tokens", "accuracy")} if "baseline" in demo else None)
  jsonio.write_json(os.path.join(args.workdir, "far_end.json"), far)
  plot(os.path.join(args.workdir, "far_end.png"), demo, far)
  print(f"{'memory tokens':>14} | accuracy | recall | seconds | peak RSS GiB")
  for row in zip(far["memory_tokens"], far["accuracy"], far["recall"], far["seconds"], far["peak_rss_gib"]):
    print(f"{row[0]:>14,} | {row[1]:>8.3f} | {row[2]:>6.3f} | {row[3]:>7.0f} | {row[4]:>12.2f}")
  d = far["demo_set"]
  print(f"the demo's own set ({d['questions']} questions) at {d['memory_tokens']:,} tokens: {d['accuracy']:.3f} "
        f"here, {d['results_json']:.3f} in results.json")
  if far["demo_baseline"]:
    b = far["demo_baseline"]
    print("baseline (results.json, not re-run): " + ", ".join(
        f"{a:.3f} at {m:,}" for m, a in zip(b["memory_tokens"], b["accuracy"])))
  print(f"results in {os.path.join(args.workdir, 'far_end.json')} and far_end.png")


if __name__ == "__main__":
  main()
