"""The dictionary-lookup experiment (the demo): FoT (per seed) and its baseline, accuracy against
memory size, r_d against d. Synthetic token ids: no TensorFlow."""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from data_pipelines.copy_task import CopyBatches, CopyTask
from data_pipelines.dictionary_lookup import DictionaryBatches, DictionaryTask
from fot_jax import plots, provenance
from fot_jax.configs import Experiment
from fot_jax.eval import dictionary
from fot_jax.results import save_and_tabulate
from fot_jax.eval.rd import positive_attention_mass
from fot_jax.runners import common
from fot_jax.settings import CopyWarmupSettings


def _copy_task(warmup: CopyWarmupSettings, task: DictionaryTask, span: int, arm: str) -> CopyTask:
  """The copy warm-up over the last `warmup.num_symbols` ids of the dictionary vocabulary: all value
  symbols and the last key symbols (fewer symbols: a much earlier induction phase change), spans of
  FoT's window. The baseline's repeat comes in `warmup.baseline_chunks` shuffled pieces (no
  fixed-offset copy)."""
  n = min(warmup.num_symbols, task.num_symbols + task.num_value_symbols)
  chunks = warmup.baseline_chunks if arm == "baseline" else 1
  return CopyTask(span=span, num_symbols=n, symbol_offset=task.vocab_size - n, chunks=chunks)


def _feeds(exp: Experiment, arm: str, seed: int, schedule):
  """The batch source(s) of an arm: {task name: batch function} for a curriculum over the copy
  warm-up and the lookup, or the lookup's alone for a curriculum that names no task."""
  parts = exp.dictionary
  a, fot = parts.arms[arm], parts.arms["fot"]
  lookup = DictionaryBatches(parts.task, a.slots, a.window, seed, disjoint_keys=fot.disjoint_keys)  # the baseline sees FoT's documents
  if schedule.tasks() == [None]:
    return lookup
  feeds = {"dictionary": lookup}
  if exp.warmup.enabled:
    copy = _copy_task(exp.warmup, parts.task, fot.window, arm)
    feeds["copy"] = CopyBatches(copy, a.slots, a.window, seed)
  return feeds


def run(exp: Experiment, workdir: str, train: bool = True) -> dict:
  """Trains FoT (per seed) and the baseline, evaluates accuracy against memory size and r_d
  against d, writes results.json and dictionary_lookup.png."""
  t_start = time.time()
  cfg, parts = exp.model, exp.dictionary
  task, ev, arms, seeds = parts.task, parts.eval, parts.arms, list(parts.seeds)
  trained = {}
  for seed in seeds:
    name = "fot" if seed == seeds[0] else f"fot_seed{seed}"
    schedule = exp.schedule()
    trained[name] = common.train_arm(
        model=cfg, settings=dataclasses.replace(exp.train, seed=seed), name=name, schedule=schedule,
        batches=_feeds(exp, "fot", seed, schedule), workdir=os.path.join(workdir, name), do_train=train,
        vocab="dictionary_lookup", window=arms["fot"].window, run_fields=parts.run_fields["fot"])
  if arms["baseline"].enabled:
    steps_run = trained["fot"]["steps_run"]
    schedule = common.following_schedule(trained["fot"]["phases"], steps_run)
    trained["baseline"] = common.train_arm(
        model=cfg, settings=dataclasses.replace(parts.baseline_train, seed=seeds[0], steps=steps_run),
        name="baseline", schedule=schedule, batches=_feeds(exp, "baseline", seeds[0], schedule),
        workdir=os.path.join(workdir, "baseline"), do_train=train, vocab="dictionary_lookup",
        window=arms["baseline"].window, run_fields=parts.run_fields["baseline"])
  windows = {name: arms["baseline" if name == "baseline" else "fot"].window for name in trained}
  evalset = dictionary.DictionaryEvalSet(task, ev.n_docs, max(ev.memory_tokens), ev.seed)
  results = {"config": {"model": cfg.__dict__, "task": task.__dict__, "eval": exp.raw["eval"],
                        "fot": exp.raw["fot"], "seeds": seeds}}
  for name, out in trained.items():
    res = dictionary.evaluate(cfg, out["params"], evalset, windows[name], ev.memory_tokens, ev.mode, ev.topk,
                              ev.batch, ev.chunk, name=name)
    res.update(train_seconds=out["seconds"], train_steps=out["steps_run"], window=windows[name],
               final_train_accuracy=out["final_accuracy"], phases=out["phases"])
    results[name] = res
  results["seeds"] = _seed_summary(results, seeds)
  results["rd"] = _dictionary_rd(ev, cfg, task, trained)
  results["wall_seconds"] = time.time() - t_start
  results["provenance"] = provenance.provenance()
  if jax.process_index() == 0:
    _write_results(results, workdir, [a for a in ("fot", "baseline") if a in results])
  return results


