"""The dictionary-lookup experiment behind fot_jax.main (FoT and its baseline, accuracy against memory
size, r_d), and the arm training and result writing that the LM runner (fot_jax/lm_runs.py) shares."""
from __future__ import annotations

import os
import time

import jax
import numpy as np

from data_pipelines.copy_task import CopyBatches, CopyTask
from data_pipelines.dictionary_lookup import DictionaryBatches
from fot_jax import configs, jsonio, plots, provenance
from fot_jax.curriculum import Schedule
from fot_jax.settings import TrainSettings
from fot_jax.eval import dictionary
from fot_jax.eval.rd import positive_attention_mass
from fot_jax.train import NoCheckpoint, train


def _dictionary_run_fields(config, arm: str) -> dict:
  """What defines a dictionary arm's training besides its model, optimiser and train config (the
  workdir's fingerprint, fot_jax.train.run_fingerprint): the task, the copy warm-up, the arm's
  window and slots, and the curriculum as configured (the baseline's own is derived from how
  FoT's ran, so it is FoT's configured one that must not change)."""
  a = configs.dictionary_arm(config, arm)
  fields = {"data": config.data.to_dict(), "warmup": config.warmup.to_dict(),
            arm: {"window": a.window, "slots": a.slots}, "curriculum": config.fot.curriculum.to_dict()}
  fields.setdefault("fot", {})["disjoint_keys"] = configs.dictionary_arm(config, "fot").disjoint_keys
  return fields


def _dictionary_feeds(config, task, arm, seed, schedule):
  """The batch source(s) of an arm: {task name: batch function} for a curriculum over the copy
  warm-up and the lookup, or the lookup's alone for a curriculum that names no task."""
  a = configs.dictionary_arm(config, arm)
  disjoint = configs.dictionary_arm(config, "fot").disjoint_keys  # the baseline sees FoT's documents
  lookup = DictionaryBatches(task, a.slots, a.window, seed, disjoint_keys=disjoint)
  if schedule.tasks() == [None]:
    return lookup
  feeds = {"dictionary": lookup}
  if configs.copy_warmup(config).enabled:
    feeds["copy"] = CopyBatches(warmup_task(config, task, arm), a.slots, a.window, seed)
  return feeds


def warmup_task(config, task, arm: str) -> CopyTask:
  """The copy warm-up over the last `warmup.num_symbols` ids of the dictionary vocabulary: all
  value symbols and the last key symbols (fewer symbols: a much earlier induction phase change).
  The baseline's repeat comes in `warmup.baseline_chunks` shuffled pieces (no fixed-offset copy)."""
  warmup = configs.copy_warmup(config)
  n = min(warmup.num_symbols, task.num_symbols + task.num_value_symbols)
  chunks = warmup.baseline_chunks if arm == "baseline" else 1
  span = configs.dictionary_arm(config, "fot").window
  return CopyTask(span=span, num_symbols=n, symbol_offset=task.vocab_size - n, chunks=chunks)


def baseline_schedule(fot_phases, fot_steps: int) -> Schedule:
  """The baseline's curriculum: FoT's phases as they ran (same tasks, same numbers of steps),
  without crossbatch."""
  if not fot_phases:  # a random curriculum has no phases: the same steps on the lookup
    return Schedule({"kind": "constant", "spec": {}})
  phases = [{"name": p["name"], "task": p["task"], "spec": {},
             "steps": (p["end"] if p["end"] is not None else fot_steps) - p["start"]} for p in fot_phases]
  return Schedule({"kind": "phases", "phases": [p for p in phases if p["steps"] > 0], "stop_after_last": True})


