"""The LM experiment (`experiment = "lm"`): FoT trained with its crossbatch curriculum (and, if
baseline.enabled, the same model without crossbatch) on doc-pinned slot batches of SeqIO tasks,
then perplexity against memory size. Its data is TensorFlow's (SeqIO), so this module imports
TensorFlow; the dictionary-lookup runner does not."""
from __future__ import annotations

import dataclasses
import os
import time

import jax

from fot_jax import provenance
from fot_jax.configs import Experiment
from fot_jax.results import save_and_tabulate
from fot_jax.inference import MemoryInference
from fot_jax.plots import plot_curves
from fot_jax.runners import common, lm_data


def run(exp: Experiment, workdir: str, train: bool = True) -> dict:
  """Trains FoT with the crossbatch curriculum and, if baseline.enabled, the same model without
  crossbatch, on doc-pinned slot batches; evaluates perplexity against memory size; writes results."""
  t_start = time.time()
  lm, cfg, seed = exp.lm, exp.model, exp.train.seed
  data, ev, docs = lm.data, lm.eval, lm.held_out()
  arms = ["fot"] + (["no_crossbatch"] if lm.no_crossbatch else [])
  print(lm_data.format_corpus_views(lm), flush=True)
  results = {"config": exp.raw, "data": {}, "corpus_views": [list(v) for v in lm.views]}
  trained = {}
  for name in arms:
    # The baseline: FoT's phases as they ran (same tasks, same steps), without crossbatch.
    schedule = (exp.schedule() if name == "fot" else
                common.following_schedule(trained["fot"]["phases"], trained["fot"]["steps_run"]))
    sources = lm_data.arm_batches(lm.feeds, schedule.tasks(), data, seed, name)
    # the baseline reads no train.memory either: the local window alone
    settings = exp.train if name == "fot" else dataclasses.replace(exp.train, memory=None)
    trained[name] = common.train_arm(model=cfg, settings=settings, name=name, schedule=schedule,
                                     batches=lm_data.train_input(sources), workdir=os.path.join(workdir, name),
                                     do_train=train, vocab=data.vocab, window=data.window,
                                     run_fields=lm.run_fields)
    report = {str(task or data.task): {"pipeline": b.report(), "bad_input": b.bad_input().report()}
              for task, b in sources.items() if hasattr(b, "report")}  # the copy warm-up is synthetic
    for task, r in report.items():
      print(f"[{name}] data {task}: {r['pipeline']}; bad input: {r['bad_input']}", flush=True)
    results["data"][name] = report
  print(f"evaluating on {len(docs)} held-out documents of {data.eval_task!r}", flush=True)
  for name in arms:
    out = trained[name]
    res = common.perplexity_of(MemoryInference(cfg, out["params"], data.window, ev.mode, ev.topk), docs, ev, name)
    res.update(train_seconds=out["seconds"], n_docs=len(docs), phases=out["phases"],
               final_train_loss=out["final_loss"])
    results[name] = res
  results["wall_seconds"] = time.time() - t_start
  results["provenance"] = provenance.provenance()
  if jax.process_index() == 0:
    task = data.eval_task
    save_and_tabulate(results, workdir, arms, "perplexity", f"Perplexity on held-out {task!r} documents (single_doc)")
    mems = results["fot"]["memory_tokens"]
    xs = [max(m, 1) for m in mems]  # 0 memory tokens plotted at 1 on the log axis
    plot_curves(os.path.join(workdir, "perplexity_vs_memory.png"), {a: (xs, results[a]["perplexity"]) for a in arms},
                "memory tokens before the scored span (0 = local window only)", "perplexity (per token)",
                f"Perplexity against memory size ({task})", xticks=(xs, [f"{m:,}" for m in mems]))
  return results
