"""An experiment file's ConfigDict, resolved once into a typed, checked `Experiment`.

`resolve(config)` is the one reader of an experiment's ConfigDict: `fot_jax.main` (and the study,
for its base run) calls it before anything is traced, so a bad experiment file or CLI override
ends in one message naming the field, not a traceback from inside JAX. The runners
(fot_jax/runners/), the plan and the data feeds take the Experiment or the part they need.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax
import numpy as np

from data_pipelines.dictionary_lookup import DictionaryTask
from data_pipelines.retrieval_docs import RetrievalSpec
from fot_jax import crossbatch, jsonio, parallel, recurrent
from fot_jax.curriculum import Schedule
from fot_jax.eval import perplexity
from fot_jax.model import context_parallel
from fot_jax.model.config import ModelConfig, get_size
from fot_jax.model.llama import LlamaModel
from fot_jax.settings import (REPEAT_FIELDS, BaselinesSettings, CopyWarmupSettings, DictionaryArm,
                              DictionaryEvalSettings, LMDataSettings, LMEvalSettings, RepeatFeed, TextFeed,
                              TrainSettings)
from fot_jax.train import resolve_trainable

EXPERIMENTS = ("dictionary_lookup", "lm", "baselines")
LM_EXPERIMENTS = ("lm", "baselines")  # experiments/base_lm.py fields


@dataclasses.dataclass(frozen=True)
class LMExperiment:
  """The parts only LM experiments ('lm', 'baselines') have: data, evaluation, one typed feed per
  curriculum task (None: data.task), what each text view reads (_corpus_views), whether the
  no-crossbatch arm trains beside FoT (`c.baseline.enabled`, experiment 'lm'), and the held-out
  documents the evaluation scores (read once, by resolve's data check; empty without it)."""
  data: LMDataSettings
  eval: LMEvalSettings
  feeds: Dict[Optional[str], Any]
  views: Tuple[Tuple[str, str, str, str], ...]
  no_crossbatch: bool = False
  eval_docs: Tuple[np.ndarray, ...] = ()
  run_fields: Dict[str, Any] = dataclasses.field(default_factory=dict)  # every arm's: _lm_run_fields

  def held_out(self) -> Tuple[np.ndarray, ...]:
    """The held-out documents; an experiment resolved without its data (check_data=False) has none."""
    if not self.eval_docs:
      raise ValueError("this experiment was resolved with check_data=False: it has no held-out documents "
                       "to evaluate (configs.resolve(config) reads them)")
    return self.eval_docs


@dataclasses.dataclass(frozen=True)
class DictionaryExperiment:
  """The dictionary-lookup experiment's parts: the task, each arm's batch shape ('fot', 'baseline'),
  the baseline's training settings (its steps are FoT's as run), evaluation, and FoT's seeds
  (`c.seed` first, then `c.extra_seeds`)."""
  task: DictionaryTask
  arms: Dict[str, DictionaryArm]
  baseline_train: TrainSettings
  eval: DictionaryEvalSettings
  seeds: Tuple[int, ...]
  run_fields: Dict[str, Dict[str, Any]]  # per arm: _dictionary_run_fields


@dataclasses.dataclass(frozen=True)
class Experiment:
  """An experiment file resolved once (`resolve`): the model, FoT's training run and curriculum, the
  copy warm-up, and the parts of its kind. `raw` is the ConfigDict as a dict, kept for results.json
  and the workdirs' fingerprints only: nothing reads settings from it."""
  kind: str
  model: ModelConfig
  train: TrainSettings  # FoT's: every arm of an LM experiment (seed replaced per seed), the dictionary 'fot' arm
  curriculum: Dict[str, Any]
  warmup: CopyWarmupSettings
  raw: Dict[str, Any]
  lm: Optional[LMExperiment] = None
  dictionary: Optional[DictionaryExperiment] = None
  baselines: Optional[BaselinesSettings] = None

  def schedule(self) -> Schedule:
    """FoT's curriculum, fresh (a Schedule keeps its run's state: one per training run)."""
    return Schedule(self.curriculum)

  def train_shape(self) -> Tuple[int, int, int]:
    """(global rows, window, accum_steps) of one FoT training step."""
    if self.lm is not None:
      d = self.lm.data
      return d.slots * d.windows_per_slot, d.window, self.train.accum_steps
    fot = self.dictionary.arms["fot"]
    return fot.slots * self.schedule().pack, fot.window, self.train.accum_steps


def _plain(x):
  return x.to_dict() if hasattr(x, "to_dict") else dict(x or {})


# The fields of each section resolve reads as a whole (the others are read by their own typed reader,
# which refuses unknown fields itself): a misspelt field in an experiment file fails naming it, as a
# misspelt --config override does.
_RUN_FIELDS = {"steps", "loss_on", "accum_steps", "log_every", "checkpoint_every", "crossbatch_scope"}
_SECTIONS = {
    "lm": {"experiment", "seed", "model", "optim", "data", "train", "eval", "mesh", "warmup", "baseline"},
    "dictionary_lookup": {"experiment", "seed", "extra_seeds", "model", "optim", "data", "eval", "mesh", "warmup",
                          "fot", "baseline"},
}
_SECTIONS["baselines"] = _SECTIONS["lm"] | {"baselines"}
_FIELDS = {
    ("lm", "train"): _RUN_FIELDS | {"init_from", "trainable", "curriculum", "memory"},
    ("lm", "baseline"): {"enabled"},
    ("dictionary_lookup", "fot"): _RUN_FIELDS | {"window", "slots", "disjoint_keys", "curriculum"},
    ("dictionary_lookup", "baseline"): _RUN_FIELDS | {"window", "slots", "disjoint_keys", "enabled"},
    ("model",): {"size", "overrides"},
}


# What defines an arm's training besides its model, optimiser and train settings (the workdir's
# fingerprint, fot_jax.train.run_fingerprint), as configured: the data, the copy warm-up, the curriculum
# (a following arm's own is derived from how FoT's ran, so FoT's must not change) and, for a dictionary
# arm, its window and slots.
def _lm_run_fields(config) -> Dict[str, Any]:
  fields = {"data": _plain(config.data), "curriculum": _plain(config.train.curriculum)}
  if config.get("warmup") is not None:
    fields["warmup"] = _plain(config.warmup)
  return fields


def _dictionary_run_fields(config, arms: Dict[str, DictionaryArm], arm: str) -> Dict[str, Any]:
  a = arms[arm]
  fields = {"data": _plain(config.data), "warmup": _plain(config.warmup) if config.get("warmup") is not None else None,
            arm: {"window": a.window, "slots": a.slots}, "curriculum": _plain(config.fot.curriculum)}
  fields.setdefault("fot", {})["disjoint_keys"] = arms["fot"].disjoint_keys
  return fields


def _check_known(config) -> None:
  """Every top-level section, and every field of the sections resolve reads whole, is one it knows."""
  kind = config.experiment
  lm_kind = "lm" if kind in LM_EXPERIMENTS else kind
  unknown = sorted(set(config.keys()) - _SECTIONS[kind])
  if unknown:
    raise ValueError(f"unknown section(s) {unknown} for experiment {kind!r}; known: {sorted(_SECTIONS[kind])}")
  for key, known in _FIELDS.items():
    section = key[-1]
    if (len(key) == 1 or key[0] == lm_kind) and config.get(section) is not None:
      unknown = sorted(set(config[section].keys()) - known)
      if unknown:
        raise ValueError(f"{section}: unknown field(s) {unknown}; known: {sorted(known)}")


def resolve(config, check_data: bool = True) -> Experiment:
  """The experiment file's ConfigDict -> a checked Experiment; raises ValueError naming the bad field.

  check_data=False skips what needs the data on this machine (an LM run's vocabulary, tasks,
  train.init_from and held-out documents): --mode=plan reads no data."""
  if config.get("experiment") not in EXPERIMENTS:
    raise ValueError(f"experiment: must be one of {EXPERIMENTS}, got {config.get('experiment')!r}")
  _check_known(config)
  if config.experiment in LM_EXPERIMENTS:
    return _resolve_lm(config, check_data)
  return _resolve_dictionary(config)


def _model_config(config) -> ModelConfig:
  overrides = _plain(config.model.get("overrides", {}))
  cfg = ModelConfig.from_dict(overrides, "model.overrides", base=get_size(config.model.size))
  if not cfg.mem_layers:
    raise ValueError("model.mem_layers: FoT needs at least one memory layer")
  return cfg


def _train_settings(config, arm: str) -> TrainSettings:
  """A training run's settings from an LM experiment's `train` and `optim` (every arm the same), or a
  dictionary-lookup arm's section (`fot` / `baseline`) and `optim`."""
  lm = config.experiment in LM_EXPERIMENTS
  t = config.train if lm else config[arm]
  fields = {"steps": t.get("steps", 0), "seed": config.seed, "loss_on": t.get("loss_on", "all"),
            "accum_steps": t.get("accum_steps", 1), "log_every": t.log_every,
            "checkpoint_every": t.checkpoint_every, "optim": config.optim, "mesh": config.get("mesh"),
            "crossbatch_scope": t.get("crossbatch_scope", "batch")}
  if lm:
    fields.update(init_from=t.get("init_from"), trainable=t.get("trainable"), memory=_train_memory(t.get("memory")))
  return TrainSettings.from_dict(fields, "train" if lm else arm)


def _train_memory(memory):
  """train.memory as TrainSettings reads it: None when absent or `enabled` is False (experiments/base_lm.py
  keeps the section off, so --config.train.memory.enabled=True and its fields work from the command line)."""
  if memory is None:
    return None
  memory = _plain(memory)
  return None if not memory.pop("enabled", True) else memory


def _copy_warmup(config) -> CopyWarmupSettings:
  """The experiment's copy warm-up (`c.warmup`, off without the section). An LM run's names its span,
  slots and ids; the dictionary experiment's spans are its arms' windows, its ids the last
  `num_symbols` of its vocabulary."""
  required = ("span", "slots", "num_symbols") if config.experiment in LM_EXPERIMENTS else ("num_symbols",)
  return CopyWarmupSettings.from_dict(config.get("warmup"), "warmup", required)


def _dictionary_task(config) -> DictionaryTask:
  fields = _plain(config.data)
  known = {f.name for f in dataclasses.fields(DictionaryTask)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"data: unknown field(s) {unknown}; known: {sorted(known)}")
  task = DictionaryTask(**fields)
  task.validate()
  return task


def _schedule(curriculum: Dict[str, Any], section: str) -> Schedule:
  """The curriculum's Schedule; its errors named by their path in the experiment file
  (`train.curriculum.phases[1].steps`, not `curriculum.phases[1].steps`)."""
  try:
    return Schedule(curriculum)
  except ValueError as e:
    raise ValueError(f"{section}.{e}" if str(e).startswith("curriculum") else f"{section}.curriculum: {e}") from None


def _check_plans(sched: Schedule, rows: int, section: str) -> None:
  """Every crossbatch plan of the schedule is buildable for `rows` rows a micro-step; an error names
  the curriculum and the spec besides the crossbatch field."""
  for spec in sched.all_specs():
    try:
      crossbatch.plan_from_spec(rows, spec)
    except ValueError as e:
      raise ValueError(f"{section}.curriculum, spec {spec}: {e}") from None


def _resolve_dictionary(config) -> Experiment:
  """The dictionary-lookup experiment: task, arms, curriculum against the packs, evaluation, mesh."""
  cfg = _model_config(config)
  task = _dictionary_task(config)
  if cfg.vocab_size < task.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.vocab_size} is smaller than the task vocabulary "
                     f"({task.vocab_size} tokens); raise model.overrides.vocab_size")
  arms = {arm: DictionaryArm.from_section(config[arm], arm) for arm in ("fot", "baseline")}
  ts = {arm: _train_settings(config, arm) for arm in arms}  # each arm's training fields checked
  for arm, a in arms.items():
    if task.doc_len % a.window:
      raise ValueError(f"{arm}.window={a.window} must divide the document length {task.doc_len}")
  fot, base = arms["fot"], arms["baseline"]
  if fot.disjoint_keys:
    task.check_disjoint(fot.slots, "fot.slots")
  curriculum = _plain(config.fot.curriculum)
  sched = _schedule(curriculum, "fot")
  warmup = _copy_warmup(config)
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
  _check_plans(sched, rows // accum, "fot")
  crossbatch.scored_rows(rows, pack, ts["fot"].loss_on)
  validate_mesh(ts["fot"].mesh, cfg, rows // accum, ts["fot"].crossbatch_scope, fot.window, "fot.window")
  ev = DictionaryEvalSettings.from_dict(config.eval, "eval")
  for m in ev.memory_tokens:
    if m % task.defs_len:
      raise ValueError(f"eval.memory_tokens: {m} is not a multiple of the definition block "
                       f"({task.defs_len} tokens)")
    for arm, a in arms.items():
      if m + task.queries_len > a.window and m % a.window:
        raise ValueError(f"eval.memory_tokens: {m} must be a multiple of {arm}.window={a.window}")
  seeds = (int(config.seed),) + tuple(int(s) for s in config.get("extra_seeds", ()))
  parts = DictionaryExperiment(task=task, arms=arms, baseline_train=ts["baseline"], eval=ev, seeds=seeds,
                               run_fields={a: _dictionary_run_fields(config, arms, a) for a in arms})
  return Experiment(kind=config.experiment, model=cfg, train=ts["fot"], curriculum=curriculum, warmup=warmup,
                    raw=config.to_dict(), dictionary=parts)


def _repeat_feed(data: LMDataSettings, name: str) -> RepeatFeed:
  v = _plain(data.repeats[name])
  unknown = sorted(set(v) - set(REPEAT_FIELDS))
  if unknown:
    raise ValueError(f"data.repeats.{name}: unknown field(s) {unknown}; known: {list(REPEAT_FIELDS)}")
  return RepeatFeed(task=str(v.get("task") or data.corpus), fraction=float(v.get("fraction", 1.0)),
                    score_first=bool(v.get("score_first", True)))


def _retrieval_feed(data: LMDataSettings, name: str) -> RetrievalSpec:
  """Retrieval documents (fields of data_pipelines.retrieval_docs.RetrievalSpec); natural-text slots
  and 'text' haystacks read the corpus unless the view names its own `text_task` / `haystack_task`."""
  fields = _plain(data.retrieval[name])
  if fields.get("text_slots") and not fields.get("text_task"):
    fields["text_task"] = data.corpus
  haystacks = tuple(fields.get("haystacks") or ())  # the memory haystack's kinds too, when it makes one
  if fields.get("memory_tokens"):
    haystacks += tuple(fields.get("memory_haystacks") or RetrievalSpec.memory_haystacks)
  if "text" in haystacks and not fields.get("haystack_task"):
    fields["haystack_task"] = data.corpus
  spec = RetrievalSpec.from_dict(fields, f"data.retrieval.{name}")
  spec.validate(f"data.retrieval.{name}", data.windows_per_slot)
  return spec


def _check_memory_feeds(ts: TrainSettings, feeds) -> None:
  """train.memory reads the haystack a phase's retrieval view makes (memory_tokens > 0; phases whose
  data makes none, such as a copy warm-up, train without it); a view that makes one is read only
  with train.memory."""
  making = {task: isinstance(f, RetrievalSpec) and f.memory_tokens > 0 for task, f in feeds.items()}
  if ts.memory is not None and not any(making.values()):
    raise ValueError(f"train.memory: no phase's data makes a memory haystack (a data.retrieval view with "
                     f"memory_tokens > 0); the curriculum's tasks {[str(t) for t in making]} make none")
  if ts.memory is None and any(making.values()):
    views = [str(t) for t, m in making.items() if m]
    raise ValueError(f"data.retrieval {views}: memory_tokens > 0 makes a haystack that only train.memory reads; "
                     f"set --config.train.memory.enabled=True (window 512, topk 32, refresh 5 unless set) or "
                     f"memory_tokens=0")


def _lm_feeds(data: LMDataSettings, sched: Schedule, warmup: CopyWarmupSettings) -> Dict[Optional[str], Any]:
  """One typed feed per task the curriculum names (None: data.task): the copy warm-up (`warmup.task`),
  a repeat view (`data.repeats`), retrieval documents (`data.retrieval`), or an LM task by name."""
  feeds = {}
  for task in dict.fromkeys(sched.tasks()):
    if task is None:
      feeds[task] = TextFeed(data.task)
    elif warmup.enabled and task == warmup.task:
      feeds[task] = warmup
    elif task in data.repeats:
      feeds[task] = _repeat_feed(data, task)
    elif task in data.retrieval:
      feeds[task] = _retrieval_feed(data, task)
    else:
      feeds[task] = TextFeed(task)
  return feeds


def _corpus_views(data: LMDataSettings, feeds: Dict[Optional[str], Any], raw_data: Dict[str, Any]) -> tuple:
  """What each text view of an LM run reads: (view, field, task, split) for the training text when a
  phase reads it, every repeat and retrieval view the curriculum uses (a retrieval view without
  natural-text slots reads none), and the held-out evaluation. `field` is the config field that
  chose the task, or 'data.corpus' when the view names none."""
  def chosen(field, value):
    return field if value else "data.corpus"
  out = []
  for task, feed in feeds.items():  # in the curriculum's order
    if task is None:
      out.append(("training text", chosen("data.task", raw_data.get("task")), data.task, data.split))
    elif isinstance(feed, CopyWarmupSettings):
      continue  # random token ids, no text
    elif isinstance(feed, RepeatFeed):
      own = _plain(data.repeats[task]).get("task")
      out.append((f"repeat view {task!r}", chosen(f"data.repeats.{task}.task", own), feed.task, data.split))
    elif isinstance(feed, RetrievalSpec):
      if feed.text_slots:
        own = _plain(data.retrieval[task]).get("text_task")
        out.append((f"retrieval view {task!r} text slots", chosen(f"data.retrieval.{task}.text_task", own),
                    feed.text_task, data.split))
      if feed.reads_text:  # a document's 'text' haystack, or the memory haystack's (train.memory)
        own = _plain(data.retrieval[task]).get("haystack_task")
        out.append((f"retrieval view {task!r} text haystacks", chosen(f"data.retrieval.{task}.haystack_task", own),
                    feed.haystack_task, data.split))
    else:
      out.append((f"curriculum task {task!r}", "train.curriculum", task, data.split))
  out.append(("held-out evaluation", chosen("data.eval_task", raw_data.get("eval_task")), data.eval_task,
              data.eval_split))
  return tuple(out)


def _resolve_lm(config, check_data: bool) -> Experiment:
  """Language-model experiments (experiments/base_lm.py fields): model, optimizer, curriculum against
  the batch shape, feeds, evaluation, the mesh and, for 'baselines', the arms. check_data: also load
  the vocabulary, resolve the tasks, find train.init_from and read the held-out documents."""
  cfg, data, t = _model_config(config), LMDataSettings.from_dict(config.data, "data"), config.train
  if check_data and t.get("init_from"):  # a file-system check: before the data's imports
    check_init_from(str(t.init_from))
  ts = _train_settings(config, "fot")
  curriculum = _plain(t.curriculum)
  sched = _schedule(curriculum, "train")
  warmup = _copy_warmup(config)
  feeds = _lm_feeds(data, sched, warmup)
  _check_memory_feeds(ts, feeds)
  lm = LMExperiment(data=data, eval=LMEvalSettings.from_dict(config.eval, "eval"), feeds=feeds,
                    views=_corpus_views(data, feeds, _plain(config.data)),
                    no_crossbatch=bool(config.get("baseline", {}).get("enabled", False)),
                    run_fields=_lm_run_fields(config))
  if check_data:
    from data_pipelines import tasks, vocab as vocab_lib  # TensorFlow/SeqIO: only LM runs need them
    vocab = vocab_lib.get_vocabulary(data.vocab)
    vocab_lib.check_fits(vocab.vocab_size, cfg.vocab_size)
    named = [("data.corpus", data.corpus), ("data.task", data.task)]  # named, even where no phase reads it
    for field, task in named + [(field, task) for _, field, task, _ in lm.views]:
      try:
        tasks.get_provider(task)
      except ValueError as e:
        raise ValueError(f"{field}={task!r}: {str(e).removeprefix('data.task: ')}") from None
  rows, k, accum = data.slots * data.windows_per_slot, data.windows_per_slot, ts.accum_steps
  if sched.pack not in (1, k):
    raise ValueError(f"train.curriculum: pack size k={sched.pack} (w + 1 or len(segments)) must equal "
                     f"data.windows_per_slot={k}")
  if data.slots % accum:
    raise ValueError(f"train.accum_steps={accum} must divide data.slots={data.slots} "
                     f"(gradient accumulation never splits a pack)")
  _check_plans(sched, rows // accum, "train")
  for spec in sched.all_specs():
    rspec = recurrent.recurrent_spec(spec)  # the Memorizing Transformer / Transformer-XL phases
    if rspec is not None:
      recurrent.check(rspec, cfg, data.window)
  warmup_phases = [p for p in sched.phases if warmup.enabled and p.get("task") == warmup.task]
  if warmup_phases:
    copy = warmup.copy_task()  # copy documents: two windows of `span` tokens per slot
    copy.validate()
    if copy.vocab_size > cfg.vocab_size:
      raise ValueError(f"warmup: symbol ids {copy.symbol_offset}..{copy.vocab_size - 1} do not fit the "
                       f"model's vocabulary of {cfg.vocab_size}")
  for phase in warmup_phases:
    crossbatch.plan_from_spec(2 * warmup.slots // accum, phase["spec"])  # two windows per warm-up slot
  for task, feed in feeds.items():
    if isinstance(feed, RepeatFeed) and (k < 2 or not 0.0 < feed.fraction <= 1.0):
      raise ValueError(f"data.repeats.{task}: needs data.windows_per_slot >= 2 (got {k}) and a fraction in "
                       f"(0, 1] (got {feed.fraction})")
  crossbatch.scored_rows(rows, k, ts.loss_on)
  resolve_trainable(ts.trainable, cfg)  # a pattern that matches no parameter fails here
  validate_mesh(ts.mesh, cfg, rows // accum, ts.crossbatch_scope, data.window, "data.window")
  baselines = None
  if config.experiment == "baselines":
    baselines = BaselinesSettings.from_dict(config.baselines, "baselines")
    spec = recurrent.recurrent_spec({"memory": "memorizing", "memory_tokens": baselines.memory_tokens,
                                     "topk": baselines.topk})
    recurrent.check(spec, cfg, data.window)
    if warmup.enabled:  # the copy warm-up's windows hold memory too
      recurrent.check(spec, cfg, warmup.span)
  if check_data:  # last: it reads and tokenizes held-out documents
    lm = dataclasses.replace(lm, eval_docs=tuple(_held_out_documents(lm, vocab)))
  return Experiment(kind=config.experiment, model=cfg, train=ts, curriculum=curriculum, warmup=warmup,
                    raw=config.to_dict(), lm=lm, baselines=baselines)


def _held_out_documents(lm: LMExperiment, vocab) -> list:
  """The held-out documents (`bos doc eos`, stored order) the LM evaluation scores: eval.n_docs of
  data.eval_task's split data.eval_split, each long enough for the largest memory size plus the
  scored tail. resolve reads them before the first step, so a held-out split too short for the
  evaluation fails then, not after the training time is spent; the error says which sizes would fit."""
  from data_pipelines import pipeline, vocab as vocab_lib  # TensorFlow/SeqIO, as resolve's task checks
  ids = vocab_lib.special_ids(vocab)
  return _eval_documents(lm, pipeline.document_tokens(lm.data.eval_task, vocab, lm.data.eval_split, seed=None),
                        ids["bos"], ids["eos"])


def _eval_documents(lm: LMExperiment, documents, bos: int, eos: int) -> list:
  """_held_out_documents from `documents` (the held-out split's token arrays in stored order)."""
  data, ev = lm.data, lm.eval
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


INIT_FROM_HINT = ("make one with `python -m fot_jax.convert import_hf --hf_dir DIR --out CKPT`, or give a "
                  "training arm's workdir such as runs/NAME/fot")


def check_init_from(path: str) -> None:
  """`train.init_from` looks like an fot_jax checkpoint (a directory with a readable
  fot_jax_model.json and parameters), so a wrong path fails before any data is read or step
  compiled; the parameters themselves are checked when they are loaded."""
  if not os.path.exists(path):
    if os.path.basename(os.path.normpath(path)) == "fot":  # a training arm's workdir: an earlier stage
      raise ValueError(f"train.init_from: no checkpoint at {path!r}: this run starts from another training "
                       f"run's model; train that run first (its --workdir is {os.path.dirname(os.path.normpath(path))!r}; "
                       f"the experiment file's docstring names it) or point train.init_from elsewhere")
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


def validate_mesh(mesh_cfg, cfg: ModelConfig, micro_rows: int, scope: str, window: int, window_field: str) -> None:
  """Rules, sizes, and (when no size is -1) divisibility of parameters, the window over the context
  axis (`window_field` names it) and batch rows."""
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
    context_parallel.check_length(window, context, cfg.context_layout, window_field)
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
