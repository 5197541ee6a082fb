"""Experiment runners behind fot_jax.main."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from data_pipelines.dictionary_lookup import DictionaryBatches
from fot_jax import configs
from fot_jax.curriculum import Schedule
from fot_jax.eval import dictionary, perplexity
from fot_jax.inference import MemoryInference
from fot_jax.train import train


def _arm_train_cfg(config, arm):
  a = config[arm]
  return {"steps": a.steps, "seed": config.seed, "loss_on": a.get("loss_on", "all"),
          "accum_steps": a.get("accum_steps", 1), "log_every": a.log_every,
          "checkpoint_every": a.checkpoint_every, "optim": config.optim.to_dict(),
          "mesh": config.get("mesh"), "crossbatch_scope": a.get("crossbatch_scope", "batch")}


def run_dictionary_lookup(config, workdir: str, train: bool = True) -> dict:
  """Trains FoT and the baseline, evaluates both against memory size, writes results."""
  t_start = time.time()
  cfg = configs.model_config(config)
  task = configs.dictionary_task(config)
  arms = {"fot": (config.fot, Schedule(config.fot.curriculum))}
  if config.baseline.enabled:
    arms["baseline"] = (config.baseline, Schedule({"kind": "constant", "spec": {}}))
  trained = {}
  for name, (arm, schedule) in arms.items():
    batches = DictionaryBatches(task, arm.slots, arm.window, config.seed)
    out = _train_arm(cfg, _arm_train_cfg(config, name), name, schedule, batches, os.path.join(workdir, name),
                     train, "dictionary_lookup")
    trained[name] = out
  evalset = dictionary.DictionaryEvalSet(task, config.eval.n_docs, max(config.eval.memory_tokens),
                                         config.eval.seed)
  results = {"config": {"model": cfg.__dict__, "task": task.__dict__, "eval": config.eval.to_dict()}}
  for name, (arm, _) in arms.items():
    res = dictionary.evaluate(cfg, trained[name]["params"], evalset, arm.window, config.eval.memory_tokens,
                              config.eval.mode, config.eval.topk, config.eval.batch, config.eval.chunk,
                              name=name)
    res["train_seconds"] = trained[name]["seconds"]
    res["window"] = arm.window
    res["final_train_accuracy"] = trained[name]["final_accuracy"]
    if name == "fot":
      res["curriculum_switched_at"] = arms["fot"][1].switched_at
    results[name] = res
  results["wall_seconds"] = time.time() - t_start
  if jax.process_index() == 0:
    _write_results(results, workdir, list(arms))
  return results


def _train_arm(cfg, tc, name, schedule, batches, workdir, do_train, vocab):
  if not do_train:
    ckpt = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt) or not os.listdir(ckpt):
      raise SystemExit(f"--mode=evaluate: no checkpoint for '{name}' under {ckpt}; "
                       f"train first (--mode=train) or point --workdir at a trained run")
    tc = dict(tc, steps=0)
  vocab = os.path.abspath(vocab) if os.path.isfile(vocab) else vocab  # evaluation finds it from anywhere
  out = train(cfg, tc, schedule, batches, workdir, name=name, model_meta={"vocab": vocab})
  hist = out["history"]
  out["final_accuracy"] = float(np.mean([h["accuracy"] for h in hist[-5:]])) if hist else None
  return out


def _write_results(results, workdir, arms):
  _save_and_tabulate(results, workdir, arms, "accuracy", "Dictionary lookup accuracy (all value tokens right)")
  _plot(os.path.join(workdir, "dictionary_lookup.png"),
        {f"{a} (window {results[a]['window']})": (results[a]["memory_tokens"], results[a]["accuracy"])
         for a in arms},
        "context tokens (memory + local)", "accuracy (all value tokens)", "Dictionary lookup with memory",
        ylim=(-0.02, 1.02))


def _save_and_tabulate(results, workdir, arms, metric, title):
  """results.json, and a table of `metric` against memory tokens per arm on stdout."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  width = max(9, *(len(a) for a in arms))
  header = f"{'memory tokens':>14} | " + " | ".join(f"{a:>{width}}" for a in arms)
  lines = [header, "-" * len(header)]
  for i, m in enumerate(results[arms[0]]["memory_tokens"]):
    lines.append(f"{m:>14,} | " + " | ".join(f"{results[a][metric][i]:>{width}.3f}" for a in arms))
  print(f"\n{title}:\n" + "\n".join(lines))
  print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.join(workdir, 'results.json')}")


