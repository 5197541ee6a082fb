"""The FoT paper's comparison on one language-model run (experiment 'baselines'):

  fot             crossbatch, the experiment's curriculum
  memorizing      the Memorizing Transformer: the same memory layer trained on a kNN memory of
                  the same document's earlier windows, non-differentiable (fot_jax/recurrent.py)
  transformer_xl  every layer attends to the previous window's cached keys/values
  plain           the same model without crossbatch (a local-window transformer)
  hybrid          FoT's crossbatch, then a short memorizing phase (the last `hybrid_steps` steps)

Every arm trains the same model on the same tasks for the same numbers of steps: FoT runs
first (its curriculum may end phases on a metric) and the others follow FoT's phases as they
ran, each with its own method in place of crossbatch, on the same slot batches (the plain
arm's copy warm-up sees each copy document whole in one row, as run_lm's no-crossbatch arm;
the memory arms see FoT's two windows, so their memory is how they can copy). Each arm trains
once per seed (the arms of `extra_seed_arms` on the seeds after the first). Evaluation:
perplexity of held-out documents against the memory before the scored span (memory arms through MemoryInference, all in one memory mode; Transformer-XL
through its own recurrence over the same tokens: XLInference), and the suite's r_d and passkey
per arm (r_d needs a memory layer's memory: none for Transformer-XL). Writes
W/results.json ({'memory_tokens', 'perplexity': {arm: seed mean}, 'seeds': {arm: {seed: ...}},
'rd', 'passkey', ...}) and W/baselines.png.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, List

import jax
import numpy as np

from data_pipelines import vocab as vocab_lib
from fot_jax import cli, jsonio, plots, provenance, recurrent
from fot_jax.configs import Experiment
from fot_jax.curriculum import Schedule
from fot_jax.eval import settings as eval_settings, suite as suite_lib
from fot_jax.inference import MemoryInference
from fot_jax.runners import common, lm_data
from fot_jax.settings import BASELINE_ARMS, BaselinesSettings

ARMS = BASELINE_ARMS


def arm_spec(arm: str, windows: int, b: BaselinesSettings) -> dict:
  """The spec an arm trains with where FoT trains with crossbatch."""
  if arm == "plain":
    return {}
  if arm == "transformer_xl":
    return {"memory": "transformer_xl", "windows": windows}
  return {"memory": "memorizing", "windows": windows, "memory_tokens": b.memory_tokens, "topk": b.topk}


def arm_schedule(arm: str, fot_phases: List[dict], fot_steps: int, windows: int,
                 b: BaselinesSettings) -> Schedule:
  """FoT's phases as they ran (names, tasks, step counts), with the arm's spec; the hybrid keeps
  FoT's specs and turns the last b.hybrid_steps steps into a memorizing phase on the last task."""
  phases = common.phases_as_run(fot_phases, fot_steps)
  if arm == "hybrid":
    tail = b.hybrid_steps
    if not 0 < tail < sum(p["steps"] for p in phases):
      raise ValueError(f"baselines.hybrid_steps: {tail} must be between 0 and FoT's {fot_steps} steps")
    last, cut = phases[-1], tail
    while cut >= phases[-1]["steps"]:  # the memorizing tail may take whole phases
      cut -= phases.pop()["steps"]
    phases[-1] = dict(phases[-1], steps=phases[-1]["steps"] - cut) if cut else phases[-1]
    phases = [p for p in phases if p["steps"] > 0]
    phases.append({"name": "memorizing", "task": last["task"], "spec": arm_spec("memorizing", windows, b),
                   "steps": tail})
  else:
    phases = [dict(p, spec=arm_spec(arm, windows, b)) for p in phases]
  return Schedule({"kind": "phases", "phases": phases, "stop_after_last": True})


def _inference(arm: str, exp: Experiment, params):
  window = exp.lm.data.window
  if arm == "transformer_xl":
    return recurrent.XLInference(exp.model, params, window)
  return MemoryInference(exp.model, params, window, exp.lm.eval.mode, exp.lm.eval.topk)


def _suite_extras(arm: str, workdir: str, exp: Experiment, params, inference) -> Dict:
  """r_d (memory arms) and passkey of one trained arm, with the evaluation suite's runners."""
  ev, data, b = exp.lm.eval, exp.lm.data, exp.baselines
  sc = eval_settings.SuiteSettings.from_dict(  # the suite's defaults, with this run's evaluation and b.rd / b.passkey
      {"task": data.eval_task, "batch": ev.batch, "window": data.window, "mode": ev.mode, "topk": ev.topk,
       "rd": b.rd, "passkey": b.passkey}, "baselines")
  ctx = suite_lib.Context(path=workdir, settings=sc, cfg=exp.model, params=params, window=data.window,
                          vocab=vocab_lib.get_vocabulary(data.vocab), vocab_spec=data.vocab,
                          name=os.path.basename(workdir), own_inference=inference)  # the trained arm as it is
  suites = set(b.suites)
  return {"passkey": suite_lib.run_passkey(ctx) if "passkey" in suites else None,
          "rd": suite_lib.run_rd(ctx) if "rd" in suites and arm != "transformer_xl" else None}


