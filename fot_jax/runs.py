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
from fot_jax.eval import dictionary
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
    out = _train_arm(cfg, config, name, schedule, batches, os.path.join(workdir, name), train)
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


def _train_arm(cfg, config, name, schedule, batches, workdir, do_train):
  tc = _arm_train_cfg(config, name)
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
