"""The run's fingerprint: a workdir resumes only the run it was started for.

run_fingerprint (the run-defining fields), fingerprint_differences (what changed, RESUMABLE_FIELDS
left out) and check_run_fingerprint (record at the first start, refuse a resume that differs).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from fot_jax import jsonio
from fot_jax.curriculum import Schedule
from fot_jax.model.config import ModelConfig
from fot_jax.settings import OptimSettings, TrainSettings


RUN_FINGERPRINT = "run_fingerprint.json"

# Fields that may change when a workdir resumes: the run's length, bookkeeping, and how a step is
# computed (the same mathematics on another layout or implementation). Every other field of the
# fingerprint (run_fingerprint) defines the run; a resume with another value is refused.
RESUMABLE_FIELDS = {
    "train.steps": "the run's length: raise it to extend a run (a cosine schedule keeps optim.total_steps)",
    "train.log_every": "logging cadence",
    "train.checkpoint_every": "checkpoint cadence",
    "train.tensorboard": "TensorBoard scalars on or off",
    "train.mesh": "device mesh sizes and rules (orbax restores into the new shardings)",
    "model.remat": "rematerialisation (the same gradients, less memory)",
    "model.remat_policy": "what rematerialisation saves (the same gradients)",
    "model.scan_layers": "layers run as a scan (the same parameters and gradients)",
    "model.attention_impl": "the score/softmax implementation (the same attention)",
    "model.attention_block": "the blockwise implementation's key block",
    "model.context_parallel": "the sequence-parallel attention strategy",
    "model.context_layout": "the tokens' layout over the context axis",
    "data.eval_task": "held-out documents of the evaluation (LM runs)",
    "data.eval_split": "held-out split of the evaluation (LM runs)",
}


def _plain_json(x):
  """x as JSON would give it back (tuples -> lists, ConfigDicts -> dicts, numpy scalars -> numbers)."""
  def default(o):
    if hasattr(o, "to_dict"):
      return o.to_dict()
    if isinstance(o, np.generic):
      return o.item()
    if dataclasses.is_dataclass(o):
      return dataclasses.asdict(o)
    return str(o)
  return json.loads(json.dumps(x, default=default))


def run_fingerprint(model_cfg: ModelConfig, train_cfg, schedule: Schedule, run_fields=None) -> dict:
  """The fields that define a run, in groups: model (every ModelConfig field), optim, train (the
  train config but optim), curriculum (the schedule's config), and the caller's `run_fields`
  (the data settings; a group given there replaces the derived one of that name)."""
  tc = TrainSettings.from_dict(train_cfg).to_dict()
  groups = {"model": dataclasses.asdict(model_cfg), "optim": tc.pop("optim"), "train": tc,
            "curriculum": schedule.cfg}
  groups.update(run_fields or {})
  return _plain_json(groups)


_UNSET = "(unset)"


def _unset(value) -> bool:
  return value is None or value is False or value in ("", [], {})


def _leaf_differences(old, new, path):
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for k in sorted(set(old) | set(new)):
      out += _leaf_differences(old.get(k, _UNSET), new.get(k, _UNSET), f"{path}.{k}")
    return out
  if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
    return [d for i, (a, b) in enumerate(zip(old, new)) for d in _leaf_differences(a, b, f"{path}[{i}]")]
  return [] if old == new or (_unset(old) and _unset(new)) else [(path, old, new)]


def fingerprint_differences(old: dict, new: dict):
  """[(field, old value, new value)] of the run-defining fields that differ (RESUMABLE_FIELDS
  left out). A field the old fingerprint lacks (newer code) counts only if its new value is
  not its default (empty, or the default of ModelConfig, OptimSettings or TrainSettings: older code
  recorded only the fields its caller gave); a field the new one lacks is not compared. Unset
  values (None, '', [], {}, False) are equal to each other."""
  defaults = {group: _plain_json({f.name: f.default for f in dataclasses.fields(cls)
                                  if f.default is not dataclasses.MISSING})
              for group, cls in (("model", ModelConfig), ("optim", OptimSettings), ("train", TrainSettings))}
  out = []
  for group in sorted(new):
    old_g, new_g = old.get(group, {}), new[group]
    if not isinstance(old_g, dict) or not isinstance(new_g, dict):
      out += _leaf_differences(old_g, new_g, group)
      continue
    for field in sorted(new_g):
      name = f"{group}.{field}"
      if name in RESUMABLE_FIELDS:
        continue
      if field not in old_g:  # recorded by older code: a new field at its default changes nothing
        value = new_g[field]
        if _unset(value) or defaults.get(group, {}).get(field, _UNSET) == value:
          continue
      out += _leaf_differences(old_g.get(field, _UNSET), new_g[field], name)
  return out


def _short(value, limit: int = 60) -> str:
  text = value if value == _UNSET else json.dumps(value, separators=(",", ":"))
  return text if len(text) <= limit else text[:limit - 3] + "..."


def check_run_fingerprint(workdir: str, fingerprint: dict, resuming: bool, write: bool = True,
                          step: int = 0) -> None:
  """Resuming: the workdir's recorded fingerprint must match `fingerprint` (one ValueError naming
  every differing field, old -> new); a workdir written before fingerprints records this one.
  A fresh start records it. Only process 0 writes."""
  path = os.path.join(workdir, RUN_FINGERPRINT)
  if resuming and os.path.exists(path):
    recorded = jsonio.read_json(path, "run fingerprint")
    diffs = fingerprint_differences(recorded.get("run", {}) if isinstance(recorded, dict) else {}, fingerprint)
    if diffs:
      changes = "; ".join(f"{f}: {_short(a)} -> {_short(b)}" for f, a, b in diffs)
      raise ValueError(f"{workdir} holds a run started with other settings, and resuming it with these would "
                       f"mix two runs: {changes}. Restore those settings, use another workdir, or delete {path} "
                       f"to continue this run with the new ones on purpose")
    return
  if write and jax.process_index() == 0:
    jsonio.write_json(path, {"run": fingerprint, "recorded_at_step": int(step),
                             "resumable": sorted(RESUMABLE_FIELDS)})
