"""Typed, validated sections of an experiment's settings: each is read from its dict once, by one
validator whose errors name the field, and what runs below takes the object. Light (no JAX; NumPy for
the copy task), so entry points and the study's config checks use it before anything heavy loads.

  OptimSettings  `c.optim` of an experiment, `finetune.optim` of a study: AdamW with a constant or
                 cosine learning-rate schedule (fot_jax.train.make_optimizer builds it).
  TrainSettings  one training run (fot_jax.train.train takes it): steps, optimiser, seed, scoring,
                 accumulation, cadences, init_from, mesh, crossbatch scope, trainable parameters;
                 configs.resolve builds it from the experiment's sections, the study from its fine-tune's.
  LMDataSettings an LM experiment's `c.data`: the corpus and the views that read it, vocabulary and
                 slot batch shape.
  LMEvalSettings an LM experiment's `c.eval`: perplexity against memory size.
  DictionaryArm, DictionaryEvalSettings  the dictionary-lookup experiment's arms (`c.fot`,
                 `c.baseline`: their batch shape) and evaluation (accuracy against memory, r_d).
  CopyWarmupSettings  `c.warmup` of either experiment: the copy warm-up's ids, span and slots.
  TextFeed, RepeatFeed  an LM curriculum task's text, as is or with repeated windows.
  BaselinesSettings   the 'baselines' experiment's arms, seeds and Memorizing Transformer memory.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Mapping, Optional, Tuple

from data_pipelines.copy_task import CopyTask

SCHEDULES = ("constant", "cosine")


def _number(value, where: str, kind=float):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
    raise ValueError(f"{where}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
  return kind(value)


def _bound(least: int) -> str:
  return "positive" if least == 1 else f">= {least}"


def _at_least(value: int, where: str, least: Optional[int]) -> int:
  """value, or an error naming `where` when it is below `least` (None: no bound)."""
  if least is not None and value < least:
    raise ValueError(f"{where}: must be {_bound(least)}, got {value}")
  return value


def _ints(d: Mapping[str, Any], names, where: str, least: Optional[int]) -> Dict[str, int]:
  """The integer fields `names` that d holds, each at least `least`; errors name `where.FIELD`."""
  return {n: _at_least(_number(d[n], f"{where}.{n}", int), f"{where}.{n}", least) for n in names if n in d}


def _int_list(values, where: str, least: int) -> Tuple[int, ...]:
  """A non-empty list of integers, each at least `least` (memory sizes, d values)."""
  if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__") or not list(values):
    raise ValueError(f"{where}: a list of integers, got {values!r}")
  out = tuple(_number(v, where, int) for v in values)
  if min(out) < least:
    raise ValueError(f"{where}: must be {_bound(least)}, got {list(out)}")
  return out


def _dict(value, where: str, what: str) -> Dict[str, Any]:
  """A dict field (a ConfigDict or a mapping) as a plain dict; `what` says what it holds in the error."""
  if not hasattr(value, "keys"):
    raise ValueError(f"{where}: {what}, got {value!r}")
  return dict(value)


def _known_fields(cls, d, where: str) -> Dict[str, Any]:
  """d (a dict or a ConfigDict) as a plain dict; a field cls does not have fails naming it."""
  d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(d) - set(known))
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown}; known: {known}")
  return d


@dataclasses.dataclass(frozen=True)
class OptimSettings:
  """AdamW: lr (peak), warmup_steps (linear from 0), schedule ('constant', or 'cosine' decaying to
  final_lr_fraction x lr at total_steps), weight_decay, clip_norm (0: none), b1, b2."""
  lr: float
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 0
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  clip_norm: float = 0.0
  b1: float = 0.9
  b2: float = 0.95

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "optim") -> "OptimSettings":
    """The one reader of optimiser settings: unknown fields and bad values fail naming `where.FIELD`."""
    if isinstance(d, OptimSettings):
      return d
    d = _known_fields(cls, d, where)
    if "lr" not in d:
      raise ValueError(f"{where}.lr: required (the peak learning rate)")
    out = {}
    for f in dataclasses.fields(cls):
      if f.name in d and f.name != "schedule":
        out[f.name] = _number(d[f.name] if d[f.name] is not None else 0, f"{where}.{f.name}",
                              int if f.name.endswith("_steps") else float)
    schedule = d.get("schedule", "constant")
    if schedule not in SCHEDULES:
      raise ValueError(f"{where}.schedule: must be 'constant' or 'cosine', got {schedule!r}")
    s = cls(schedule=schedule, **out)
    if not s.lr > 0:
      raise ValueError(f"{where}.lr: must be positive, got {s.lr}")
    for name in ("warmup_steps", "total_steps", "final_lr_fraction", "weight_decay", "clip_norm"):
      if getattr(s, name) < 0:
        raise ValueError(f"{where}.{name}: must not be negative, got {getattr(s, name)}")
    for name in ("b1", "b2"):
      if not 0 <= getattr(s, name) < 1:
        raise ValueError(f"{where}.{name}: must be in [0, 1), got {getattr(s, name)}")
    return s


@dataclasses.dataclass(frozen=True)
class MemorySettings:
  """Training beside a long forward-only memory (train.memory; fot_jax/train/far_memory.py): the
  data's memory haystack (data.retrieval.memory_tokens) written window by window (`window`
  tokens, each window's memory layers reading the memory before it, their top `topk` entries) by
  the model being trained, without gradient, every `refresh` steps; every row's memory layers
  read its top `topk` entries per query beside the window and the crossbatch contexts."""
  window: int = 512
  topk: int = 32
  refresh: int = 5

  @classmethod
  def from_dict(cls, d, where: str = "train.memory") -> "MemorySettings":
    if isinstance(d, MemorySettings):
      return d
    d = _known_fields(cls, _dict(d, where, "a dict of window, topk, refresh"), where)
    return cls(**_ints(d, ("window", "topk", "refresh"), where, 1))


LOSS_ON = ("all", "last")
CROSSBATCH_SCOPES = ("batch", "device")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """One training run's settings (fot_jax.train.train): steps, the optimiser, seed, loss_on ('all'
  rows scored, or only each pack's 'last' window), accum_steps (gradient accumulation; never splits
  a pack), log_every, checkpoint_every (0: at the end only), tensorboard, init_from (an fot_jax
  checkpoint to start from; '' none), mesh (parallel.make_mesh's sizes and rules as a dict; None: data
  parallel over all devices), crossbatch_scope ('batch': negatives from any row of the global batch,
  'device': only from rows on the same device), trainable (resolve_trainable's patterns; None: all),
  memory (MemorySettings: read a long memory written without gradient beside the crossbatch contexts;
  None: no memory)."""
  steps: int
  optim: OptimSettings
  seed: int = 0
  loss_on: str = "all"
  accum_steps: int = 1
  log_every: int = 10
  checkpoint_every: int = 0
  tensorboard: bool = True
  init_from: str = ""
  mesh: Optional[Dict[str, Any]] = None
  crossbatch_scope: str = "batch"
  trainable: Optional[Tuple[str, ...]] = None
  memory: Optional[MemorySettings] = None

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "train") -> "TrainSettings":
    """The one reader of a run's train settings (`optim` read by OptimSettings); errors name the field."""
    if isinstance(d, TrainSettings):
      return d
    d = _known_fields(cls, d, where)
    for name in ("steps", "optim"):
      if name not in d:
        raise ValueError(f"{where}.{name}: required")
    out = {"optim": OptimSettings.from_dict(d["optim"], "optim")}
    for name, least in (("steps", 0), ("seed", None), ("accum_steps", 1), ("log_every", 1), ("checkpoint_every", 0)):
      if name in d:
        out[name] = _number(d[name], f"{where}.{name}", int)
        if least is not None and out[name] < least:
          raise ValueError(f"{where}.{name}: must be at least {least}, got {out[name]}")
    for name, choices in (("loss_on", LOSS_ON), ("crossbatch_scope", CROSSBATCH_SCOPES)):
      if name in d and d[name] not in choices:
        raise ValueError(f"{where}.{name}: must be one of {choices}, got {d[name]!r}")
      out[name] = d.get(name, getattr(cls, name))
    if "tensorboard" in d:
      out["tensorboard"] = bool(d["tensorboard"])
    out["init_from"] = str(d.get("init_from") or "")
    mesh = d.get("mesh")
    out["mesh"] = dict(mesh.to_dict() if hasattr(mesh, "to_dict") else mesh) if mesh else None
    trainable = d.get("trainable")
    if trainable is not None and not isinstance(trainable, str):
      trainable = tuple(str(x) for x in trainable)
    out["trainable"] = trainable
    if d.get("memory") is not None:
      out["memory"] = MemorySettings.from_dict(d["memory"], f"{where}.memory")
    return cls(**out)

  def to_dict(self) -> Dict[str, Any]:
    """Every field, the optimiser's too, as JSON would hold them (the run's fingerprint)."""
    return json.loads(json.dumps(dataclasses.asdict(self)))


MEMORY_READS = ("dense", "topk")


@dataclasses.dataclass(frozen=True)
class LMEvalSettings:
  """An LM experiment's evaluation (`c.eval`): perplexity of each held-out document's last
  score_tokens tokens with memory_tokens tokens of it before them in memory, for every size; n_docs
  documents, batch rows at a time; memory read densely or top-k (topk keys per query); doc_mode
  'single_doc' (the document's own earlier windows only)."""
  memory_tokens: Tuple[int, ...] = (0, 2048, 8192, 32768)
  score_tokens: int = 512
  n_docs: int = 16
  batch: int = 8
  mode: str = "dense"
  topk: int = 32
  doc_mode: str = "single_doc"

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "eval") -> "LMEvalSettings":
    d = _known_fields(cls, d, where)
    out = _ints(d, ("score_tokens", "n_docs", "batch", "topk"), where, 1)
    if "memory_tokens" in d:
      out["memory_tokens"] = _int_list(d["memory_tokens"], f"{where}.memory_tokens", 0)
    if d.get("mode", "dense") not in MEMORY_READS:
      raise ValueError(f"{where}.mode: must be 'dense' or 'topk', got {d['mode']!r}")
    if d.get("doc_mode", "single_doc") != "single_doc":
      raise ValueError(f"{where}.doc_mode: only 'single_doc' is implemented, got {d['doc_mode']!r}")
    return cls(mode=d.get("mode", "dense"), **out)


