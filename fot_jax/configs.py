"""Turning experiment ConfigDicts into typed objects, and the one `validate(config)`.

`validate` runs before anything is traced, so a bad experiment file or CLI
override ends in one message naming the field, not a traceback from inside JAX.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types

import flax.linen as nn
import jax
import numpy as np

from data_pipelines.copy_task import CopyTask
from data_pipelines.dictionary_lookup import DictionaryTask
from data_pipelines.retrieval_docs import RetrievalSpec
from fot_jax import crossbatch, jsonio, parallel, recurrent
from fot_jax.curriculum import Schedule
from fot_jax.eval import perplexity
from fot_jax.model import context_parallel
from fot_jax.model.config import ModelConfig, get_size
from fot_jax.model.llama import LlamaModel
from fot_jax.settings import (BaselinesSettings, CopyWarmupSettings, DictionaryArm,
                              DictionaryEvalSettings, LMDataSettings, LMEvalSettings, TrainSettings)
from fot_jax.train import resolve_trainable

EXPERIMENTS = ("dictionary_lookup", "lm", "baselines")
LM_EXPERIMENTS = ("lm", "baselines")  # experiments/base_lm.py fields


def _plain(x):
  return x.to_dict() if hasattr(x, "to_dict") else dict(x or {})


def model_config(config) -> ModelConfig:
  overrides = _plain(config.model.get("overrides", {}))
  return ModelConfig.from_dict(overrides, "model.overrides", base=get_size(config.model.size))


def train_settings(config, arm: str = "fot", seed=None, steps=None) -> TrainSettings:
  """A training run's settings from the experiment's sections: an LM experiment's `train` and `optim`
  (every arm the same), or a dictionary-lookup arm's (`fot` / `baseline`) and `optim`; `seed` and
  `steps` override the configured ones (extra seeds; the baseline, which has no `steps`, runs FoT's)."""
  lm = config.experiment in LM_EXPERIMENTS
  t = config.train if lm else config[arm]
  fields = {"steps": t.get("steps", 0) if steps is None else steps, "seed": config.seed if seed is None else seed,
            "loss_on": t.get("loss_on", "all"), "accum_steps": t.get("accum_steps", 1), "log_every": t.log_every,
            "checkpoint_every": t.checkpoint_every, "optim": config.optim, "mesh": config.get("mesh"),
            "crossbatch_scope": t.get("crossbatch_scope", "batch")}
  if lm:
    fields.update(init_from=t.get("init_from"), trainable=t.get("trainable"))
  return TrainSettings.from_dict(fields, "train" if lm else arm)


def lm_data_settings(config) -> LMDataSettings:
  """An LM experiment's `data` section, typed and checked."""
  return LMDataSettings.from_dict(config.data, "data")


def lm_eval_settings(config) -> LMEvalSettings:
  """An LM experiment's `eval` section, typed and checked."""
  return LMEvalSettings.from_dict(config.eval, "eval")


def dictionary_arm(config, arm: str) -> DictionaryArm:
  """A dictionary-lookup arm's batch shape (`fot` or `baseline`)."""
  return DictionaryArm.from_section(config[arm], arm)


def dictionary_eval_settings(config) -> DictionaryEvalSettings:
  """The dictionary-lookup experiment's `eval` section, typed and checked."""
  return DictionaryEvalSettings.from_dict(config.eval, "eval")


def dictionary_task(config) -> DictionaryTask:
  fields = _plain(config.data)
  known = {f.name for f in dataclasses.fields(DictionaryTask)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"data: unknown field(s) {unknown}; known: {sorted(known)}")
  task = DictionaryTask(**fields)
  task.validate()
  return task


def copy_warmup(config) -> CopyWarmupSettings:
  """The experiment's copy warm-up (`c.warmup`, typed; off without the section). An LM run's names
  its span, slots and ids; the dictionary experiment's spans are its arms' windows, its ids the
  last `num_symbols` of its vocabulary."""
  required = ("span", "slots", "num_symbols") if config.experiment in LM_EXPERIMENTS else ("num_symbols",)
  return CopyWarmupSettings.from_dict(config.get("warmup"), "warmup", required)


def warmup_task_name(config):
  """The curriculum task name of an LM run's copy warm-up (`c.warmup.task`), None without one."""
  w = copy_warmup(config)
  return w.task if w.enabled else None


def lm_warmup_task(config, arm: str = "fot") -> CopyTask:
  """An LM run's copy warm-up (`c.warmup`): spans of `span` random token ids (`num_symbols` ids
  from `symbol_offset`), repeated. The no-crossbatch arm's repeat comes in `baseline_chunks`
  shuffled pieces (its documents sit whole in one row, where a fixed-offset copy would not transfer)."""
  w = copy_warmup(config)
  return CopyTask(span=w.span, num_symbols=w.num_symbols, symbol_offset=w.symbol_offset,
                  chunks=1 if arm == "fot" else w.baseline_chunks, distinct=w.distinct)


REPEAT_FIELDS = ("task", "fraction", "score_first")


def repeat_view(config, task):
  """The repeat view a curriculum task names (`c.data.repeats[task]`: its source task, '' or absent
  for the corpus; the fraction of slots repeated; whether their first window is scored), None for
  any other task."""
  data = lm_data_settings(config)
  if task is None or task not in data.repeats:
    return None
  v = _plain(data.repeats[task])
  unknown = sorted(set(v) - set(REPEAT_FIELDS))
  if unknown:
    raise ValueError(f"data.repeats.{task}: unknown field(s) {unknown}; known: {list(REPEAT_FIELDS)}")
  return {"task": str(v.get("task") or data.corpus), "fraction": float(v.get("fraction", 1.0)),
          "score_first": bool(v.get("score_first", True))}


def retrieval_view(config, task):
  """The retrieval documents a curriculum task names (`c.data.retrieval[task]`, fields of
  data_pipelines.retrieval_docs.RetrievalSpec; natural-text slots read the corpus unless the view
  names its own `text_task`), None for any other task."""
  data = lm_data_settings(config)
  if task is None or task not in data.retrieval:
    return None
  fields = _plain(data.retrieval[task])
  if fields.get("text_slots") and not fields.get("text_task"):
    fields["text_task"] = data.corpus
  spec = RetrievalSpec.from_dict(fields, f"data.retrieval.{task}")
  spec.validate(f"data.retrieval.{task}", data.windows_per_slot)
  return spec


def corpus_views(config) -> list:
  """What each text view of an LM run reads: [(view, field, task, split)] for the training text
  when a phase reads it, every repeat and retrieval view the curriculum uses (a retrieval view
  without natural-text slots reads none), and the held-out evaluation. `field` is the config field
  that chose the task, or 'data.corpus' when the view names none."""
  data, sched = lm_data_settings(config), Schedule(config.train.curriculum)
  raw = _plain(config.data)

  def chosen(field, value):
    return field if value else "data.corpus"
  out = []
  warmup = warmup_task_name(config)
  for task in dict.fromkeys(sched.tasks()):  # in the curriculum's order
    if task is None:
      out.append(("training text", chosen("data.task", raw.get("task")), data.task, data.split))
    elif task == warmup:
      continue  # random token ids, no text
    elif task in data.repeats:
      own = _plain(data.repeats[task]).get("task")
      out.append((f"repeat view {task!r}", chosen(f"data.repeats.{task}.task", own),
                  repeat_view(config, task)["task"], data.split))
    elif task in data.retrieval:
      spec = retrieval_view(config, task)
      if spec.text_slots:
        own = _plain(data.retrieval[task]).get("text_task")
        out.append((f"retrieval view {task!r} text slots", chosen(f"data.retrieval.{task}.text_task", own),
                    spec.text_task, data.split))
    else:
      out.append((f"curriculum task {task!r}", "train.curriculum", task, data.split))
  out.append(("held-out evaluation", chosen("data.eval_task", raw.get("eval_task")), data.eval_task,
              data.eval_split))
  return out


def format_corpus_views(config, views=None) -> str:
  """The lines a run prints at its start: the corpus, then each view and the task it reads (views:
  corpus_views(config), computed if not given); a view reading other text than the corpus is
  marked, so a forgotten override shows before training."""
  data, views = lm_data_settings(config), views or corpus_views(config)
  lines = [f"data: corpus {data.corpus!r} (data.corpus); each view reads:"]
  for view, field, task, split in views:
    mark = "" if task == data.corpus else "   <- not the corpus"
    lines.append(f"  {view:<36} {task!r} split {split!r} ({field}){mark}")
  if data.task != data.corpus and not any(v[0] == "training text" for v in views):
    lines.append(f"  note: data.task={data.task!r} is read by no phase of this curriculum; data.corpus sets "
                 f"what every view reads")
  return "\n".join(lines)


def validate(config, check_data: bool = True) -> None:
  """Checks an experiment config; raises ValueError naming the bad field.

  check_data=False skips what needs the data on this machine (LM vocabulary and tasks)."""
  if config.get("experiment") not in EXPERIMENTS:
    raise ValueError(f"experiment: must be one of {EXPERIMENTS}, got {config.get('experiment')!r}")
  if config.experiment in LM_EXPERIMENTS:
    validate_lm(config, check_data)
    return validate_baselines(config) if config.experiment == "baselines" else None
  cfg = model_config(config)
  task = dictionary_task(config)
  if cfg.vocab_size < task.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.vocab_size} is smaller than the task vocabulary "
                     f"({task.vocab_size} tokens); raise model.overrides.vocab_size")
  if not cfg.mem_layers:
    raise ValueError("model.mem_layers: FoT needs at least one memory layer")
  arms = {arm: dictionary_arm(config, arm) for arm in ("fot", "baseline")}
  ts = {arm: train_settings(config, arm) for arm in arms}  # each arm's training fields checked
  for arm, a in arms.items():
    if task.doc_len % a.window:
      raise ValueError(f"{arm}.window={a.window} must divide the document length {task.doc_len}")
  fot, base = arms["fot"], arms["baseline"]
  if fot.disjoint_keys:
    task.check_disjoint(fot.slots, "fot.slots")
  sched = Schedule(config.fot.curriculum)
  warmup = copy_warmup(config)
  known = {"dictionary", "copy"} if warmup.enabled else {"dictionary"}
  bad = sorted({str(t) for t in sched.tasks() if t is not None and t not in known})
  if bad:
    raise ValueError(f"fot.curriculum: phase task(s) {bad} unknown; this experiment's tasks: {sorted(known)} "
                     f"('copy' needs warmup.enabled)")
  if warmup.enabled and (2 * fot.window) % base.window:
    raise ValueError(f"baseline.window={base.window} must divide the copy warm-up's documents "
                     f"(2 x fot.window = {2 * fot.window} tokens)")
  pack = task.doc_len // fot.window
  if sched.pack != pack:
    raise ValueError(f"fot.curriculum: pack size k={sched.pack} (w + 1) must equal the windows per "
                     f"document, {task.doc_len} // {fot.window} = {pack}")
  accum, rows = ts["fot"].accum_steps, fot.slots * pack
  if fot.slots % accum:
    raise ValueError(f"fot.accum_steps={accum} must divide fot.slots={fot.slots} "
                     f"(gradient accumulation never splits a pack)")
  for spec in sched.all_specs():  # every plan of the schedule must be buildable
    crossbatch.plan_from_spec(rows // accum, spec)
  crossbatch.scored_rows(rows, pack, ts["fot"].loss_on)
  validate_mesh(config, cfg, rows // accum, ts["fot"].crossbatch_scope)
  for m in dictionary_eval_settings(config).memory_tokens:
    if m % task.defs_len:
      raise ValueError(f"eval.memory_tokens: {m} is not a multiple of the definition block "
                       f"({task.defs_len} tokens)")
    for arm, a in arms.items():
      if m + task.queries_len > a.window and m % a.window:
        raise ValueError(f"eval.memory_tokens: {m} must be a multiple of {arm}.window={a.window}")


def train_shape(config):
  """(global rows, window, accum_steps, schedule) of one training step of an experiment."""
  if config.experiment in LM_EXPERIMENTS:
    d, t = lm_data_settings(config), config.train
    return d.slots * d.windows_per_slot, d.window, int(t.get("accum_steps", 1)), Schedule(t.curriculum)
  sched, fot = Schedule(config.fot.curriculum), dictionary_arm(config, "fot")
  return fot.slots * sched.pack, fot.window, train_settings(config, "fot").accum_steps, sched


def validate_lm(config, check_data: bool = True) -> None:
  """Language-model experiments (experiments/base_lm.py fields): model, optimizer,
  curriculum against the batch shape, evaluation and the mesh. check_data: also load the
  vocabulary, resolve the tasks and find train.init_from (off for --mode=plan, which reads
  no data)."""
  cfg, d, t = model_config(config), lm_data_settings(config), config.train
  if check_data and t.get("init_from"):  # a file-system check: before the data's imports
    check_init_from(str(t.init_from))
  if check_data:
    from data_pipelines import tasks, vocab as vocab_lib  # TensorFlow/SeqIO: only LM runs need them
    vocab = vocab_lib.get_vocabulary(d.vocab)
    vocab_lib.check_fits(vocab.vocab_size, cfg.vocab_size)
    named = [("data.corpus", d.corpus), ("data.task", d.task)]  # named, even where no phase reads it
    for field, task in named + [(field, task) for _, field, task, _ in corpus_views(config)]:
      try:
        tasks.get_provider(task)
      except ValueError as e:
        raise ValueError(f"{field}={task!r}: {str(e).removeprefix('data.task: ')}") from None
  if not cfg.mem_layers:
    raise ValueError("model.mem_layers: FoT needs at least one memory layer")
  train_settings(config)
  rows, _, accum, sched = train_shape(config)
  k = d.windows_per_slot
  if sched.pack not in (1, k):
    raise ValueError(f"train.curriculum: pack size k={sched.pack} (w + 1 or len(segments)) must equal "
                     f"data.windows_per_slot={k}")
  if accum <= 0 or int(d.slots) % accum:
    raise ValueError(f"train.accum_steps={accum} must divide data.slots={d.slots} "
                     f"(gradient accumulation never splits a pack)")
  for spec in sched.all_specs():
    crossbatch.plan_from_spec(rows // accum, spec)
    rspec = recurrent.recurrent_spec(spec)  # the Memorizing Transformer / Transformer-XL phases
    if rspec is not None:
      recurrent.check(rspec, cfg, int(d.window))
  warmup = warmup_task_name(config)
  warmup_phases = [p for p in sched.phases if warmup is not None and p.get("task") == warmup]
  if warmup_phases:
    task = lm_warmup_task(config)  # copy documents: two windows of `span` tokens per slot
    task.validate()
    if task.vocab_size > cfg.vocab_size:
      raise ValueError(f"warmup: symbol ids {task.symbol_offset}..{task.vocab_size - 1} do not fit the "
                       f"model's vocabulary of {cfg.vocab_size}")
  copy_rows = 2 * copy_warmup(config).slots // accum  # two windows per warm-up slot
  for phase in warmup_phases:
    crossbatch.plan_from_spec(copy_rows, phase["spec"])
  for task in sched.tasks():
    view = repeat_view(config, task)
    if view and (k < 2 or not 0.0 < view["fraction"] <= 1.0):
      raise ValueError(f"data.repeats.{task}: needs data.windows_per_slot >= 2 (got {k}) and a fraction in "
                       f"(0, 1] (got {view['fraction']})")
  crossbatch.scored_rows(rows, k, t.loss_on)
  resolve_trainable(t.get("trainable"), cfg)  # a pattern that matches no parameter fails here
  lm_eval_settings(config)
  validate_mesh(config, cfg, rows // accum, t.get("crossbatch_scope", "batch"))
  if check_data:  # last: it reads and tokenizes held-out documents
    from data_pipelines import pipeline  # TensorFlow/SeqIO, as the tasks above
    ids = vocab_lib.special_ids(vocab)
    eval_documents(config, pipeline.document_tokens(d.eval_task, vocab, d.eval_split, seed=None), ids["bos"],
                   ids["eos"])


def eval_documents(config, documents, bos: int, eos: int) -> list:
  """The held-out documents (`bos doc eos`, stored order) the LM evaluation scores, from `documents`
  (the held-out split's token arrays in stored order: pipeline.document_tokens(data.eval_task, vocab,
  data.eval_split, seed=None)): eval.n_docs of them, each long enough for the largest memory size
  plus the scored tail. validate reads them before the first step, so a held-out split too short
  for the evaluation fails then, not after the training time is spent; the error says which sizes
  would fit."""
  data, ev = lm_data_settings(config), lm_eval_settings(config)
  need = perplexity.needed_length(ev.memory_tokens, ev.score_tokens)
  docs, lengths = [], []
  for doc in documents:
    lengths.append(len(doc) + 2)
    if lengths[-1] >= need:
      docs.append(np.concatenate([[bos], doc, [eos]]).astype(np.int32))
      if len(docs) == ev.n_docs:
        return docs
  lengths.sort(reverse=True)
  fit = lengths[ev.n_docs - 1] if len(lengths) >= ev.n_docs else 0
  raise ValueError(
      f"eval: {len(docs)} of the eval.n_docs={ev.n_docs} held-out documents of {data.eval_task!r} split "
      f"{data.eval_split!r} have the {need} tokens the evaluation needs (max eval.memory_tokens "
      f"{max(ev.memory_tokens)} + eval.score_tokens {ev.score_tokens} + 1); that split has {len(lengths)} "
      f"documents" + (f", its {ev.n_docs} longest at least {fit} tokens: make max(eval.memory_tokens) + "
                      f"eval.score_tokens at most {fit - 1}, or lower eval.n_docs" if fit else ": lower eval.n_docs") + ", or set data.eval_task to longer text")


# experiment 'baselines' (fot_jax/baselines.py): FoT first, then the paper's comparisons (BASELINE_ARMS)
def baselines_settings(config) -> BaselinesSettings:
  """The 'baselines' experiment's `baselines` section, typed and checked."""
  return BaselinesSettings.from_dict(config.baselines, "baselines")


def validate_baselines(config) -> None:
  b = baselines_settings(config)
  cfg, window = model_config(config), lm_data_settings(config).window
  spec = recurrent.recurrent_spec({"memory": "memorizing", "memory_tokens": b.memory_tokens, "topk": b.topk})
  recurrent.check(spec, cfg, window)
  if warmup_task_name(config) is not None:  # the copy warm-up's windows hold memory too
    recurrent.check(spec, cfg, copy_warmup(config).span)


INIT_FROM_HINT = ("make one with `python -m fot_jax.convert import_hf --hf_dir DIR --out CKPT`, or give a "
                  "training arm's workdir such as runs/NAME/fot")


def check_init_from(path: str) -> None:
  """`train.init_from` looks like an fot_jax checkpoint (a directory with a readable
  fot_jax_model.json and parameters), so a wrong path fails before any data is read or step
  compiled; the parameters themselves are checked when they are loaded."""
  if not os.path.exists(path):
    raise ValueError(f"train.init_from: no checkpoint at {path!r} ({INIT_FROM_HINT})")
  if not os.path.isdir(path):
    raise ValueError(f"train.init_from: {path!r} is a file, not an fot_jax checkpoint directory ({INIT_FROM_HINT})")
  model_json = os.path.join(path, "fot_jax_model.json")
  if not os.path.isfile(model_json):
    found = sorted(os.listdir(path))
    raise ValueError(f"train.init_from: {path!r} is not an fot_jax checkpoint: it has no fot_jax_model.json "
                     f"({'it is empty' if not found else 'found ' + ', '.join(found[:5])}; {INIT_FROM_HINT})")
  info = jsonio.read_json(model_json, "train.init_from:", hint="")
  if not isinstance(info, dict) or not isinstance(info.get("model"), dict):
    raise ValueError(f"train.init_from: {model_json} holds no 'model' object of ModelConfig fields")
  ckpts = os.path.join(path, "checkpoints")
  if not os.path.isdir(os.path.join(path, "params")) and not (
      os.path.isdir(ckpts) and any(d.isdigit() for d in os.listdir(ckpts))):
    raise ValueError(f"train.init_from: {path!r} holds no parameters (neither params/ from import_hf nor "
                     f"checkpoints/STEP/ from a training run)")


def validate_mesh(config, cfg: ModelConfig, micro_rows: int, scope: str = "batch") -> None:
  """Rules, sizes, and (when no size is -1) divisibility of parameters and batch rows."""
  mesh_cfg = config.get("mesh")
  rules = parallel.rules_from_config(mesh_cfg)
  sizes = {a: int(mesh_cfg.get(a, 1)) for a in parallel.AXES} if mesh_cfg else {}
  if list(sizes.values()).count(-1) > 1 or any(v == 0 or v < -1 for v in sizes.values()):
    raise ValueError(f"mesh: sizes must be positive with at most one -1, got {sizes}")
  if scope not in ("batch", "device"):
    raise ValueError(f"crossbatch_scope: must be 'batch' or 'device', got {scope!r}")
  if not sizes or -1 in sizes.values():
    return  # the device count decides; checked again when the mesh is built
  dcn = {a: int(mesh_cfg.get(f"dcn_{a}", 1)) for a in parallel.AXES}
  context = sizes["context"] * dcn["context"]
  if context > 1:  # the window is split over `context` in the layout's chunks
    window = train_shape(config)[1]
    context_parallel.check_length(window, context, cfg.context_layout,
                                  "data.window" if config.experiment in LM_EXPERIMENTS else "fot.window")
    context_parallel.check_heads(cfg.context_parallel, cfg.num_heads, cfg.kv_heads, context,
                                 sizes["tensor"] * dcn["tensor"])
  shape = types.SimpleNamespace(shape={a: sizes[a] * dcn[a] for a in parallel.AXES})
  boxed = jax.eval_shape(lambda: LlamaModel(cfg).init(jax.random.PRNGKey(0), jax.numpy.zeros((1, 8), "int32")))
  specs = nn.logical_to_mesh(nn.get_partition_spec(boxed["params"]), rules)
  parallel.check_divisible(nn.meta.unbox(boxed["params"]), specs, shape, "model parameter")
  shards = math.prod(shape.shape[a] for a in parallel.batch_axes_tuple(rules))
  if micro_rows % shards:
    raise ValueError(f"mesh: {micro_rows} rows per step (data.slots x data.windows_per_slot / "
                     f"train.accum_steps) are not divisible by the {shards} batch shards")


def load_module(path: str):
  """An experiment file as a module (for get_sweep())."""
  import importlib.util
  import os
  if not os.path.isfile(path):
    raise ValueError(f"--config: no experiment file at {path}")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def sweep_runs(path: str) -> list:
  """The named runs of an experiment file's get_sweep(): [{'name': ..., 'a.b': value, ...}]."""
  module = load_module(path)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{path}: defines no get_sweep(); a sweep needs a list of overrides")
  runs = [dict(r) for r in module.get_sweep()]
  names = [r.get("name") for r in runs]
  if not runs or any(not n or not str(n).replace("_", "").replace("-", "").isalnum() for n in names):
    raise ValueError(f"{path}: get_sweep() must return runs each with a 'name' of letters, digits, _ or -; "
                     f"got names {names}")
  if len(set(names)) != len(names):
    raise ValueError(f"{path}: get_sweep() repeats run names {names}")
  return runs


def apply_overrides(config, overrides: dict):
  """Sets dotted fields ('train.curriculum': {...}); every field must exist already."""
  for key, value in overrides.items():
    if key == "name":
      continue
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      if p not in node:
        raise ValueError(f"sweep override {key!r}: no field {p!r} in the config")
      node = node[p]
    if leaf not in node:
      raise ValueError(f"sweep override {key!r}: no field {leaf!r} in the config")
    with config.unlocked():
      node[leaf] = value
  return config