def run(exp: Experiment, workdir: str, train: bool = True) -> Dict:
  """Trains every arm per seed (resumable per arm), evaluates, writes results.json + baselines.png."""
  t_start = time.time()
  cfg, lm, b = exp.model, exp.lm, exp.baselines
  data, ev = lm.data, lm.eval
  docs = lm.held_out()
  print(lm_data.format_corpus_views(lm), flush=True)
  print(f"baselines: {len(docs)} held-out documents of {data.eval_task!r}", flush=True)
  results = {"config": exp.raw, "memory_tokens": [int(m) for m in ev.memory_tokens],
             "n_docs": len(docs), "eval_mode": f"{ev.mode}" + (f" (top-{ev.topk})" if ev.mode == "topk" else ""),
             "seeds": {}, "training": {}, "rd": {}, "passkey": {}}
  for seed in b.seeds:
    fot_run = None
    for arm in b.arms_of_seed(seed):
      name = f"{arm}_seed{seed}"
      arm_dir = os.path.join(workdir, name)
      schedule = (exp.schedule() if arm == "fot" else
                  arm_schedule(arm, fot_run["phases"], fot_run["steps_run"], data.windows_per_slot, b))
      layout = "no_crossbatch" if arm == "plain" else "fot"  # the copy warm-up's rows (lm_data.feed_batches)
      sources = lm_data.arm_batches(lm.feeds, schedule.tasks(), data, seed, layout)
      out = common.train_arm(model=cfg, settings=dataclasses.replace(exp.train, seed=seed), name=name,
                             schedule=schedule, batches=lm_data.train_input(sources), workdir=arm_dir,
                             do_train=train, vocab=data.vocab, window=data.window, run_fields=lm.run_fields)
      if arm == "fot":
        fot_run = out
      inference = _inference(arm, exp, out["params"])
      res = common.perplexity_of(inference, docs, ev, name)
      results["seeds"].setdefault(arm, {})[str(seed)] = res["perplexity"]
      results["training"].setdefault(arm, {})[str(seed)] = {
          "steps": out["steps_run"], "seconds": out["seconds"], "phases": out["phases"],
          "final_train_loss": out["final_loss"]}
      if seed == b.seeds[0]:
        extras = _suite_extras(arm, arm_dir, exp, out["params"], inference)
        results["rd"][arm], results["passkey"][arm] = extras["rd"], extras["passkey"]
      _summarise(results, t_start)
      if jax.process_index() == 0:  # after every arm: a long run's finished arms are on disk
        write_results(results, workdir, final=False)
  if jax.process_index() == 0:
    write_results(results, workdir)
  return results


def _summarise(results: Dict, t_start: float) -> None:
  """Per arm: the mean perplexity over its seeds so far, and their range."""
  results["perplexity"] = {arm: np.mean(list(per_seed.values()), 0).tolist()
                           for arm, per_seed in results["seeds"].items()}
  results["spread"] = {arm: (np.max(list(v.values()), 0) - np.min(list(v.values()), 0)).tolist()
                       for arm, v in results["seeds"].items()}
  results["wall_seconds"] = time.time() - t_start
  results["provenance"] = provenance.provenance()


def write_results(results: Dict, workdir: str, final: bool = True) -> None:
  """results.json (written after every arm, `complete` once all are done), the table, the plot."""
  jsonio.write_json(os.path.join(workdir, "results.json"), dict(results, complete=final), default=str)
  if not final:
    return
  arms = list(results["perplexity"])
  mems = results["memory_tokens"]
  header = f"{'memory tokens':>14} | " + " | ".join(f"{a:>15}" for a in arms)
  lines = [header, "-" * len(header)]
  def cell(a, i):  # one seed: no range to give
    spread = f"±{results['spread'][a][i] / 2:.3f}" if len(results["seeds"][a]) > 1 else " " * 6
    return f"{results['perplexity'][a][i]:>8.3f} {spread}"
  for i, m in enumerate(mems):
    lines.append(f"{m:>14,} | " + " | ".join(cell(a, i) for a in arms))
  seeds = {a: list(v) for a, v in results["seeds"].items()}
  print(f"\nPerplexity (mean over each arm's seeds {seeds}, ± half their range), "
        f"memory {results['eval_mode']}:\n" + "\n".join(lines), flush=True)
  with open(os.path.join(workdir, "baselines.md"), "w") as f:
    f.write(markdown(results))
  xs = [max(m, 1) for m in mems]
  plots.plot_curves(os.path.join(workdir, "baselines.png"), {a: (xs, results["perplexity"][a]) for a in arms},
             "tokens of the same document before the scored span", "perplexity (per token)",
             "FoT and the paper's baselines", xticks=(xs, [f"{m:,}" for m in mems]))


