"""A study run: the base (given, or trained once into W/base), every method checked before the first
one runs, then each method fine-tuned (if it is) and evaluated, skipping what a rerun with the same
spec and settings finished before; W/study.json, study.md and the figures at the end."""
from __future__ import annotations

import os
import time
from typing import Dict

import numpy as np

from fot_jax import configs, lm_runs
from fot_jax.eval import suite as suite_lib
from fot_jax.jsonio import read_json, write_json
from fot_jax.study.config import check_config, describe, eval_config, finetune_settings, jsonable, method_spec, \
    same_settings, settings
from fot_jax.study.evaluation import evaluate_method
from fot_jax.study.finetune import finetune_batches, finetune_method, finetune_plan
from fot_jax.study.methods import method_context
from fot_jax.study.report import markdown, plot


def ensure_base(config, workdir: str) -> str:
  """The base checkpoint: config.base.checkpoint, or the run trained into W/base (once)."""
  path = config.base.get("checkpoint") or ""
  if path:
    if not os.path.exists(path):
      raise ValueError(f"study: base checkpoint {path!r} does not exist; {config.base.get('missing_hint', '')}"
                       .rstrip("; "))
    return path
  if "train" not in config.base:
    raise ValueError("study: set base.checkpoint or base.train (an LM experiment config)")
  base_dir = os.path.join(workdir, "base")
  ck = os.path.join(base_dir, "fot")
  if os.path.exists(os.path.join(base_dir, "results.json")):
    print(f"[study] base: {ck} (trained before)", flush=True)
    return ck
  train_cfg = config.base.train
  configs.validate(train_cfg)
  print(f"[study] base: training {train_cfg.train.steps} steps into {base_dir}", flush=True)
  t0 = time.time()
  lm_runs.run_lm(train_cfg, base_dir)
  print(f"[study] base trained in {time.time() - t0:.0f}s", flush=True)
  return ck


def run(config, workdir: str) -> Dict:
  check_config(config)
  for m in config.methods:  # the fine-tune fields, before a base is trained
    finetune_settings(config, m)
  names = [m["name"] for m in config.methods]
  t_start = time.time()
  os.makedirs(os.path.join(workdir, "methods"), exist_ok=True)
  base_path = ensure_base(config, workdir)
  base = suite_lib.Context(base_path, eval_config(config))
  base.name = "base"
  for m in config.methods:  # every method's config is checked before the first one runs
    method_context(base, m, int(config.pad))
    if m.get("finetune"):  # and its data (one slot filled; the fine-tune builds its own batcher)
      s, _, window, k, _ = finetune_plan(base, m, config)
      finetune_batches(base, m["name"], s, window, k)
  results, spent = {}, []
  for i, m in enumerate(config.methods):
    name = m["name"]
    out = os.path.join(workdir, "methods", f"{name}.json")
    partial = os.path.join(workdir, "methods", f"{name}.partial.json")  # the suites finished so far
    prev = None
    for path in (out, partial):
      if prev is None and os.path.exists(path):
        prev = read_json(path, f"study result of method {name!r}")
        if not isinstance(prev, dict):
          raise ValueError(f"study result {path} is not a JSON object; delete it to evaluate {name!r} again")
        # a file from before suites_done was written once all of its settings' suites had run
        prev.setdefault("suites_done", list(prev.get("settings", {}).get("suites", [])))
        if prev.get("method") != method_spec(m) or not same_settings(prev.get("settings"), settings(config, m)):
          print(f"[study] method {name}: its spec or the study's settings changed since {path} was written; "
                "evaluating again", flush=True)
          prev = None
    todo = [x for x in config.suites if x not in (prev or {}).get("suites_done", [])]
    if prev is not None and not todo:
      print(f"[study] method {i + 1}/{len(names)} {name}: done before ({out}), skipped", flush=True)
      results[name] = dict(prev, settings=settings(config, m))
      continue
    print(f"[study] method {i + 1}/{len(names)} {name}: {describe(m)}"
          + (f"; suites {todo} (the others done before)" if prev else ""), flush=True)
    t0 = time.time()
    wall_before = (prev or {}).get("wall_seconds", 0.0)

    def save(res, path=partial, t0=t0, wall_before=wall_before):
      write_json(path, dict(res, wall_seconds=wall_before + time.time() - t0))

    params, ft = finetune_method(base, m, config, workdir) if m.get("finetune") else (None, None)
    res = evaluate_method(base, m, config, params, done=prev, save=save)
    if ft is not None:
      res["finetune"] = ft
    res["wall_seconds"] = wall_before + time.time() - t0  # fine-tune (this session's part) and evaluation
    write_json(out, res)
    if os.path.exists(partial):
      os.remove(partial)
    results[name] = res
    spent.append(res["wall_seconds"])
    left = sum(1 for mm in config.methods[i + 1:]
               if not os.path.exists(os.path.join(workdir, "methods", f"{mm['name']}.json")))
    print(f"[study] method {name} done in {spent[-1]:.0f}s; {left} left, ETA {np.mean(spent) * left:.0f}s",
          flush=True)
  study = {"base": os.path.abspath(base_path), "window": base.window, "lengths": [int(x) for x in config.lengths],
           "methods": results, "wall_seconds": time.time() - t_start}
  if "finetune" in config:
    study["finetune"] = jsonable(config.finetune)
  write_json(os.path.join(workdir, "study.json"), study)
  with open(os.path.join(workdir, "study.md"), "w") as f:
    f.write(markdown(study))
  plot(study, workdir)
  print(f"[study] wrote {workdir}/study.md, study.json and figures ({study['wall_seconds']:.0f}s)", flush=True)
  return study
