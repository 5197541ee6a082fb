"""The LM experiment behind `fot_jax.main` (`experiment = "lm"`): FoT trained with its crossbatch
curriculum (and, if baseline.enabled, the same model without crossbatch) on doc-pinned slot batches
of SeqIO tasks, then perplexity against memory size. Its data is TensorFlow's (SeqIO), so this
module imports TensorFlow; the dictionary-lookup runner (fot_jax/runs.py) does not."""
from __future__ import annotations

import os
import time

import jax
import numpy as np

from data_pipelines import pipeline, vocab as vocab_lib
from data_pipelines.copy_task import CopyBatches, RepeatedWindows
from data_pipelines.retrieval_docs import RetrievalBatches
from fot_jax import configs, provenance
from fot_jax.curriculum import Schedule
from fot_jax.eval import perplexity
from fot_jax.inference import MemoryInference
from fot_jax.plots import plot_curves
from fot_jax.runs import baseline_schedule, save_and_tabulate, train_arm


def lm_run_fields(config) -> dict:
  """What defines an LM arm's training besides its model, optimiser and train config (the
  workdir's fingerprint): the data settings, the copy warm-up, and the curriculum as configured
  (the no-crossbatch arm's own is derived from how FoT's ran)."""
  fields = {"data": config.data.to_dict(), "curriculum": config.train.curriculum.to_dict()}
  if config.get("warmup") is not None:
    fields["warmup"] = config.warmup.to_dict()
  return fields


def eval_documents(config, vocab):
  """The held-out documents of the evaluation (configs.eval_documents; validate checked them)."""
  data, ids = configs.lm_data_settings(config), vocab_lib.special_ids(vocab)
  return configs.eval_documents(config, pipeline.document_tokens(data.eval_task, vocab, data.eval_split, seed=None),
                                ids["bos"], ids["eos"])


def lm_copy_warmup(config, arm: str) -> CopyBatches:
  """The batches of an LM curriculum's copy warm-up (phases whose task is `warmup.task`): FoT's
  documents split in two windows of `span` tokens, whatever the LM's own window (memory keys
  carry no position, so the circuit carries over; short windows make it form in a fraction of
  the steps: docs/data.md); the no-crossbatch arm sees each document whole in one row."""
  task = configs.lm_warmup_task(config, arm)
  return CopyBatches(task, configs.copy_warmup(config).slots, task.span if arm == "fot" else task.doc_len,
                     int(config.seed))


def lm_feed(config, task, arm: str):
  """The batches of one curriculum task of an LM run: the copy warm-up on ids, a repeat view of an
  LM task (`c.data.repeats`), or the LM task itself (None: `c.data.task`)."""
  if task is not None and task == configs.warmup_task_name(config):
    return lm_copy_warmup(config, arm)
  retrieval = configs.retrieval_view(config, task)
  if retrieval is not None:
    return retrieval_batches(config, retrieval)
  view = configs.repeat_view(config, task)
  if view is None:
    return pipeline.lm_batches_from_config(config, task=task)
  return RepeatedWindows(pipeline.lm_batches_from_config(config, task=view["task"]),
                         configs.lm_data_settings(config).windows_per_slot, view["fraction"], int(config.seed),
                         view["score_first"])


def retrieval_batches(config, spec) -> RetrievalBatches:
  """Retrieval documents in this host's slots, a `text_slots` share of them natural text."""
  d = configs.lm_data_settings(config)
  vocab = vocab_lib.get_vocabulary(d.vocab)
  slots = pipeline.host_slots(d.slots)
  n_text = int(spec.text_slots * slots)
  text = None
  if n_text:
    text = pipeline.lm_batches(spec.text_task, vocab, slots=n_text, windows=d.windows_per_slot, window=d.window,
                               seed=int(config.seed), min_doc_len=d.min_doc_len, max_doc_len=d.max_doc_len)
    text.check_nonempty()
  return RetrievalBatches(spec, vocab, slots=slots, windows=d.windows_per_slot, window=d.window,
                          seed=int(config.seed), text_batches=text)


def run_lm(config, workdir: str, train: bool = True) -> dict:
  """Trains FoT with the crossbatch curriculum and, if baseline.enabled, the same model without
  crossbatch, on doc-pinned slot batches; evaluates perplexity against memory size; writes results."""
  t_start = time.time()
  cfg, data = configs.model_config(config), configs.lm_data_settings(config)
  vocab = vocab_lib.get_vocabulary(data.vocab)
  vocab_lib.check_fits(vocab.vocab_size, cfg.vocab_size)
  arms = ["fot"] + (["no_crossbatch"] if config.baseline.enabled else [])
  views = configs.corpus_views(config)
  print(configs.format_corpus_views(config, views), flush=True)
  results = {"config": config.to_dict(), "data": {}, "corpus_views": [list(v) for v in views]}
  trained = {}
  for name in arms:
    # The baseline: FoT's phases as they ran (same tasks, same steps), without crossbatch.
    schedule = (Schedule(config.train.curriculum) if name == "fot" else
                baseline_schedule(trained["fot"]["phases"], trained["fot"]["steps_run"]))
    try:  # one source per data task of the curriculum (a curriculum over tasks has several)
      feeds = {task: lm_feed(config, task, name) for task in set(schedule.tasks())}
    except ValueError as e:  # missing data, empty source, bad vocabulary: one line (fot_jax.cli), no traceback
      raise ValueError(f"data error: {e}") from e
    trained[name] = train_arm(cfg, configs.train_settings(config), name, schedule,
                               feeds[None] if list(feeds) == [None] else feeds, os.path.join(workdir, name), train,
                               data.vocab, data.window, lm_run_fields(config))
    report = {str(task or data.task): {"pipeline": b.report(), "bad_input": b.bad_input().report()}
              for task, b in feeds.items() if hasattr(b, "report")}  # the copy warm-up is synthetic
    for task, r in report.items():
      print(f"[{name}] data {task}: {r['pipeline']}; bad input: {r['bad_input']}", flush=True)
    results["data"][name] = report
  ev = configs.lm_eval_settings(config)
  docs = eval_documents(config, vocab)
  print(f"evaluating on {len(docs)} held-out documents of {data.eval_task!r}", flush=True)
  for name in arms:
    inference = MemoryInference(cfg, trained[name]["params"], data.window, ev.mode, ev.topk)
    res = perplexity.perplexity_vs_memory(inference, docs, ev.memory_tokens, ev.score_tokens, ev.batch,
                                          ev.doc_mode, name=name)
    hist = trained[name]["history"]
    res.update(train_seconds=trained[name]["seconds"], n_docs=len(docs), phases=trained[name]["phases"],
               final_train_loss=float(np.mean([h["loss"] for h in hist[-10:]])) if hist else None)
    results[name] = res
  results["wall_seconds"] = time.time() - t_start
  results["provenance"] = provenance.provenance()
  if jax.process_index() == 0:
    _write_lm_results(results, workdir, list(arms), data.eval_task)
  return results


def _write_lm_results(results, workdir, arms, task):
  save_and_tabulate(results, workdir, arms, "perplexity", f"Perplexity on held-out {task!r} documents (single_doc)")
  mems = results[arms[0]]["memory_tokens"]
  xs = [max(m, 1) for m in mems]  # 0 memory tokens plotted at 1 on the log axis
  plot_curves(os.path.join(workdir, "perplexity_vs_memory.png"), {a: (xs, results[a]["perplexity"]) for a in arms},
        "memory tokens before the scored span (0 = local window only)", "perplexity (per token)",
        f"Perplexity against memory size ({task})", xticks=(xs, [f"{m:,}" for m in mems]))
