"""The study file's settings, checked and resolved without loading a model, TensorFlow or JAX:
what a method is (its keys, inference path, own memory retrieval, fine-tune), the settings a
finished method's results depend on, and the table's labels. `python -m fot_jax.study` runs
check_config before anything heavy is imported, so a bad study file fails in one line at once."""
from __future__ import annotations

import json
from typing import Dict, List

import numpy as np

from fot_jax.model.config import BlockSpec
from fot_jax.settings import OptimSettings

INFERENCE_PATHS = ("plain", "memory")
SUITES = ("ppl", "passkey", "niah", "rd")
METHOD_KEYS = ("name", "inference", "overrides", "window", "finetune", "memory")
# a method's `memory` retrieval: per mode, its fields (fot_jax.inference.MemoryInference's arguments)
MEMORY_FIELDS = {"dense": (), "topk": ("topk",), "approx_topk": ("topk",),
                 "blocks": ("block_size", "block_reps", "block_topk")}
CONFIG_KEYS = ("base", "lengths", "methods", "suites", "pad", "ppl", "eval")


def method_model_config(base_cfg, method: Dict):
  """The base ModelConfig with the method's overrides, validated (errors name the method)."""
  name = method.get("name", "?")
  return type(base_cfg).from_dict(dict(method.get("overrides", {})), f"study method {name!r}", base=base_cfg)


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


def memory_settings(method: Dict):
  """The method's own memory retrieval, resolved (None: the suite config's eval.mode / eval.topk).
  `memory` is {"mode": M, ...fields of M}: "dense"; "topk" / "approx_topk" with "topk" (required);
  "blocks" with "block_size", "block_reps", "block_topk" (each defaulting to BlockSpec's:
  128, 16, 8). Only for the memory path. Errors name the method and the field."""
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
  out = {"mode": mode}
  defaults = BlockSpec()._asdict() if mode == "blocks" else {}
  for f in fields:
    value = mem.get(f, defaults.get(f))
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError(f"study method {name!r}: memory.{f} must be a positive integer, got {value!r}")
    out[f] = int(value)
  return out


def memory_label(method: Dict) -> str:
  """The table's path cell: the inference path, with the method's own memory retrieval."""
  path = method.get("inference", "plain")
  ms = memory_settings(method) if path == "memory" else None
  if not ms:
    return path
  if ms["mode"] == "blocks":
    return f"memory, blocks {ms['block_size']} x {ms['block_topk']} (reps {ms['block_reps']})"
  return f"memory, {ms['mode']}" + (f" {ms['topk']}" if "topk" in ms else "")


FINETUNE_FIELDS = ("steps", "optim", "task", "vocab", "split", "slots", "length", "seed", "min_doc_len",
                   "crossbatch", "checkpoint_every", "log_every", "tensorboard")
_SPEC_KINDS = {"constant": ("spec",), "metric": ("before", "after")}  # where each kind keeps its specs


def finetune_settings(config, method: Dict):
  """The fine-tune of a method, as JSON (None: a frozen method): the study's `finetune` with the
  method's dict (if `finetune` is one) over it. Fields:
    steps, optim (an LM config's c.optim; total_steps defaults to steps), seed (the documents'
    order), task, split, vocab ('' = the base checkpoint's, as the evaluation), slots,
    min_doc_len: the data; length: the extended context L_ft trained at; crossbatch: memory
    methods' spec or curriculum (fot_jax/curriculum.py; a spec {"d": D} without w / segments
    means every window sees all earlier windows of its slot and as many of D - 1 other slots');
    checkpoint_every, log_every, tensorboard.
  Every fine-tuned method sees the same tokens per step: `slots` streams of `length` tokens each
  (the plain path: one window of `length`, no crossbatch; the memory path: length / window
  windows of the base's window, with crossbatch). Plain methods drop `crossbatch` (not theirs)."""
  ft = method.get("finetune")
  if not ft:
    return None
  name = method.get("name", "?")
  if ft is not True and not hasattr(ft, "keys"):
    raise ValueError(f"study method {name!r}: finetune must be True or a dict of finetune fields, got {ft!r}")
  if "finetune" not in config:
    raise ValueError(f"study method {name!r}: fine-tuned, but the study has no shared `finetune` settings")
  s = jsonable(config.finetune)
  own = jsonable(ft) if ft is not True else {}
  unknown = sorted((set(s) | set(own)) - set(FINETUNE_FIELDS))
  if unknown:
    raise ValueError(f"study method {name!r}: unknown finetune field(s) {unknown}; known: {list(FINETUNE_FIELDS)}")
  optim = dict(s.get("optim") or {}, **own.pop("optim", {}))
  s.update(own, optim=optim)
  for f, default in (("vocab", ""), ("split", "train"), ("seed", 0), ("min_doc_len", 1), ("log_every", 10),
                     ("checkpoint_every", 0), ("tensorboard", False)):
    s.setdefault(f, default)
  for f in ("steps", "length", "slots"):
    if not isinstance(s.get(f), int) or s[f] <= 0:
      raise ValueError(f"study method {name!r}: finetune.{f} must be a positive integer, got {s.get(f)!r}")
  if not s.get("task"):
    raise ValueError(f"study method {name!r}: finetune.task must name the training data (a SeqIO task)")
  optim.setdefault("total_steps", s["steps"])
  OptimSettings.from_dict(optim, f"study method {name!r}: finetune.optim")
  if method.get("inference", "plain") == "plain":
    s.pop("crossbatch", None)
  elif not s.get("crossbatch"):
    raise ValueError(f"study method {name!r}: a memory method fine-tunes with crossbatch; set finetune.crossbatch "
                     "(e.g. {'d': 2})")
  return s


