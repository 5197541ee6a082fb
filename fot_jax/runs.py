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
          "checkpoint_every": a.checkpoint_every, "optim": config.optim.to_dict()}


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
                     train)
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


def _train_arm(cfg, tc, name, schedule, batches, workdir, do_train):
  if not do_train:
    ckpt = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt) or not os.listdir(ckpt):
      raise SystemExit(f"--mode=evaluate: no checkpoint for '{name}' under {ckpt}; "
                       f"train first (--mode=train) or point --workdir at a trained run")
    tc = dict(tc, steps=0)
  out = train(cfg, tc, schedule, batches, workdir, name=name)
  hist = out["history"]
  out["final_accuracy"] = float(np.mean([h["accuracy"] for h in hist[-5:]])) if hist else None
  return out


def _write_results(results, workdir, arms):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  contexts = results[arms[0]]["memory_tokens"]
  header = f"{'memory tokens':>14} | " + " | ".join(f"{a:>9}" for a in arms)
  lines = [header, "-" * len(header)]
  for i, m in enumerate(contexts):
    lines.append(f"{m:>14,} | " + " | ".join(f"{results[a]['accuracy'][i]:>9.3f}" for a in arms))
  table = "\n".join(lines)
  print("\nDictionary lookup accuracy (all value tokens right):\n" + table)
  print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.join(workdir, 'results.json')}")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for a in arms:
      ax.plot(results[a]["memory_tokens"], results[a]["accuracy"], marker="o",
              label=f"{a} (window {results[a]['window']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens (memory + local)")
    ax.set_ylabel("accuracy (all value tokens)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Dictionary lookup with memory")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "dictionary_lookup.png"), dpi=120)
    plt.close(fig)
  except ImportError:
    print("matplotlib missing: no plot written")


# -- language models: train FoT (+ the same model without crossbatch), perplexity vs memory --
def _lm_train_cfg(config):
  t = config.train
  return {"steps": t.steps, "seed": config.seed, "loss_on": t.loss_on, "accum_steps": t.accum_steps,
          "log_every": t.log_every, "checkpoint_every": t.checkpoint_every, "optim": config.optim.to_dict()}


def lm_eval_docs(config, vocab, need: int):
  """Held-out documents (`bos doc eos`) of at least `need` tokens, in the task's stored order."""
  from data_pipelines import pipeline, vocab as vocab_lib
  ids = vocab_lib.special_ids(vocab)
  docs = []
  for doc in pipeline.document_tokens(config.data.eval_task, vocab, config.data.eval_split, seed=None):
    if len(doc) + 2 >= need:
      docs.append(np.concatenate([[ids["bos"]], doc, [ids["eos"]]]).astype(np.int32))
      if len(docs) == config.eval.n_docs:
        break
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
    batches = pipeline.lm_batches_from_config(config)
    trained[name] = _train_arm(cfg, _lm_train_cfg(config), name, schedule, batches, os.path.join(workdir, name),
                               train)
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
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  mems = results[arms[0]]["memory_tokens"]
  header = f"{'memory tokens':>14} | " + " | ".join(f"{a:>13}" for a in arms)
  lines = [header, "-" * len(header)]
  for i, m in enumerate(mems):
    lines.append(f"{m:>14,} | " + " | ".join(f"{results[a]['perplexity'][i]:>13.3f}" for a in arms))
  print(f"\nPerplexity on held-out {task!r} documents (single_doc):\n" + "\n".join(lines))
  print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.join(workdir, 'results.json')}")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib missing: no plot written")
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for a in arms:
    ax.plot([max(m, 1) for m in mems], results[a]["perplexity"], marker="o", label=a)
  ax.set_xscale("log", base=2)
  ax.set_xticks([max(m, 1) for m in mems], [f"{m:,}" for m in mems])
  ax.set_xlabel("memory tokens before the scored span (0 = local window only)")
  ax.set_ylabel("perplexity (per token)")
  ax.grid(alpha=0.3)
  ax.legend()
  ax.set_title(f"Perplexity against memory size ({task})")
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "perplexity_vs_memory.png"), dpi=120)
  plt.close(fig)
