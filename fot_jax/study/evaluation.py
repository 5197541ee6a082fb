"""Every suite of the study for one method: perplexity against length (the same scored span with
more context before it), and the suite runners of fot_jax/eval (passkey, NIAH, r_d) on the method's
Context; an interrupted method resumes at its next suite."""
from __future__ import annotations

import math
import time
from typing import Dict, List

import numpy as np

from fot_jax.eval import perplexity, suite as suite_lib
from fot_jax.eval.effective_length import effective_length
from fot_jax.study.settings import SUITES, MethodSpec, StudySettings
from fot_jax.study.methods import method_context


def perplexity_vs_length(ctx, lengths: List[int], score_tokens: int, n_docs: int, batch: int) -> Dict:
  """The same scored span (each document's last score_tokens targets) with L - score_tokens tokens
  of context before it, for every L in lengths: the L-token input goes through the method's
  `process` from its first token (so at L = the base window, memory methods equal plain ones)."""
  top = max(lengths)
  if min(lengths) <= score_tokens:
    raise ValueError(f"study: ppl.score_tokens {score_tokens} must be below the shortest length {min(lengths)}")
  docs = ctx.docs(top + 1, n_docs)
  tails = np.stack([np.asarray(d[-(top + 1):], np.int32) for d in docs])
  out = {"lengths": [int(x) for x in lengths], "perplexity": [], "nll": [], "score_tokens": int(score_tokens),
         "n_docs": len(docs)}
  for length in lengths:
    t0 = time.time()
    nlls = []
    for s in range(0, len(tails), batch):  # plain: one window; memory: windows from the first token
      nlls.append(perplexity.one_call_nll(ctx.inference(), tails[s:s + batch, top - length:], score_tokens))
    mean = float(np.concatenate(nlls).mean())
    out["nll"].append(mean)
    out["perplexity"].append(math.exp(mean))
    print(f"[{ctx.name}] ppl: length {length:>7,}: perplexity {math.exp(mean):.3f} ({time.time() - t0:.0f}s)",
          flush=True)
  return out


def evaluate_method(base, method: MethodSpec, study: StudySettings, params=None, done=None, save=None) -> Dict:
  """All suites of the study for one method (with `params`, e.g. fine-tuned, instead of the
  base's) -> its result dict. `done`: an earlier result of the same method and settings whose
  suites are kept (only the missing ones run); `save(res)` is called after every suite, so an
  interrupted method resumes at its next suite."""
  ctx = method_context(base, method, study.pad, params)
  res = {"method": method.spec, "settings": study.settings_of(method), "seconds": {}, "suites_done": []}
  for suite in (done or {}).get("suites_done", []):
    if suite in study.suites:
      res["suites_done"].append(suite)
      if suite in done:
        res[suite], res["seconds"][suite] = done[suite], done["seconds"][suite]
  for suite in study.suites:
    if suite in res["suites_done"]:
      print(f"[{ctx.name}] {suite}: done before, kept", flush=True)
      continue
    t0 = time.time()
    if suite == "ppl":
      p = study.ppl
      r = perplexity_vs_length(ctx, list(study.lengths), p.score_tokens, p.n_docs, study.eval.batch)
      # the longest length whose perplexity stays within ppl.tolerance x that at the shortest length
      r["effective_length"] = effective_length(r["lengths"], r["perplexity"], p.tolerance * r["perplexity"][0], False)
    elif suite == "passkey":
      r = suite_lib.run_passkey(ctx)
    elif suite == "niah":
      r = suite_lib.run_niah(ctx)
    elif suite == "rd":
      r = None  # r_d measures memory attention: only for methods that read memory, all of it
      reads_all = method.memory is None or method.memory.mode == "dense"  # eval/rd.py attends to all of memory
      if method.inference == "memory" and ctx.cfg.mem_layers and reads_all:
        r = suite_lib.run_rd(ctx)
      elif method.memory:  # a retrieving method's r_d would be its dense twin's figure, not its own
        print(f"[{ctx.name}] rd: skipped (r_d is measured with dense memory; this method reads "
              f"{method.memory.mode})", flush=True)
    else:
      raise ValueError(f"study: unknown suite {suite!r}; known: {SUITES}")
    if r is not None:
      res[suite] = r
      res["seconds"][suite] = time.time() - t0
    res["suites_done"].append(suite)
    if save is not None:
      save(res)
  return res