def jsonable(x) -> Dict:
  return json.loads(json.dumps(x.to_dict() if hasattr(x, "to_dict") else dict(x), default=list))


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


def settings(config, method=None) -> Dict:
  """What a method's results depend on besides its spec: a finished method is reused only if equal.
  A fine-tuned method's include its resolved fine-tune (a changed one trains and evaluates again)."""
  out = json.loads(json.dumps({k: (config[k].to_dict() if hasattr(config[k], "to_dict") else config[k])
                               for k in ("lengths", "suites", "pad", "ppl", "eval")}, default=list))
  ft = finetune_settings(config, method) if method is not None else None
  if ft is not None:
    out["finetune"] = ft
  own = memory_settings(method) if method is not None else None
  if own is not None:  # the method's memory retrieval, defaults resolved
    out["memory"] = own
  return out


def method_spec(method: Dict) -> Dict:
  return json.loads(json.dumps(method, default=list))  # tuples -> lists, as stored


def eval_config(config):
  """The suite settings of the study: fot_jax/eval defaults, the study's lengths on every grid."""
  e = config.eval
  for g in (e.passkey, e.niah):
    g.lengths = tuple(int(x) for x in config.lengths)
  return e


def check_config(config) -> None:
  """The study file's shape, before anything is loaded or trained: its fields, the suites, and
  every method an entry the study knows (no misspelt key such as 'overides' silently ignored).
  Errors name the field or the method."""
  if not hasattr(config, "keys"):
    raise ValueError(f"study: get_config() returned {config!r}, not a ConfigDict")
  missing = [k for k in CONFIG_KEYS if k not in config]
  if missing:
    raise ValueError(f"study: the study config has no {missing}; a study file sets {list(CONFIG_KEYS)}")
  unknown = [s for s in config.suites if s not in SUITES]
  if unknown:
    raise ValueError(f"study: unknown suite(s) {unknown} in suites; known: {list(SUITES)}")
  lengths = list(config.lengths)
  if not lengths or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in lengths):
    raise ValueError(f"study: lengths must be positive integers, got {lengths}")
  methods = list(config.methods)
  if not methods:
    raise ValueError("study: no methods")
  for i, m in enumerate(methods):
    if not hasattr(m, "keys"):
      raise ValueError(f"study: method {i} is {m!r}, not a dict of {list(METHOD_KEYS)}")
    name = m.get("name")
    if not isinstance(name, str) or not name or not all(ch.isalnum() or ch in "_-." for ch in name) \
        or name.startswith("."):
      raise ValueError(f"study: method {i} needs a 'name' of letters, digits, _, - or . (it names its "
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
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
      raise ValueError(f"study method {name!r}: window must be a positive integer (0: the base's), got {window!r}")
    memory_settings(m)
  names = [m["name"] for m in methods]
  if len(set(names)) != len(names):
    raise ValueError(f"study: method names must be unique, got {names}")


def describe(m: Dict) -> str:
  o = m.get("overrides", {})
  path = m.get("inference", "plain")
  retrieval = memory_label(m)[len(path):]  # ", blocks 128 x 8 (reps 16)" for a method's own memory retrieval
  return f"{path} path{retrieval}" + (f", {dict(o)}" if o else "") + (", fine-tuned" if m.get("finetune") else "")