def _seed_summary(results, seeds):
  """Accuracy against memory over the FoT seeds: mean, min and max (the paper's error bars)."""
  names = ["fot"] + [f"fot_seed{s}" for s in seeds[1:]]
  acc = np.array([results[n]["accuracy"] for n in names])
  return {"seeds": seeds, "memory_tokens": results["fot"]["memory_tokens"], "mean": acc.mean(0).tolist(),
          "min": acc.min(0).tolist(), "max": acc.max(0).tolist()}


def _dictionary_rd(ev, cfg, task, trained):
  """r_d against d for FoT and the baseline: each document's queries (one window of
  task.defs_len tokens) with its own definitions and d - 1 other documents' in memory.

  Two document sets: independent documents (other documents may define the query's key too,
  with another value: attention there is content-correct but counts as negative), and, for the
  d that the key space allows, documents that share no key (as the training batches)."""
  ds = list(ev.rd_ds)
  d_max = task.key_space // task.n_defs  # documents that can avoid sharing a key
  sets = {}  # label -> (ds, documents), the same documents for every arm
  for label, set_ds, disjoint in (("independent", ds, False), ("disjoint_keys", [d for d in ds if d <= d_max], True)):
    if set_ds:
      docs = task.batch(ev.seed, 5, max(set_ds), disjoint_keys=disjoint)[0].astype(np.int32)
      sets[label] = (set_ds, list(docs))
  return {name: {label: positive_attention_mass(cfg, trained[name]["params"], docs, task.queries_len, set_ds, 1,
                                                ev.batch, name=f"{name} ({label})")
                 for label, (set_ds, docs) in sets.items()}
          for name in ("fot", "baseline") if name in trained}


def _write_results(results, workdir, arms):
  save_and_tabulate(results, workdir, arms, "accuracy", "Dictionary lookup accuracy (all value tokens right)")
  sd = results["seeds"]
  print(f"FoT over seeds {sd['seeds']}: accuracy at {sd['memory_tokens'][-1]:,} tokens "
        f"mean {sd['mean'][-1]:.3f}, min {sd['min'][-1]:.3f}, max {sd['max'][-1]:.3f}")
  for name, sets in results["rd"].items():
    for label, rd in sets.items():
      print(f"{name} r_d ({label} documents): " + ", ".join(f"d={d} {r:.3f}" for d, r in zip(rd["d"], rd["r_d"])))
  plt = plots.pyplot()
  if plt is None:
    return
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  n = len(sd["seeds"])
  plots.plot_dictionary_accuracy(ax, results, f"FoT (window {results['fot']['window']})" + (f", mean of {n} seeds" if n > 1 else ""),
                f"FoT min-max over {n} seeds", "")
  ax.set_title(f"Dictionary lookup with memory (top-k {results['config']['eval']['topk']})")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  for i, (name, sets) in enumerate(results["rd"].items()):
    for label, rd in sets.items():
      bx.plot(rd["d"], rd["r_d"], marker="os"[i % 2], color=("C0", "C3")[i % 2],
              linestyle="-" if label == "disjoint_keys" else ":", label=f"{name}, {label.replace('_', ' ')}")
  if results["rd"]:
    ds = results["rd"]["fot"]["independent"]["d"]
    bx.plot(ds, [1 / d for d in ds], "k--", label="1/d (no preference)")
  bx.set_xscale("log", base=2)
  bx.set_yscale("log", base=2)
  bx.set_xlabel("documents in memory (d)")
  bx.set_ylabel("r_d: attention on own document / on memory")
  bx.set_title("Positive attention mass (memory layer)")
  bx.grid(alpha=0.3)
  bx.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "dictionary_lookup.png"), dpi=120)
  plt.close(fig)
