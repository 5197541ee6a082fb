"""The study file read once into frozen settings, without loading a model, TensorFlow or JAX:
StudySettings (the base, lengths, suites, the study's perplexity and suite settings) with a
MethodSpec per method (inference path, ModelConfig overrides, its own MemoryRetrieval, its resolved
FinetuneSettings), the settings a finished method's results depend on, and the table's labels.
`python -m fot_jax.study` reads it before anything heavy is imported, so a bad study file fails in
one line at once, and everything below takes these objects. Errors name the method and the field.
select_methods is the study files' own helper, on their method entries as written."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from fot_jax.eval.settings import SuiteSettings
from fot_jax.model.config import BlockSpec
from fot_jax.settings import OptimSettings

INFERENCE_PATHS = ("plain", "memory")
SUITES = ("ppl", "passkey", "niah", "rd")
METHOD_KEYS = ("name", "inference", "overrides", "window", "finetune", "memory")
# a method's `memory` retrieval: per mode, its fields (fot_jax.inference.MemoryInference's arguments)
MEMORY_FIELDS = {"dense": (), "topk": ("topk",), "approx_topk": ("topk",),
                 "blocks": ("block_size", "block_reps", "block_topk")}
CONFIG_KEYS = ("base", "lengths", "methods", "suites", "pad", "ppl", "eval")  # and, optional, finetune
BASE_KEYS = ("checkpoint", "missing_hint", "train")
FINETUNE_FIELDS = ("steps", "optim", "task", "vocab", "split", "slots", "length", "seed", "min_doc_len",
                   "crossbatch", "checkpoint_every", "log_every", "tensorboard")
_SPEC_KINDS = {"constant": ("spec",), "metric": ("before", "after")}  # where each kind keeps its specs


def _json(x) -> Any:
  """x as JSON holds it (a ConfigDict as a dict, tuples as lists): what results record and compare."""
  return json.loads(json.dumps(x.to_dict() if hasattr(x, "to_dict") else x, default=list))


def _is_int(value, least: int) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= least


@dataclasses.dataclass(frozen=True)
class MemoryRetrieval:
  """A method's own memory retrieval, read as MemoryInference's mode and fields: 'dense'; 'topk' /
  'approx_topk' with topk (memory tokens attended per query, required); 'blocks' with block_size,
  block_reps, block_topk (each defaulting to BlockSpec's: 128, 16, 8). Fields of other modes stay 0."""
  mode: str
  topk: int = 0
  block_size: int = 0
  block_reps: int = 0
  block_topk: int = 0

  @classmethod
  def of_method(cls, method: Mapping[str, Any]) -> Optional["MemoryRetrieval"]:
    """The `memory` of a method entry (None without one: the suite settings' mode / topk); only
    for the memory path. Errors name the method and the field."""
    name = method.get("name", "?")
    mem = method.get("memory")
    if mem is None:
      return None
    if not hasattr(mem, "keys"):
      raise ValueError(f"study method {name!r}: memory must be a dict such as {{'mode': 'blocks', 'block_size': 128, "
                       f"'block_reps': 16, 'block_topk': 8}}, got {mem!r}")
    mem = dict(mem)
    if method.get("inference", "plain") != "memory":
      raise ValueError(f"study method {name!r}: memory (its memory retrieval) needs inference 'memory', "
                       f"got inference {method.get('inference', 'plain')!r}")
    mode = mem.get("mode")
    if mode not in MEMORY_FIELDS:
      raise ValueError(f"study method {name!r}: memory.mode must be one of {list(MEMORY_FIELDS)}, got {mode!r}")
    fields = MEMORY_FIELDS[mode]
    unknown = sorted(set(mem) - {"mode"} - set(fields))
    if unknown:
      raise ValueError(f"study method {name!r}: memory field(s) {unknown} unknown for mode {mode!r}; "
                       f"its fields: {list(fields)}")
    if mode in ("topk", "approx_topk") and "topk" not in mem:
      raise ValueError(f"study method {name!r}: memory.topk is required for mode {mode!r} (memory tokens "
                       "attended per query)")
    defaults = BlockSpec()._asdict() if mode == "blocks" else {}
    out = {}
    for f in fields:
      value = mem.get(f, defaults.get(f))
      if not _is_int(value, 1):
        raise ValueError(f"study method {name!r}: memory.{f} must be a positive integer, got {value!r}")
      out[f] = int(value)
    return cls(mode, **out)

  def to_dict(self) -> Dict[str, Any]:
    """{"mode": M, ...M's fields}: MemoryInference's keyword arguments, and what a method's settings record."""
    return {"mode": self.mode, **{f: getattr(self, f) for f in MEMORY_FIELDS[self.mode]}}


def path_label(inference: str, memory: Optional[MemoryRetrieval]) -> str:
  """The table's path cell: the inference path, with the method's own memory retrieval."""
  if inference != "memory" or memory is None:
    return inference
  if memory.mode == "blocks":
    return f"memory, blocks {memory.block_size} x {memory.block_topk} (reps {memory.block_reps})"
  return f"memory, {memory.mode}" + (f" {memory.topk}" if memory.topk else "")


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
  """A fine-tuned method's training: the study's `finetune` with the method's dict (if `finetune`
  is one) over it. steps; optim (an LM config's c.optim; total_steps defaults to steps); seed (the
  documents' order); task, split, vocab ('' = the base checkpoint's, as the evaluation), slots,
  min_doc_len: the data; length: the extended context L_ft trained at; crossbatch: the memory
  path's spec or curriculum (fot_jax/curriculum.py; a spec {"d": D} without w / segments means
  every window sees all earlier windows of its slot and as many of D - 1 other slots'; None on the
  plain path); checkpoint_every, log_every, tensorboard.
  Every fine-tuned method sees the same tokens per step: `slots` streams of `length` tokens each
  (the plain path: one window of `length`, no crossbatch; the memory path: length / window windows
  of the base's window, with crossbatch)."""
  steps: int
  length: int
  slots: int
  task: str
  optim: OptimSettings
  # the optimiser's fields as the study wrote them (total_steps defaulting to steps): the fine-tune's
  # record compares these, so a fine-tune finished under the same file is never trained again
  optim_fields: Dict[str, Any]
  vocab: str = ""
  split: str = "train"
  seed: int = 0
  min_doc_len: int = 1
  crossbatch: Optional[Dict[str, Any]] = None
  checkpoint_every: int = 0
  log_every: int = 10
  tensorboard: bool = False

  @classmethod
  def of_method(cls, shared: Optional[Mapping[str, Any]], method: Mapping[str, Any]) -> Optional["FinetuneSettings"]:
    """The fine-tune of a method entry (None: a frozen method) over `shared`, the study's
    `finetune` (None: the study has none). Errors name the method and the field."""
    ft = method.get("finetune")
    if not ft:
      return None
    name = method.get("name", "?")
    where = f"study method {name!r}"
    if ft is not True and not hasattr(ft, "keys"):
      raise ValueError(f"{where}: finetune must be True or a dict of finetune fields, got {ft!r}")
    if shared is None:
      raise ValueError(f"{where}: fine-tuned, but the study has no shared `finetune` settings")
    s, own = dict(_json(shared)), (dict(_json(ft)) if ft is not True else {})
    unknown = sorted((set(s) | set(own)) - set(FINETUNE_FIELDS))
    if unknown:
      raise ValueError(f"{where}: unknown finetune field(s) {unknown}; known: {list(FINETUNE_FIELDS)}")
    optim = dict(s.get("optim") or {}, **own.pop("optim", {}))
    s.update(own)
    for f in ("steps", "length", "slots"):
      if not _is_int(s.get(f), 1):
        raise ValueError(f"{where}: finetune.{f} must be a positive integer, got {s.get(f)!r}")
    if not s.get("task") or not isinstance(s["task"], str):
      raise ValueError(f"{where}: finetune.task must name the training data (a SeqIO task)")
    optim.setdefault("total_steps", s["steps"])
    out = {"optim": OptimSettings.from_dict(optim, f"{where}: finetune.optim"), "optim_fields": optim}
    for f, least in (("min_doc_len", 1), ("checkpoint_every", 0), ("log_every", 1)):
      if f in s and not _is_int(s[f], least):
        raise ValueError(f"{where}: finetune.{f} must be an integer >= {least}, got {s[f]!r}")
    if "seed" in s and not _is_int(s["seed"], -2 ** 63):
      raise ValueError(f"{where}: finetune.seed must be an integer, got {s['seed']!r}")
    for f in ("vocab", "split"):
      if f in s and not isinstance(s[f], str):
        raise ValueError(f"{where}: finetune.{f} must be a string, got {s[f]!r}")
    if method.get("inference", "plain") == "plain":
      s.pop("crossbatch", None)  # not the plain path's
    elif not s.get("crossbatch"):
      raise ValueError(f"{where}: a memory method fine-tunes with crossbatch; set finetune.crossbatch "
                       "(e.g. {'d': 2})")
    out.update({k: v for k, v in s.items() if k != "optim"})
    if "tensorboard" in out:
      out["tensorboard"] = bool(out["tensorboard"])
    return cls(**out)

  def to_dict(self) -> Dict[str, Any]:
    """The fine-tune as a method's settings and its fine-tune record hold it (JSON)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if f.name not in ("optim", "optim_fields", "crossbatch")}
    out["optim"] = self.optim_fields
    if self.crossbatch is not None:
      out["crossbatch"] = self.crossbatch
    return _json(out)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One method: its name (it names the result files), inference path ('plain': the whole input in
  one window; 'memory': FoT memory inference), ModelConfig overrides over the base's, the memory
  path's local window (0: the base's), its own memory retrieval (None: the suite settings' mode and
  topk), its fine-tune (None: frozen), and `spec`, the entry as the study file wrote it (JSON): a
  result records it, and a rerun evaluates the method again when it changed."""
  name: str
  inference: str = "plain"
  overrides: Dict[str, Any] = dataclasses.field(default_factory=dict)
  window: int = 0
  memory: Optional[MemoryRetrieval] = None
  finetune: Optional[FinetuneSettings] = None
  spec: Dict[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_dict(cls, m: Mapping[str, Any], shared_finetune: Optional[Mapping[str, Any]] = None,
                index: int = 0) -> "MethodSpec":
    """Method number `index` of a study file (no misspelt key such as 'overides' silently ignored),
    its fine-tune over the study's `shared_finetune`."""
    if not hasattr(m, "keys"):
      raise ValueError(f"study: method {index} is {m!r}, not a dict of {list(METHOD_KEYS)}")
    name = m.get("name")
    if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "_-." for ch in name) \
        or name.startswith("."):
      raise ValueError(f"study: method {index} needs a 'name' of letters, digits, _, - or . (it names its "
                       f"result files), got {name!r}")
    unknown = sorted(set(m.keys()) - set(METHOD_KEYS))
    if unknown:
      raise ValueError(f"study method {name!r}: unknown key(s) {unknown}; a method has {list(METHOD_KEYS)}")
    path = m.get("inference", "plain")
    if path not in INFERENCE_PATHS:
      raise ValueError(f"study method {name!r}: unknown inference path {path!r}; the paths are "
                       f"{list(INFERENCE_PATHS)}")
    if not hasattr(m.get("overrides", {}), "keys"):
      raise ValueError(f"study method {name!r}: overrides must be a dict of ModelConfig fields, "
                       f"got {m['overrides']!r}")
    window = m.get("window")
    if window is not None and not _is_int(window, 0):
      raise ValueError(f"study method {name!r}: window must be a positive integer (0: the base's), got {window!r}")
    return cls(name, path, dict(m.get("overrides", {})), int(window or 0), MemoryRetrieval.of_method(m),
               FinetuneSettings.of_method(shared_finetune, m), _json(m))

  def model_config(self, base_cfg):
    """The base ModelConfig with the method's overrides, validated (errors name the method)."""
    return type(base_cfg).from_dict(self.overrides, f"study method {self.name!r}", base=base_cfg)

  def label(self) -> str:
    return path_label(self.inference, self.memory)

  def describe(self) -> str:
    retrieval = self.label()[len(self.inference):]  # ", blocks 128 x 8 (reps 16)" for its own memory retrieval
    return (f"{self.inference} path{retrieval}" + (f", {self.overrides}" if self.overrides else "")
            + (", fine-tuned" if self.finetune else ""))


@dataclasses.dataclass(frozen=True)
class StudyBase:
  """The base: `checkpoint` (missing_hint: how to make it when it is absent), or, without one,
  `train`, an LM experiment ConfigDict trained once into W/base."""
  checkpoint: str = ""
  missing_hint: str = ""
  train: Any = None  # the base's LM experiment file as written: configs.resolve reads it where it is trained


@dataclasses.dataclass(frozen=True)
class StudyPerplexity:
  """The ppl suite: each held-out document's last score_tokens tokens scored at every study length,
  n_docs documents; the effective length keeps perplexity within tolerance x that at the shortest."""
  score_tokens: int
  n_docs: int
  tolerance: float


@dataclasses.dataclass(frozen=True)
class StudySettings:
  """A study file, read: the base, the lengths L evaluated, the methods, the suites each method
  runs, `pad` (the plain path's inputs padded to a multiple of it), the ppl suite's settings, the
  suite settings of passkey / niah / rd (`eval`, the study's lengths on every grid), and the shared
  `finetune` as written (JSON: study.json records it; each method's FinetuneSettings is read from it)."""
  base: StudyBase
  lengths: Tuple[int, ...]
  methods: Tuple[MethodSpec, ...]
  suites: Tuple[str, ...]
  pad: int
  ppl: StudyPerplexity
  eval: SuiteSettings
  finetune: Optional[Dict[str, Any]] = None

  @classmethod
  def from_dict(cls, config) -> "StudySettings":
    """The one reader of a study file's ConfigDict (get_config()'s): its fields, the suites, every
    method and its fine-tune. Errors name the field or the method."""
    if not hasattr(config, "keys"):
      raise ValueError(f"study: get_config() returned {config!r}, not a ConfigDict")
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
      raise ValueError(f"study: the study config has no {missing}; a study file sets {list(CONFIG_KEYS)}")
    unknown = sorted(set(config.keys()) - set(CONFIG_KEYS) - {"finetune"})
    if unknown:
      raise ValueError(f"study: unknown field(s) {unknown}; a study file sets {list(CONFIG_KEYS)} and finetune")
    suites = tuple(config.suites)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
      raise ValueError(f"study: unknown suite(s) {unknown} in suites; known: {list(SUITES)}")
    lengths = tuple(config.lengths)
    if not lengths or not all(_is_int(x, 1) for x in lengths):
      raise ValueError(f"study: lengths must be positive integers, got {list(lengths)}")
    lengths = tuple(int(x) for x in lengths)
    shared = config.get("finetune")
    if not config.methods:
      raise ValueError("study: no methods")
    methods = tuple(MethodSpec.from_dict(m, shared, i) for i, m in enumerate(config.methods))
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
      raise ValueError(f"study: method names must be unique, got {names}")
    if not _is_int(config.pad, 1):
      raise ValueError(f"study: pad must be a positive integer, got {config.pad!r}")
    suite = SuiteSettings.from_dict(config.eval, "eval")
    suite = dataclasses.replace(suite, passkey=dataclasses.replace(suite.passkey, lengths=lengths),
                                niah=dataclasses.replace(suite.niah, lengths=lengths))
    return cls(_base(config.base), lengths, methods, suites, int(config.pad), _ppl(config.ppl), suite,
               _json(shared) if shared is not None else None)

  def settings_of(self, method: Optional[MethodSpec] = None) -> Dict[str, Any]:
    """What a method's results depend on besides its spec: a finished method is reused only if equal.
    A fine-tuned method's include its resolved fine-tune (a changed one trains and evaluates again),
    a method with its own memory retrieval that retrieval."""
    out = {"lengths": list(self.lengths), "suites": list(self.suites), "pad": self.pad,
           "ppl": dataclasses.asdict(self.ppl), "eval": self.eval.to_dict()}
    if method is not None and method.finetune is not None:
      out["finetune"] = method.finetune.to_dict()
    if method is not None and method.memory is not None:
      out["memory"] = method.memory.to_dict()
    return _json(out)


def _base(base) -> StudyBase:
  if not hasattr(base, "keys"):
    raise ValueError(f"study: base must be a dict of {list(BASE_KEYS)}, got {base!r}")
  unknown = sorted(set(base.keys()) - set(BASE_KEYS))
  if unknown:
    raise ValueError(f"study: unknown base field(s) {unknown}; known: {list(BASE_KEYS)}")
  out = StudyBase(str(base.get("checkpoint") or ""), str(base.get("missing_hint") or ""), base.get("train"))
  if not out.checkpoint and out.train is None:
    raise ValueError("study: set base.checkpoint or base.train (an LM experiment config)")
  return out


def _ppl(ppl) -> StudyPerplexity:
  if not hasattr(ppl, "keys"):
    raise ValueError(f"study: ppl must be a dict of score_tokens, n_docs and tolerance, got {ppl!r}")
  unknown = sorted(set(ppl.keys()) - {"score_tokens", "n_docs", "tolerance"})
  if unknown:
    raise ValueError(f"study: unknown ppl field(s) {unknown}; known: ['score_tokens', 'n_docs', 'tolerance']")
  for f in ("score_tokens", "n_docs"):
    if not _is_int(ppl.get(f), 1):
      raise ValueError(f"study: ppl.{f} must be a positive integer, got {ppl.get(f)!r}")
  tolerance = ppl.get("tolerance")
  if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance <= 0:
    raise ValueError(f"study: ppl.tolerance must be a positive number (1.1: within 10%), got {tolerance!r}")
  return StudyPerplexity(int(ppl["score_tokens"]), int(ppl["n_docs"]), float(tolerance))


def select_methods(methods: List[Dict], only: str, source: str) -> List[Dict]:
  """The methods named in `only` ("NAME,NAME": an experiment file's `--config=FILE:NAME,NAME`;
  empty: all), in the file's order; an unknown name is an error listing the file's methods."""
  names = [n for n in only.split(",") if n]
  if not names:
    return list(methods)
  known = [m["name"] for m in methods]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"{source}: unknown method(s) {unknown}; the methods: {known}")
  return [m for m in methods if m["name"] in names]