@dataclasses.dataclass(frozen=True)
class LMDataSettings:
  """An LM experiment's data (`c.data`): `corpus`, the text the experiment names once (a SeqIO task
  or mixture, `files:PATTERN` or `jsonl:PATTERN`), read in `vocab` ('byte', a SentencePiece model or
  a tokenizer.json) into `slots` document streams over all hosts, each row `window` tokens and
  `windows_per_slot` consecutive rows per slot (one pack); documents shorter than min_doc_len
  dropped, longer than max_doc_len truncated (0: never). Every text view reads the corpus unless it
  names its own: `task` (the training text, split `split`), `eval_task` (the held-out documents of
  the evaluation, split `eval_split`), a repeat view's `task` and a retrieval view's `text_task`
  (configs.resolve makes each a typed feed; `Experiment.lm.views` lists what each reads).
  '' (or absent) means the corpus; an experiment that sets only `task` (files written before the
  corpus field) has that task as its corpus. `repeats` and `retrieval` name extra curriculum tasks."""
  vocab: str
  slots: int
  windows_per_slot: int
  window: int
  corpus: str = ""
  task: str = ""
  split: str = "train"
  min_doc_len: int = 1
  max_doc_len: int = 0
  eval_task: str = ""
  eval_split: str = "validation"
  repeats: Dict[str, Any] = dataclasses.field(default_factory=dict)
  retrieval: Dict[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "data") -> "LMDataSettings":
    d = _known_fields(cls, d, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
      raise ValueError(f"{where}: missing field(s) {missing}")
    out = {**_ints(d, ("slots", "windows_per_slot", "window", "min_doc_len"), where, 1),
           **_ints(d, ("max_doc_len",), where, 0)}
    for name in ("corpus", "task", "vocab", "split", "eval_task", "eval_split"):
      if name in d:
        if not isinstance(d[name], str):
          raise ValueError(f"{where}.{name}: must be a string, got {d[name]!r}")
        out[name] = d[name]
    for name in ("repeats", "retrieval"):
      if d.get(name) is not None:
        out[name] = _dict(d[name], f"{where}.{name}", "a dict of curriculum task name -> its settings")
    out["corpus"] = out.get("corpus") or out.get("task") or ""
    if not out["corpus"]:
      raise ValueError(f"{where}.corpus: required: the text every view reads (a registered task such as "
                       f"'stdlib', files:PATTERN or jsonl:PATTERN)")
    for name in ("task", "eval_task"):  # '' or absent: the corpus
      out[name] = out.get(name) or out["corpus"]
    return cls(**out)


@dataclasses.dataclass(frozen=True)
class DictionaryArm:
  """A dictionary-lookup arm's batch shape (`c.fot`, `c.baseline`; their training fields are
  TrainSettings'): rows of `window` tokens, `slots` documents per step, whether the FoT arm's
  documents in one step share no key (negatives that never contradict the positive); `enabled`:
  whether the arm runs (the baseline's switch)."""
  window: int
  slots: int
  disjoint_keys: bool = False
  enabled: bool = True

  @classmethod
  def from_section(cls, d: Mapping[str, Any], where: str) -> "DictionaryArm":
    """The arm's shape fields from its section (which also holds TrainSettings' and its curriculum)."""
    for name in ("window", "slots"):
      if name not in d:
        raise ValueError(f"{where}.{name}: required")
    out = _ints(d, ("window", "slots"), where, 1)
    return cls(disjoint_keys=bool(d.get("disjoint_keys", False)), enabled=bool(d.get("enabled", True)), **out)


@dataclasses.dataclass(frozen=True)
class DictionaryEvalSettings:
  """The dictionary-lookup experiment's evaluation (`c.eval`): accuracy with memory_tokens tokens of
  other documents' definitions before the queries, n_docs documents (seeded by `seed`), memory read
  densely or top-k (topk keys per query), batch rows at a time, chunk query tokens per attention
  call; r_d with each d of rd_ds documents in memory."""
  memory_tokens: Tuple[int, ...]
  n_docs: int = 16
  mode: str = "topk"
  topk: int = 32
  batch: int = 16
  chunk: int = 8192
  seed: int = 1234
  rd_ds: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "eval") -> "DictionaryEvalSettings":
    d = _known_fields(cls, d, where)
    if "memory_tokens" not in d:
      raise ValueError(f"{where}.memory_tokens: required")
    out = {**_ints(d, ("n_docs", "topk", "batch", "chunk"), where, 1), **_ints(d, ("seed",), where, None)}
    for name in ("memory_tokens", "rd_ds"):
      if name in d:
        out[name] = _int_list(d[name], f"{where}.{name}", 1)
    if d.get("mode", "topk") not in MEMORY_READS:
      raise ValueError(f"{where}.mode: must be 'dense' or 'topk', got {d['mode']!r}")
    return cls(mode=d.get("mode", "topk"), **out)