def markdown(results: Dict) -> str:
  """W/baselines.md: perplexity per arm against memory (each seed, and the mean), then r_d and
  passkey per arm, as measured (what docs/baselines.md's tables are copied from)."""
  mems = results["memory_tokens"]
  lines = [f"Perplexity against tokens of the same document in memory ({results['eval_mode']}; "
           f"{results['n_docs']} held-out documents):", "",
           "| arm | seeds | " + " | ".join(f"{m:,}" for m in mems) + " |",
           "| --- | --- |" + " ---: |" * len(mems)]
  for arm, per_seed in results["seeds"].items():
    for seed, ppl in per_seed.items():
      lines.append(f"| {arm} | {seed} | " + " | ".join(f"{p:.3f}" for p in ppl) + " |")
    if len(per_seed) > 1:
      lines.append(f"| {arm} | mean | " + " | ".join(f"**{p:.3f}**" for p in results["perplexity"][arm]) + " |")
  rd_ds = sorted({d for r in results["rd"].values() if r for d in r["d"]})
  if rd_ds:
    lines += ["", "r_d (positive attention mass) by d documents in memory:", "",
              "| arm | " + " | ".join(f"d={d}" for d in rd_ds) + " |", "| --- |" + " ---: |" * len(rd_ds)]
    for arm, r in results["rd"].items():
      if r:
        by_d = dict(zip(r["d"], r["r_d"]))
        lines.append(f"| {arm} | " + " | ".join(f"{by_d[d]:.3f}" if d in by_d else "-" for d in rd_ds) + " |")
  lines += ["", "passkey accuracy by length (mean over depths):", ""]
  for arm, r in results["passkey"].items():
    if r:
      lines.append(f"- {arm}: " + ", ".join(f"{n:,}: {a:.2f}" for n, a in zip(r["lengths"], r["accuracy_per_length"])))
  return "\n".join(lines) + "\n"


def merge_results(parts: List[Dict]) -> Dict:
  """One results dict from runs of the same experiment whose arms or seeds were split over processes
  or hosts (each its own workdir): per arm and seed the perplexities, training and suites of the
  part that ran them, arms in the experiment's order. Parts must share the evaluation (memory sizes,
  documents, memory mode); an arm-seed in two parts (FoT, when each process trains the arms that
  follow it) must have the same perplexities there, else it is an error."""
  if not parts:
    raise ValueError("merge_results: no results to merge")
  keys = ("memory_tokens", "n_docs", "eval_mode")
  first = parts[0]
  merged = {k: first[k] for k in ("config",) + keys}
  merged.update(seeds={}, training={}, rd={}, passkey={})
  for i, part in enumerate(parts):
    differ = [k for k in keys if part[k] != first[k]]
    if differ:
      raise ValueError(f"merge_results: part {i} evaluates differently from part 0 in {differ}")
    for arm, per_seed in part["seeds"].items():
      for seed, ppl in per_seed.items():
        seen = merged["seeds"].get(arm, {}).get(seed)
        if seen is not None:  # the same trained arm evaluated twice (e.g. FoT, which the others follow)
          if not np.allclose(seen, ppl, rtol=1e-5):
            raise ValueError(f"merge_results: {arm} seed {seed} is in more than one part with other "
                             f"perplexities ({seen} against {ppl})")
          continue
        merged["seeds"].setdefault(arm, {})[seed] = ppl
        merged["training"].setdefault(arm, {})[seed] = part["training"][arm][seed]
    for suite in ("rd", "passkey"):
      for arm, r in part[suite].items():
        merged[suite].setdefault(arm, r)
  order = list(first["config"]["baselines"]["arms"])
  for k in ("seeds", "training", "rd", "passkey"):
    merged[k] = {a: merged[k][a] for a in sorted(merged[k], key=lambda a: order.index(a) if a in order else len(order))}
  _summarise(merged, time.time())
  merged["wall_seconds"] = sum(float(p.get("wall_seconds", 0.0)) for p in parts)  # the parts' own, summed
  merged["merged_from"] = len(parts)
  return merged


def main(argv=None) -> None:
  """python -m fot_jax.runners.baselines --out W PART_W [PART_W ...]: merge parts' results.json into W."""
  import argparse
  ap = argparse.ArgumentParser(prog="python -m fot_jax.runners.baselines", description=main.__doc__)
  ap.add_argument("--out", required=True, help="workdir for the merged results.json, table and baselines.png")
  ap.add_argument("parts", nargs="+", help="workdirs of runs whose arms or seeds were split")
  a = ap.parse_args(argv)
  with cli.expected_errors("fot_jax.runners.baselines"):  # one line, exit 2, like every fot_jax entry point
    paths = [os.path.join(w, "results.json") for w in a.parts]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
      raise FileNotFoundError(f"no results.json in {missing}")
    parts = [jsonio.read_json(p) for p in paths]
    for path, part in zip(paths, parts):  # a dictionary or LM run's results.json has other fields
      if not isinstance(part, dict) or not {"seeds", "memory_tokens", "training"} <= set(part):
        raise ValueError(f"{path}: not the results of a 'baselines' experiment (no per-arm seeds and memory sizes)")
    merged = merge_results(parts)
    os.makedirs(a.out, exist_ok=True)
    write_results(merged, a.out)


if __name__ == "__main__":
  main()