def run_dictionary_lookup(config, workdir: str, train: bool = True) -> dict:
  """Trains FoT (per seed) and the baseline, evaluates accuracy against memory size and r_d
  against d, writes results.json and dictionary_lookup.png."""
  t_start = time.time()
  cfg, task, ev = configs.model_config(config), configs.dictionary_task(config), configs.dictionary_eval_settings(config)
  arms = {arm: configs.dictionary_arm(config, arm) for arm in ("fot", "baseline")}
  seeds = [int(config.seed)] + [int(s) for s in config.get("extra_seeds", ())]
  trained = {}
  for seed in seeds:
    name = "fot" if seed == seeds[0] else f"fot_seed{seed}"
    schedule = Schedule(config.fot.curriculum)
    trained[name] = train_arm(cfg, configs.train_settings(config, "fot", seed), name, schedule,
                               _dictionary_feeds(config, task, "fot", seed, schedule), os.path.join(workdir, name),
                               train, "dictionary_lookup", arms["fot"].window, _dictionary_run_fields(config, "fot"))
  if arms["baseline"].enabled:
    steps_run = trained["fot"]["steps_run"]
    schedule = baseline_schedule(trained["fot"]["phases"], steps_run)
    trained["baseline"] = train_arm(cfg, configs.train_settings(config, "baseline", seeds[0], steps_run), "baseline",
                                     schedule, _dictionary_feeds(config, task, "baseline", seeds[0], schedule),
                                     os.path.join(workdir, "baseline"), train, "dictionary_lookup",
                                     arms["baseline"].window, _dictionary_run_fields(config, "baseline"))
  windows = {name: arms["baseline" if name == "baseline" else "fot"].window for name in trained}
  evalset = dictionary.DictionaryEvalSet(task, ev.n_docs, max(ev.memory_tokens), ev.seed)
  results = {"config": {"model": cfg.__dict__, "task": task.__dict__, "eval": config.eval.to_dict(),
                        "fot": config.fot.to_dict(), "seeds": seeds}}
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


def train_arm(cfg, tc: TrainSettings, name, schedule, batches, workdir, do_train, vocab, window: int, run_fields: dict):
  """Trains (or resumes) one arm in its workdir; do_train=False (--mode=evaluate) restores its
  latest checkpoint and trains nothing, refusing a workdir with no restorable step."""
  vocab = os.path.abspath(vocab) if os.path.isfile(vocab) else vocab  # evaluation finds it from anywhere
  # `window`: the run's local window, recorded for evaluation (not a warm-up phase's own window)
  try:
    out = train(cfg, tc, schedule, batches, workdir, name=name, model_meta={"vocab": vocab, "window": int(window)},
                run_fields=run_fields, restore_only=not do_train)
  except NoCheckpoint as e:
    raise NoCheckpoint(f"--mode=evaluate: nothing to evaluate for arm {name!r}: {e}; train first "
                       f"(--mode=train) or point --workdir at a trained run") from None
  hist = out["history"]
  out["final_accuracy"] = float(np.mean([h["accuracy"] for h in hist[-5:]])) if hist else None
  out["steps_run"] = hist[-1]["step"] if hist else _checkpoint_step(workdir)
  return out


def _checkpoint_step(workdir):
  """The step of the latest checkpoint under workdir (a finished run resumed or re-evaluated)."""
  ckpt = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if os.path.isdir(ckpt) else []
  return max(steps, default=0)


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


def save_and_tabulate(results, workdir, arms, metric, title):
  """results.json, and a table of `metric` against memory tokens per arm on stdout."""
  jsonio.write_json(os.path.join(workdir, "results.json"), results, default=str)
  width = max(9, *(len(a) for a in arms))
  header = f"{'memory tokens':>14} | " + " | ".join(f"{a:>{width}}" for a in arms)
  lines = [header, "-" * len(header)]
  for i, m in enumerate(results[arms[0]]["memory_tokens"]):
    lines.append(f"{m:>14,} | " + " | ".join(f"{results[a][metric][i]:>{width}.3f}" for a in arms))
  print(f"\n{title}:\n" + "\n".join(lines))
  print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.join(workdir, 'results.json')}")