def crossbatch_curriculum(crossbatch_cfg: Dict, k: int) -> Dict:
  """finetune.crossbatch as a Schedule config for packs of k windows: a bare spec is a constant
  curriculum; a spec {"d": D} (no w, no segments) becomes segments (j, (D - 1) j) per window j."""
  c = json.loads(json.dumps(crossbatch_cfg))
  if "kind" not in c:
    c = {"kind": "constant", "spec": c}

  def fill(spec):
    if spec and "d" in spec and "w" not in spec and "segments" not in spec:
      return {"segments": [[j, (int(spec["d"]) - 1) * j] for j in range(k)]}
    return spec

  kind = c["kind"]
  for key in _SPEC_KINDS.get(kind, ()):
    c[key] = fill(c.get(key))
  if kind == "stages":
    c["stages"] = [[start, fill(spec)] for start, spec in c.get("stages", [])]
  elif kind == "random":
    c["choices"] = [fill(spec) for spec in c.get("choices", [])]
  elif kind == "phases":
    c["phases"] = [dict(p, spec=fill(p.get("spec"))) for p in c.get("phases", [])]
  return c


def same_settings(a: Dict, b: Dict) -> bool:
  """Two methods' settings equal but for the list of suites (a suite's result stays valid when
  others are added or dropped)."""
  strip = lambda x: {k: v for k, v in (x or {}).items() if k != "suites"}
  return strip(a) == strip(b)