@dataclasses.dataclass(frozen=True)
class CopyWarmupSettings:
  """A copy warm-up (`c.warmup`): a span of random token ids, then the same span again, so that
  the repeat can only be read through the memory layer (the induction circuit forms in seconds).
  `num_symbols` ids from `symbol_offset` (the dictionary experiment takes the last ids of its
  vocabulary and its arms' window as the span), `distinct`: ids within a span never repeat;
  `baseline_chunks`: the no-crossbatch arm's repeat in that many shuffled pieces (no fixed-offset
  copy to learn); `task`: the curriculum task name its phases use; `slots`: copy documents per step
  (an LM run's; the dictionary experiment uses its arm's slots)."""
  enabled: bool = False
  task: str = "copy"
  span: int = 0
  slots: int = 0
  num_symbols: int = 0
  symbol_offset: int = 0
  baseline_chunks: int = 1
  distinct: bool = False

  @classmethod
  def from_dict(cls, d: Optional[Mapping[str, Any]], where: str = "warmup",
                required: Tuple[str, ...] = ()) -> "CopyWarmupSettings":
    """None (no section): no warm-up. A section is on unless it says `enabled: False`; then each
    of `required` (the experiment's) must be positive."""
    if d is None:
      return cls()
    d = _known_fields(cls, d, where)
    out = {"enabled": bool(d.get("enabled", True)), "distinct": bool(d.get("distinct", False))}
    if not isinstance(d.get("task", "copy"), str) or not d.get("task", "copy"):
      raise ValueError(f"{where}.task: a curriculum task name, got {d['task']!r}")
    out["task"] = d.get("task", "copy")
    out.update(_ints(d, ("span", "slots", "num_symbols", "symbol_offset"), where, 0))
    out.update(_ints(d, ("baseline_chunks",), where, 1))
    s = cls(**out)
    for name in required if s.enabled else ():
      if getattr(s, name) <= 0:
        raise ValueError(f"{where}.{name}: required (a positive integer) while the warm-up is enabled")
    return s

  def copy_task(self, arm: str = "fot") -> CopyTask:
    """An LM run's copy documents: spans of `span` random token ids (`num_symbols` ids from
    `symbol_offset`), repeated. The no-crossbatch arm's repeat comes in `baseline_chunks` shuffled
    pieces (its documents sit whole in one row, where a fixed-offset copy would not transfer)."""
    return CopyTask(span=self.span, num_symbols=self.num_symbols, symbol_offset=self.symbol_offset,
                    chunks=1 if arm == "fot" else self.baseline_chunks, distinct=self.distinct)


