"""What the memory layers read at an answer: why a long prompt's answer is missed.

For a prompt whose answer occurs verbatim earlier in it (a passkey, a needle), every window but the
last goes into host memory (fot_jax/host_memory.py, as `--eval.mode=host` reads it), then the last
window (question and answer, end-aligned as the suites place them) is read again and again:

* per memory layer and answer token, the *target* entries: the memory entries holding that token in
  the answer's occurrences in the prompt (the entries a copy should read). Over the layer's query
  heads, the best exact rank of a target among all memory entries (0: the top score) and the largest
  share of the top-k softmax (memory entries only) that lands on targets, with the tokens of that
  head's top entries;
* the teacher-forced answer (argmax at each answer position, as the passkey suite scores) when the
  last window reads top-k of memory for each k of `ks`, memory itself fixed: it was written with
  the inference's own top-k, so only the reading at the question changes;
* the answer with one memory layer's read left out at the question's window (that layer attends to
  its local window only), with every one's left out (the window alone), and with one layer's read
  kept alone ("only L": the others see their local window);
* the first answer token's share of each memory layer's whole softmax (local window and top-k of
  memory), each head's share on memory and how much of its top-k is its windows' first tokens
  (where each window's attention sinks are), and for a wrong first token the memory entries that
  hold the token written instead, read as the targets are (a copy from memory, or not).
`--write_local` writes memory without memory reads, to tell the writing's part of a miss from the
reading's.

So a miss is told apart: the target ranked low (the keys: a training matter), ranked high but
sharing the softmax with look-alikes (more k hurts, less helps), or read and still not copied.

  python -m fot_jax.eval.readout --checkpoint runs/smollm2_retrieval/fot --length 65536 \\
      --depths 0.1,0.35,0.6,0.85 --window 512 --ks 1,4,8,16,32,64,128 --out W/readout.json

The prompts are the passkey suite's (`--eval.seed`'s default 0: the same keys as
`python -m fot_jax.evaluate --suite=passkey` with those lengths and depths, one trial each).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, List, Sequence

import numpy as np

from fot_jax.cli import expected_errors, parse_mem_layers
from fot_jax.convert.api import from_pretrained
from fot_jax.eval import passkey, retrieval
from fot_jax.host_memory import HostMemoryInference
from fot_jax.inference import end_aligned

PROG = "fot_jax.eval.readout"
# a window's first tokens: where each window's attention sinks are (StreamingLLM keeps 4), in memory too
WINDOW_START = 4


def occurrences(ids: np.ndarray, answer: np.ndarray, before: int) -> List[int]:
  """Start indices s (s + len(answer) <= before) where ids[s:s + len(answer)] == answer."""
  n = len(answer)
  return [s for s in range(0, before - n + 1) if np.array_equal(ids[s:s + n], answer)]


def _targets_read(store, q, targets: np.ndarray, topk: int, ks: Sequence[int] = (), local=None,
                  at_start=None) -> Dict:
  """One layer, one answer position: q [KV, G, D] (scaled queries) against the row's memory ->
  the best rank of a target over query heads, the largest top-k softmax share on targets, its
  head and that head's top entries (indices); `mass_by_k`: the largest share at each k of ks.
  With `local` ([KV, G, S]: the query's scores of its visible local keys) the attention's whole
  softmax too (local window and the top-k of memory, as the layer reads them): `whole`, the largest
  share of it on targets over heads (`whole_head`), and `memory_shares`, each head's share on memory.
  at_start ([N] bool: entries among their window's first tokens, where a window's attention sinks
  are): `starts`, each head's share of its top-k entries that are such."""
  keys = store.keys[:store.size]  # [N, KV, D]
  kv, g, _ = q.shape
  best = {"rank": None, "mass": -1.0, "head": None, "top": [], "mass_by_k": {str(k): 0.0 for k in ks}}
  if local is not None:
    best.update(whole=-1.0, whole_head=None, memory_shares=[])
  if at_start is not None:
    best["starts"] = []
  widest = min(max([topk, *ks]), store.size)
  for h in range(kv):
    scores = keys[:, h] @ q[h].T  # [N, G]
    for j in range(g):
      s = scores[:, j]
      rank = int((s > s[targets].max()).sum())
      top = np.argpartition(-s, widest - 1)[:widest]
      top = top[np.argsort(-s[top])]
      p = np.exp(s[top] - s[top[0]])
      hit = np.isin(top, targets)
      share = lambda k: float(p[:k][hit[:k]].sum() / p[:k].sum())
      if best["rank"] is None or rank < best["rank"]:
        best["rank"] = rank
      if share(topk) > best["mass"]:
        best.update(mass=share(topk), head=h * g + j, top=top[:min(5, topk)].tolist())
      for k in ks:
        best["mass_by_k"][str(k)] = max(best["mass_by_k"][str(k)], share(k))
      if local is not None:  # the whole softmax, local window and the top-k of memory
        m = max(s[top[0]], local[h, j].max())
        on_memory = np.exp(s[top[:topk]] - m)
        total = float(on_memory.sum() + np.exp(local[h, j] - m).sum())
        whole = float(on_memory[hit[:topk]].sum()) / total
        best["memory_shares"].append(float(on_memory.sum()) / total)
        if whole > best["whole"]:
          best.update(whole=whole, whole_head=h * g + j)
      if at_start is not None:
        best["starts"].append(float(at_start[top[:topk]].mean()))
  return best


def _answered(vocab, logits: np.ndarray, answer: np.ndarray) -> Dict:
  """logits [A, V] at the answer's positions (teacher-forced) -> the argmax answer, right or not, and
  each answer token's margin: its logit minus the best other token's (negative: another token is
  written there); `first_margin` the first token's (for SmolLM2 the bare " " before a number's digits)."""
  pred = np.argmax(logits, -1)
  margins = []
  for row, want in zip(np.array(logits, np.float32), answer):
    target = float(row[want])
    row[want] = -np.inf
    margins.append(target - float(row.max()))
  return {"answer": vocab.decode([int(x) for x in pred]), "correct": bool(np.array_equal(pred, answer)),
          "first_margin": margins[0], "margins": margins}


def read_out(inference: HostMemoryInference, vocab, ids: np.ndarray, answer_start: int,
             ks: Sequence[int], write_local: bool = False) -> Dict:
  """ids: bos + prompt + answer (retrieval.encode), the answer from answer_start -> the readout
  (module docstring) as a dict. write_local: memory written without memory reads (each earlier
  window's keys and values from its local window alone), the question's window reading it as
  always: a length effect that stays is the reading's, one that goes was the writing's."""
  ids = np.asarray(ids, np.int32)
  answer = ids[answer_start:]
  occ = occurrences(ids, answer, answer_start)
  if not occ:
    raise ValueError("readout: the answer's tokens do not occur in the prompt (nothing to read back)")
  w = inference.window
  placed, mask, pads = end_aligned([ids], w, w)
  if placed.shape[1] <= w:
    raise ValueError(f"readout: the prompt fits one window of {w} tokens: memory holds nothing")
  pad, col0 = int(pads[0]), placed.shape[1] - w
  occ = [s for s in occ if s + len(answer) <= col0 - pad]  # those in memory (entry e holds ids[e])
  if not occ:
    raise ValueError("readout: the answer occurs only in the question's own window, not in memory")
  memory = inference.new_memory(1)
  t0 = time.perf_counter()
  memory.quiet_layers = frozenset(memory.stores[0]) if write_local else frozenset()
  inference.process(placed[:, :col0], memory, mask[:, :col0], want_logits=False)
  memory.quiet_layers = frozenset()  # the question's window reads memory as always
  build_s = time.perf_counter() - t0
  last, last_mask = placed[:, col0:], mask[:, col0:]
  # the columns (in the last window) whose logits predict each answer token
  cols = np.arange(answer_start, len(ids)) + pad - col0 - 1
  own = inference.topk
  memory.seen_queries = {}
  # the queries and the local keys (every layer's cache) at the inference's own k
  own_logits, _, cache = inference._window(last, last_mask, memory, want_logits=True, want_cache=True)
  seen, memory.seen_queries = memory.seen_queries, None
  live = np.asarray(last_mask[0], bool)
  entry = np.arange(col0 - pad)  # entry e holds ids[e], at column e + pad of the placed prompt
  at_start = ((entry + pad) % w < WINDOW_START) | (entry < WINDOW_START)  # the first window: after its padding

  def read(layer, c, targets):
    q = seen[layer][0, c]  # [KV, G, D]
    local_keys = np.asarray(cache[layer][0][0], np.float32)[:c + 1][live[:c + 1]]  # rotated, as scored
    r = _targets_read(memory.stores[0][layer], q, np.asarray(targets), own, ks,
                      local=np.einsum("kgd,skd->kgs", q, local_keys), at_start=at_start)
    r["top_tokens"] = [vocab.decode([int(ids[e])]) for e in r.pop("top")]
    return r

  layers = {}
  for layer in sorted(seen):
    per_token = []
    for j, c in enumerate(cols):
      r = read(layer, c, [s + j for s in occ])
      r["token"] = vocab.decode([int(answer[j])])
      per_token.append(r)
    layers[str(layer)] = per_token
  # a first token written in the answer's place: the memory entries that hold it, read as the targets are
  written = int(np.argmax(np.asarray(own_logits)[0, cols[0]]))
  rival = None
  if written != int(answer[0]):
    held = np.flatnonzero(ids[:col0 - pad] == written)
    rival = {"token": vocab.decode([written]), "entries": int(len(held)),
             "layers": {str(layer): read(layer, cols[0], held) for layer in sorted(seen)} if len(held) else {}}
  by_k = {}
  for k in ks:  # the own k's read is the one above
    logits = own_logits if k == own else inference._window(last, last_mask, memory, want_logits=True, topk=int(k))[0]
    by_k[str(k)] = _answered(vocab, np.asarray(logits)[0, cols], answer)
  # the answer with one memory layer's read (or every one's) left out at the question's window, and
  # with one layer's read kept alone ("only L": which layer's read writes the answer)
  off, mem = {}, sorted(seen)
  silenced = ([(str(layer), {layer}) for layer in mem] + [("all", set(mem))]
              + [(f"only {layer}", set(mem) - {layer}) for layer in mem])
  for name, quiet in silenced:
    memory.quiet_layers = frozenset(quiet)
    logits, _ = inference._window(last, last_mask, memory, want_logits=True)
    off[name] = _answered(vocab, np.asarray(logits)[0, cols], answer)
  memory.quiet_layers = frozenset()
  return {"tokens": int(len(ids)), "memory_entries": int(memory.size), "occurrences": [int(s) for s in occ],
          "expected": vocab.decode([int(x) for x in answer]), "topk": own, "layers": layers, "by_k": by_k,
          "layer_off": off, "rival": rival, "recall": memory.recall, "build_s": build_s, "write_local": write_local,
          "window": w, "index": inference.kind}


def summary_lines(name: str, r: Dict) -> List[str]:
  """A readable digest of one readout: per layer, the first answer token's target rank and mass (of
  the top-k over memory and of the whole softmax, local window included), each head's share on memory;
  the token written instead and where memory holds it; the answer at each k."""
  out = [f"{name}: {r['tokens']:,} tokens, expected {r['expected']!r}, memory {r['memory_entries']:,} entries "
         f"(window {r['window']}, written reading top-{r['topk']} of a {r['index']} index"
         f"{', then read: --write_local' if r['write_local'] else ''})"]
  for layer, toks in r["layers"].items():
    first = toks[0]
    ranks = " ".join(str(t["rank"]) for t in toks)
    out.append(f"  layer {layer}: first token {first['token']!r}: rank {first['rank']}, top-{r['topk']} mass "
               f"{first['mass']:.2f} (head {first['head']}; top {first['top_tokens']}); ranks by token: {ranks}; "
               f"of the whole softmax {first['whole']:.2f} (head {first['whole_head']}); memory's share by head "
               + " ".join(f"{m:.2f}" for m in first["memory_shares"])
               + f"; top-{r['topk']} at window starts by head " + " ".join(f"{m:.2f}" for m in first["starts"]))
  if r.get("rival"):
    rv = r["rival"]
    out.append(f"  written instead: {rv['token']!r}, memory entries holding it: {rv['entries']}; " + "; ".join(
        f"layer {layer} rank {x['rank']}, top-{r['topk']} mass {x['mass']:.2f}, whole {x['whole']:.2f} "
        f"(head {x['whole_head']})" for layer, x in rv["layers"].items()))
  share = {k: max(t[0]["mass_by_k"][k] for t in r["layers"].values()) for k in r["by_k"]}
  out.append("  first token's largest target share by k: " + ", ".join(f"{k}: {v:.2f}" for k, v in share.items()))
  for what, key in (("answer by k (first token's margin)", "by_k"),
                    ("answer with a layer's memory left out", "layer_off")):
    out.append(f"  {what}: " + ", ".join(f"{k}: {v['answer']!r}{'' if v['correct'] else ' x'} ({v['first_margin']:+.2f})"
                                         for k, v in r[key].items()))
  k = str(r["topk"]) if str(r["topk"]) in r["by_k"] else next(iter(r["by_k"]))
  out.append(f"  margins by answer token at k = {k}: " + " ".join(f"{t['token']!r} {m:+.2f}" for t, m in zip(
      next(iter(r["layers"].values())), r["by_k"][k]["margins"])))
  return out


def _numbers(flag: str, text: str, kind) -> List:
  try:
    return [kind(x) for x in text.split(",")]
  except ValueError:
    raise ValueError(f"{flag}: comma-separated {kind.__name__}s expected, got {text!r}") from None


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--length", type=int, required=True, help="prompt length in tokens (the passkey suite's)")
  ap.add_argument("--depths", default="0.5", help="comma-separated key depths in [0, 1] (one prompt each)")
  ap.add_argument("--window", type=int, default=512)
  ap.add_argument("--topk", type=int, default=32, help="the top-k memory is written with")
  ap.add_argument("--ks", default="1,4,8,16,32,64,128", help="top-k values the question's window is read with")
  ap.add_argument("--index", default="ivf", choices=("flat", "ivf"))
  ap.add_argument("--nprobe", type=int, default=8)
  ap.add_argument("--mem_layers", default=None, help="memory layers over the checkpoint's: comma-separated 0-based, "
                  "'all' or 'none' "
                  "(e.g. an import's; memory keys then at position 0, as LongLLaMA's)")
  ap.add_argument("--vocab", default="", help="vocabulary spec (default: the checkpoint's own, as the suites read it)")
  ap.add_argument("--seed", type=int, default=0, help="the passkey suite's seed (--eval.seed)")
  ap.add_argument("--write_local", action="store_true", help="memory written without memory reads (each window's "
                  "keys and values from its local window alone); the question's window reads it as always")
  ap.add_argument("--out", default=None, help="JSON file for the readouts")
  a = ap.parse_args(argv)
  with expected_errors(PROG):  # a bad value, a missing checkpoint, a prompt memory cannot hold: one line
    depths, ks = _numbers("--depths", a.depths, float), _numbers("--ks", a.ks, int)
    if not all(0 <= d <= 1 for d in depths):
      raise ValueError(f"--depths: each depth lies in [0, 1], got {a.depths!r}")
    if min(ks) < 1:
      raise ValueError(f"--ks: each k is at least 1, got {a.ks!r}")
    if a.length < 1 or a.window < 1 or a.topk < 1:
      raise ValueError(f"--length, --window and --topk are positive, got {a.length}, {a.window}, {a.topk}")
    overrides = {}
    if a.mem_layers:
      overrides = {"mem_layers": parse_mem_layers(a.mem_layers), "mem_positions": "first"}
    model = from_pretrained(a.checkpoint, **overrides)
    if not model.cfg.mem_layers:
      raise ValueError(f"{a.checkpoint} has no memory layers: add them with --mem_layers (comma-separated, "
                       f"e.g. 6,17,18,20 for SmolLM2-135M's copy-head layers)")
    vocab = model.vocabulary(a.vocab)
    inference = HostMemoryInference(model.cfg, model.params, a.window, a.topk, a.index, a.nprobe)
    make_prompt = passkey.make_prompt_fn(vocab)
    results = []
    for di, depth in enumerate(depths):
      prompt, ans = make_prompt(a.length, depth, retrieval.cell_rng(a.seed, a.length, di))  # the suite's prompts
      ids, start = retrieval.encode(vocab, prompt, ans)
      r = dict(read_out(inference, vocab, ids, start, ks, a.write_local), depth=depth, length=a.length)
      results.append(r)
      print("\n".join(summary_lines(f"passkey {a.length:,} depth {depth}", r)), flush=True)
      if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
          json.dump({"checkpoint": a.checkpoint, "window": a.window, "index": a.index, "readouts": results}, f, indent=1)


if __name__ == "__main__":
  main()
