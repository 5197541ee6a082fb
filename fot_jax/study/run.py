"""A study run: the base (given, or trained once into W/base), every method checked before the first
one runs, then each method fine-tuned (if it is) and evaluated, skipping what a rerun with the same
spec and settings finished before; W/study.json, study.md and the figures at the end."""
from __future__ import annotations

import os
import time
from typing import Dict

import numpy as np

from fot_jax import configs
from fot_jax.eval import suite as suite_lib
from fot_jax.jsonio import read_json, write_json
from fot_jax.runners import lm as lm_runner
from fot_jax.study.settings import MethodSpec, StudyBase, StudySettings, same_settings
from fot_jax.study.evaluation import evaluate_method
from fot_jax.study.finetune import finetune_batches, finetune_method, finetune_plan
from fot_jax.study.methods import method_context
from fot_jax.study.report import markdown, plot


def ensure_base(base: StudyBase, workdir: str) -> str:
  """The base checkpoint: base.checkpoint, or the run trained into W/base (once)."""
  if base.checkpoint:
    if not os.path.exists(base.checkpoint):
      raise ValueError(f"study: base checkpoint {base.checkpoint!r} does not exist; {base.missing_hint}"
                       .rstrip("; "))
    return base.checkpoint
  base_dir = os.path.join(workdir, "base")
  ck = os.path.join(base_dir, "fot")
  if os.path.exists(os.path.join(base_dir, "results.json")):
    print(f"[study] base: {ck} (trained before)", flush=True)
    return ck
  exp = configs.resolve(base.train)  # the base's own experiment, resolved (with its data) once, here
  print(f"[study] base: training {exp.train.steps} steps into {base_dir}", flush=True)
  t0 = time.time()
  lm_runner.run(exp, base_dir)
  print(f"[study] base trained in {time.time() - t0:.0f}s", flush=True)
  return ck


def _previous(study: StudySettings, method: MethodSpec, workdir: str):
  """The method's earlier result (finished, or its suites so far) if its spec and settings are the
  same, else None."""
  prev = None
  for path in (os.path.join(workdir, "methods", f"{method.name}.json"),
               os.path.join(workdir, "methods", f"{method.name}.partial.json")):  # the suites finished so far
    if prev is None and os.path.exists(path):
      prev = read_json(path, f"study result of method {method.name!r}")
      if not isinstance(prev, dict):
        raise ValueError(f"study result {path} is not a JSON object; delete it to evaluate {method.name!r} again")
      # a file from before suites_done was written once all of its settings' suites had run
      prev.setdefault("suites_done", list(prev.get("settings", {}).get("suites", [])))
      if prev.get("method") != method.spec or not same_settings(prev.get("settings"), study.settings_of(method)):
        print(f"[study] method {method.name}: its spec or the study's settings changed since {path} was written; "
              "evaluating again", flush=True)
        prev = None
  return prev


def run(study: StudySettings, workdir: str) -> Dict:
  """The whole study (StudySettings.from_dict has read and checked the study file)."""
  names = [m.name for m in study.methods]
  t_start = time.time()
  os.makedirs(os.path.join(workdir, "methods"), exist_ok=True)
  base_path = ensure_base(study.base, workdir)
  base = suite_lib.Context.from_checkpoint(base_path, study.eval, name="base")
  for m in study.methods:  # every method's config is checked before the first one runs
    method_context(base, m, study.pad)
    if m.finetune:  # and its data (one slot filled; the fine-tune builds its own batcher)
      _, window, k, _ = finetune_plan(base, m, study.pad)
      finetune_batches(base, m.name, m.finetune, window, k)
  results, spent = {}, []
  for i, m in enumerate(study.methods):
    name = m.name
    out = os.path.join(workdir, "methods", f"{name}.json")
    partial = os.path.join(workdir, "methods", f"{name}.partial.json")
    prev = _previous(study, m, workdir)
    todo = [x for x in study.suites if x not in (prev or {}).get("suites_done", [])]
    if prev is not None and not todo:
      print(f"[study] method {i + 1}/{len(names)} {name}: done before ({out}), skipped", flush=True)
      results[name] = dict(prev, settings=study.settings_of(m))
      continue
    print(f"[study] method {i + 1}/{len(names)} {name}: {m.describe()}"
          + (f"; suites {todo} (the others done before)" if prev else ""), flush=True)
    t0 = time.time()
    wall_before = (prev or {}).get("wall_seconds", 0.0)

    def save(res, path=partial, t0=t0, wall_before=wall_before):
      write_json(path, dict(res, wall_seconds=wall_before + time.time() - t0))

    params, ft = finetune_method(base, m, study.pad, workdir) if m.finetune else (None, None)
    res = evaluate_method(base, m, study, params, done=prev, save=save)
    if ft is not None:
      res["finetune"] = ft
    res["wall_seconds"] = wall_before + time.time() - t0  # fine-tune (this session's part) and evaluation
    write_json(out, res)
    if os.path.exists(partial):
      os.remove(partial)
    results[name] = res
    spent.append(res["wall_seconds"])
    left = sum(1 for mm in study.methods[i + 1:]
               if not os.path.exists(os.path.join(workdir, "methods", f"{mm.name}.json")))
    print(f"[study] method {name} done in {spent[-1]:.0f}s; {left} left, ETA {np.mean(spent) * left:.0f}s",
          flush=True)
  result = {"base": os.path.abspath(base_path), "window": base.window, "lengths": list(study.lengths),
            "methods": results, "wall_seconds": time.time() - t_start}
  if study.finetune is not None:
    result["finetune"] = study.finetune
  write_json(os.path.join(workdir, "study.json"), result)
  with open(os.path.join(workdir, "study.md"), "w") as f:
    f.write(markdown(result))
  plot(result, workdir)
  print(f"[study] wrote {workdir}/study.md, study.json and figures ({result['wall_seconds']:.0f}s)", flush=True)
  return result