@dataclasses.dataclass(frozen=True)
class TextFeed:
  """An LM curriculum task that trains on text as it is: `task` (a SeqIO task or mixture,
  files:PATTERN or jsonl:PATTERN) in the run's slot batches."""
  task: str


@dataclasses.dataclass(frozen=True)
class RepeatFeed:
  """A repeat view (`c.data.repeats[name]`): text of `task` in which a `fraction` of the slots
  repeat their first window in every later one (data_pipelines.copy_task.RepeatedWindows);
  score_first: that first window is scored too."""
  task: str
  fraction: float = 1.0
  score_first: bool = True


# An LM curriculum task's feed (configs.resolve makes one per task) is one of: TextFeed, RepeatFeed,
# data_pipelines.retrieval_docs.RetrievalSpec or CopyWarmupSettings (the copy warm-up on random ids).
REPEAT_FIELDS = tuple(f.name for f in dataclasses.fields(RepeatFeed))


BASELINE_ARMS = ("fot", "memorizing", "transformer_xl", "plain", "hybrid")
BASELINE_SUITES = ("rd", "passkey")


@dataclasses.dataclass(frozen=True)
class BaselinesSettings:
  """The 'baselines' experiment's `c.baselines`: the arms (FoT first: the others follow its phases),
  the seeds (every arm on the first, `extra_seed_arms` on the others), the Memorizing Transformer's
  training memory (`memory_tokens` per slot, `topk` keys per query, 0: all), the hybrid's memorizing
  tail (`hybrid_steps`), and the evaluation suites run per arm on the first seed (`rd`, `passkey`:
  their settings over the suite's defaults)."""
  arms: Tuple[str, ...]
  seeds: Tuple[int, ...]
  memory_tokens: int
  extra_seed_arms: Tuple[str, ...] = ()
  topk: int = 0
  hybrid_steps: int = 0
  suites: Tuple[str, ...] = ()
  rd: Dict[str, Any] = dataclasses.field(default_factory=dict)
  passkey: Dict[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "baselines") -> "BaselinesSettings":
    """extra_seed_arms defaults to every arm; names outside `arms` are allowed there (a run of fewer
    arms keeps the file's list) and not run."""
    d = _known_fields(cls, d, where)
    arms = tuple(str(a) for a in d.get("arms", ()))
    if sorted(set(arms) - set(BASELINE_ARMS)) or not arms or arms[0] != "fot":
      raise ValueError(f"{where}.arms: 'fot' first, then any of {BASELINE_ARMS}; got {list(arms)}")
    seeds = tuple(_number(s, f"{where}.seeds", int) for s in d.get("seeds", ()))
    if not seeds:
      raise ValueError(f"{where}.seeds: at least one seed")
    extra = tuple(str(a) for a in d.get("extra_seed_arms", arms))
    if len(seeds) > 1 and (sorted(set(extra) - set(BASELINE_ARMS)) or "fot" not in extra):
      raise ValueError(f"{where}.extra_seed_arms: 'fot' (the others follow its phases) and any of "
                       f"{BASELINE_ARMS}; got {list(extra)}")
    if "memory_tokens" not in d:
      raise ValueError(f"{where}.memory_tokens: required (the Memorizing Transformer's training memory)")
    out = _ints(d, ("memory_tokens", "topk", "hybrid_steps"), where, 0)
    if "hybrid" in arms and out.get("hybrid_steps", 0) <= 0:
      raise ValueError(f"{where}.hybrid_steps: must be positive, got {d.get('hybrid_steps')}")
    suites = tuple(str(s) for s in d.get("suites", ()))
    unknown = sorted(set(suites) - set(BASELINE_SUITES))
    if unknown:
      raise ValueError(f"{where}.suites: any of {BASELINE_SUITES}, got {unknown}")
    for name in ("rd", "passkey"):
      if d.get(name) is not None:
        out[name] = _dict(d[name], f"{where}.{name}", f"the {name} suite's settings (a dict)")
    return cls(arms=arms, seeds=seeds, extra_seed_arms=extra, suites=suites, **out)

  def arms_of_seed(self, seed: int) -> Tuple[str, ...]:
    """The arms trained with `seed`: all on the first seed, those of extra_seed_arms on the others."""
    return self.arms if seed == self.seeds[0] else tuple(a for a in self.arms if a in self.extra_seed_arms)
