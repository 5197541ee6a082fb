"""Turning experiment ConfigDicts into typed objects, and the one `validate(config)`.

`validate` runs before anything is traced, so a bad experiment file or CLI
override ends in one message naming the field, not a traceback from inside JAX.
"""
from __future__ import annotations

import dataclasses

from data_pipelines.dictionary_lookup import DictionaryTask
from fot_jax import crossbatch
from fot_jax.curriculum import Schedule
from fot_jax.model.config import ModelConfig, get_size

EXPERIMENTS = ("dictionary_lookup", "lm")


def _plain(x):
  return x.to_dict() if hasattr(x, "to_dict") else dict(x or {})


def model_config(config) -> ModelConfig:
  overrides = _plain(config.model.get("overrides", {}))
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ValueError(f"model.overrides: unknown field(s) {unknown}; known: {sorted(known)}")
  if "mem_layers" in overrides:
    overrides["mem_layers"] = tuple(int(x) for x in overrides["mem_layers"])
  return get_size(config.model.size, **overrides)


def dictionary_task(config) -> DictionaryTask:
  fields = _plain(config.data)
  known = {f.name for f in dataclasses.fields(DictionaryTask)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"data: unknown field(s) {unknown}; known: {sorted(known)}")
  task = DictionaryTask(**fields)
  task.validate()
  return task


def validate(config) -> None:
  """Checks an experiment config; raises ValueError naming the bad field."""
  if config.get("experiment") not in EXPERIMENTS:
    raise ValueError(f"experiment: must be one of {EXPERIMENTS}, got {config.get('experiment')!r}")
  if config.experiment == "lm":
    return validate_lm(config)
  cfg = model_config(config)
  task = dictionary_task(config)
  if cfg.vocab_size < task.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.vocab_size} is smaller than the task vocabulary "
                     f"({task.vocab_size} tokens); raise model.overrides.vocab_size")
  if not cfg.mem_layers:
    raise ValueError("model.mem_layers: FoT needs at least one memory layer")
  opt = config.optim
  if float(opt.lr) <= 0:
    raise ValueError(f"optim.lr: must be positive, got {opt.lr}")
  if opt.schedule not in ("constant", "cosine"):
    raise ValueError(f"optim.schedule: must be 'constant' or 'cosine', got {opt.schedule!r}")
  for arm in ("fot", "baseline"):
    a = config[arm]
    if a.window <= 0 or task.doc_len % a.window:
      raise ValueError(f"{arm}.window={a.window} must divide the document length {task.doc_len}")
    if a.slots <= 0 or a.steps < 0:
      raise ValueError(f"{arm}.slots / {arm}.steps: must be positive, got {a.slots} / {a.steps}")
  sched = Schedule(config.fot.curriculum)
  pack = task.doc_len // config.fot.window
  if sched.pack != pack:
    raise ValueError(f"fot.curriculum: pack size k={sched.pack} (w + 1) must equal the windows per "
                     f"document, {task.doc_len} // {config.fot.window} = {pack}")
  accum = int(config.fot.get("accum_steps", 1))
  rows = config.fot.slots * pack
  if accum <= 0 or config.fot.slots % accum:
    raise ValueError(f"fot.accum_steps={accum} must divide fot.slots={config.fot.slots} "
                     f"(gradient accumulation never splits a pack)")
  for spec in sched.all_specs():  # every plan of the schedule must be buildable
    crossbatch.plan_from_spec(rows // accum, spec)
  crossbatch.scored_rows(rows, pack, config.fot.loss_on)
  ev = config.eval
  if ev.mode not in ("dense", "topk"):
    raise ValueError(f"eval.mode: must be 'dense' or 'topk', got {ev.mode!r}")
  for m in ev.memory_tokens:
    if m % task.defs_len:
      raise ValueError(f"eval.memory_tokens: {m} is not a multiple of the definition block "
                       f"({task.defs_len} tokens)")
    for arm in ("fot", "baseline"):
      w = config[arm].window
      if m + task.queries_len > w and m % w:
        raise ValueError(f"eval.memory_tokens: {m} must be a multiple of {arm}.window={w}")


def validate_lm(config) -> None:
  """Language-model experiments (experiments/base_lm.py fields)."""
  from data_pipelines import tasks, vocab as vocab_lib  # TensorFlow/SeqIO: only LM runs need them
  cfg = model_config(config)
  d, t = config.data, config.train
  vocab = vocab_lib.get_vocabulary(d.vocab)
  vocab_lib.check_fits(vocab.vocab_size, cfg.vocab_size)
  if not cfg.mem_layers:
    raise ValueError("model.mem_layers: FoT needs at least one memory layer")
  for name in ("task", "eval_task"):
    tasks.get_provider(d[name])
  for field in ("slots", "windows_per_slot", "window"):
    if int(d[field]) <= 0:
      raise ValueError(f"data.{field}: must be positive, got {d[field]}")
  if float(config.optim.lr) <= 0:
    raise ValueError(f"optim.lr: must be positive, got {config.optim.lr}")
  sched = Schedule(t.curriculum)
  k = int(d.windows_per_slot)
  if sched.pack not in (1, k):
    raise ValueError(f"train.curriculum: pack size k={sched.pack} (w + 1) must equal "
                     f"data.windows_per_slot={k}")
  rows = int(d.slots) * k
  accum = int(t.get("accum_steps", 1))
  if accum <= 0 or int(d.slots) % accum:
    raise ValueError(f"train.accum_steps={accum} must divide data.slots={d.slots} "
                     f"(gradient accumulation never splits a pack)")
  for spec in sched.all_specs():
    crossbatch.plan_from_spec(rows // accum, spec)
  crossbatch.scored_rows(rows, k, t.loss_on)
  if t.get("init_from"):
    raise ValueError("train.init_from: starting an LM run from a checkpoint is not supported by this runner yet")
  ev = config.eval
  if ev.doc_mode != "single_doc":
    raise ValueError(f"eval.doc_mode: only 'single_doc' is implemented, got {ev.doc_mode!r}")
  if ev.mode not in ("dense", "topk"):
    raise ValueError(f"eval.mode: must be 'dense' or 'topk', got {ev.mode!r}")
  if any(int(m) < 0 for m in ev.memory_tokens) or int(ev.score_tokens) <= 0:
    raise ValueError(f"eval.memory_tokens / eval.score_tokens: must be >= 0 / > 0, got "
                     f"{list(ev.memory_tokens)} / {ev.score_tokens}")