def _plot(path, curves, xlabel, ylabel, title, ylim=None, xticks=None):
  """curves: {label: (xs, ys)} on a log2 x axis -> PNG at path."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot written")
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for label, (xs, ys) in curves.items():
    ax.plot(xs, ys, marker="o", label=label)
  ax.set_xscale("log", base=2)
  if xticks:
    ax.set_xticks(*xticks)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if ylim:
    ax.set_ylim(*ylim)
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)

# -- language models: train FoT (+ the same model without crossbatch), perplexity vs memory --
def _lm_train_cfg(config):
  t = config.train
  return {"steps": t.steps, "seed": config.seed, "loss_on": t.loss_on, "accum_steps": t.accum_steps,
          "log_every": t.log_every, "checkpoint_every": t.checkpoint_every, "optim": config.optim.to_dict(),
          "init_from": t.get("init_from"), "mesh": config.get("mesh"),
          "crossbatch_scope": t.get("crossbatch_scope", "batch")}


def lm_eval_docs(config, vocab, need: int):
  """Held-out documents (`bos doc eos`) of at least `need` tokens, in the task's stored order."""
  from data_pipelines import pipeline, vocab as vocab_lib
  ids = vocab_lib.special_ids(vocab)
  docs = pipeline.long_documents(config.data.eval_task, vocab, config.data.eval_split, need,
                                 int(config.eval.n_docs), wrap=(ids["bos"], ids["eos"]))
  if not docs:
    raise SystemExit(f"eval: no document of {config.data.eval_task!r} split {config.data.eval_split!r} has "
                     f"{need} tokens (max eval.memory_tokens + eval.score_tokens + 1); lower them")
  return docs


def run_lm(config, workdir: str, train: bool = True) -> dict:
  """Trains FoT with the crossbatch curriculum and, if baseline.enabled, the same model without
  crossbatch, on doc-pinned slot batches; evaluates perplexity against memory size; writes results."""
  from data_pipelines import pipeline, vocab as vocab_lib
  t_start = time.time()
  cfg = configs.model_config(config)
  vocab = vocab_lib.get_vocabulary(config.data.vocab)
  vocab_lib.check_fits(vocab.vocab_size, cfg.vocab_size)
  arms = {"fot": Schedule(config.train.curriculum)}
  if config.baseline.enabled:
    arms["no_crossbatch"] = Schedule({"kind": "constant", "spec": {}})
  results = {"config": config.to_dict(), "data": {}}
  trained = {}
  for name, schedule in arms.items():
    try:
      batches = pipeline.lm_batches_from_config(config)
    except ValueError as e:  # missing data, empty source, bad vocabulary: one line, no traceback
      raise SystemExit(f"data error: {e}") from None
    trained[name] = _train_arm(cfg, _lm_train_cfg(config), name, schedule, batches, os.path.join(workdir, name),
                               train, config.data.vocab)
    report = {"pipeline": batches.report(), "bad_input": batches.bad_input().report()}
    print(f"[{name}] data: {report['pipeline']}; bad input: {report['bad_input']}", flush=True)
    results["data"][name] = report
  ev = config.eval
  docs = lm_eval_docs(config, vocab, perplexity.needed_length(ev.memory_tokens, ev.score_tokens))
  print(f"evaluating on {len(docs)} held-out documents of {config.data.eval_task!r}", flush=True)
  for name in arms:
    inference = MemoryInference(cfg, trained[name]["params"], int(config.data.window), ev.mode, ev.topk)
    res = perplexity.perplexity_vs_memory(inference, docs, ev.memory_tokens, int(ev.score_tokens),
                                          int(ev.batch), ev.doc_mode, name=name)
    hist = trained[name]["history"]
    res.update(train_seconds=trained[name]["seconds"], n_docs=len(docs),
               final_train_loss=float(np.mean([h["loss"] for h in hist[-10:]])) if hist else None)
    results[name] = res
  results["wall_seconds"] = time.time() - t_start
  if jax.process_index() == 0:
    _write_lm_results(results, workdir, list(arms), config.data.eval_task)
  return results


def _write_lm_results(results, workdir, arms, task):
  _save_and_tabulate(results, workdir, arms, "perplexity", f"Perplexity on held-out {task!r} documents (single_doc)")
  mems = results[arms[0]]["memory_tokens"]
  xs = [max(m, 1) for m in mems]  # 0 memory tokens plotted at 1 on the log axis
  _plot(os.path.join(workdir, "perplexity_vs_memory.png"), {a: (xs, results[a]["perplexity"]) for a in arms},
        "memory tokens before the scored span (0 = local window only)", "perplexity (per token)",
        f"Perplexity against memory size ({task})", xticks=(xs, [f"{m:,}" for m in mems]))
