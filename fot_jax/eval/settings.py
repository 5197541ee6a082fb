"""The evaluation suite's settings: a frozen tree, SuiteSettings with one section per suite, read
once by `SuiteSettings.from_dict` from `--eval.*` of python -m fot_jax.evaluate or a study file's
`eval` (errors name the field); everything below takes the tree, and a variant (a baseline arm's
sizes, a study's lengths) is `dataclasses.replace` or `from_dict(..., base=settings)`. Light, no
JAX or TensorFlow, so entry points read it before anything heavy loads. `default_config()` holds
the same defaults as a ConfigDict: what the command line's flags and the study files override."""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Dict, Mapping, Optional, Tuple

import ml_collections

from data_pipelines.dictionary_lookup import DictionaryTask

SUITES = ("ppl", "rd", "passkey", "niah", "dict", "ruler", "heads")
DOC_MODES = ("single_doc", "multi_doc")  # fot_jax.inference.DOC_MODES (that module loads JAX)
DICT_MODES = ("dense", "topk", "flat", "ivf")  # flat / ivf: exact / approximate top-k from a host index


def _field(default, **checks):
  """A field with its checks for the reader: least (integers at least this), choices, between (lo, hi)."""
  return dataclasses.field(default=default, metadata=checks)


def _section(cls):
  return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class PerplexitySuite:
  """ppl: perplexity of each held-out document's last score_tokens tokens with memory_tokens tokens
  before them in memory, n_docs documents; multi_doc first fills memory with distractor_tokens of
  earlier documents (-1: max(memory_tokens))."""
  memory_tokens: Tuple[int, ...] = _field((0, 2048, 8192, 32768), least=0)
  score_tokens: int = _field(512, least=1)
  n_docs: int = _field(16, least=1)
  distractor_tokens: int = _field(-1, least=-1)
  doc_modes: Tuple[str, ...] = _field(DOC_MODES, choices=DOC_MODES)


@dataclasses.dataclass(frozen=True)
class RdSuite:
  """rd: positive attention mass with each d of ds documents in memory, context_windows windows of
  each, n_docs documents of `split` ('': the suite's split; stdlib's validation split has ~40 files)."""
  ds: Tuple[int, ...] = _field((1, 2, 4, 8, 16, 32, 64), least=1)
  context_windows: int = _field(1, least=1)
  n_docs: int = _field(64, least=1)
  split: str = ""


@dataclasses.dataclass(frozen=True)
class GridSuite:
  """passkey: accuracy over lengths x depths (0: the needle first, 1: last), trials prompts per cell;
  the effective length is the longest length whose accuracy stays at `threshold`."""
  lengths: Tuple[int, ...] = _field((256, 512, 1024, 2048, 4096), least=1)
  depths: Tuple[float, ...] = _field((0.0, 0.25, 0.5, 0.75, 1.0), between=(0.0, 1.0))
  trials: int = _field(4, least=1)
  threshold: float = 0.9


@dataclasses.dataclass(frozen=True)
class NiahSuite(GridSuite):
  """niah: the passkey grid in a haystack of corpus_docs documents of the suite's task, single and
  n_needles needles; style 'comment' (Python comment lines, for code) or 'plain' (for prose)."""
  n_needles: int = _field(4, least=1)
  style: str = _field("comment", choices=("comment", "plain"))
  corpus_docs: int = _field(200, least=1)


@dataclasses.dataclass(frozen=True)
class DictSuite:
  """dict: lookup accuracy with memory_tokens tokens of other documents' definitions in memory
  (`task`: the demo's task by default), n_docs documents seeded by `seed`, read as each of `modes`
  (host modes with nprobe of nlist IVF lists, 0: 4 sqrt(M), at most 1024); beyond device_max_tokens
  memory stays on the host (faiss) and the device modes stop."""
  task: DictionaryTask = dataclasses.field(default_factory=lambda: DictionaryTask(
      num_symbols=256, num_value_symbols=64, key_len=1, value_len=1, n_defs=16, n_queries=16, layout="kv"))
  memory_tokens: Tuple[int, ...] = _field((256, 1024, 4096, 16384, 65536, 262144, 1048576), least=0)
  n_docs: int = _field(8, least=1)
  topk: int = _field(32, least=1)
  modes: Tuple[str, ...] = _field(("dense", "topk", "ivf"), choices=DICT_MODES)
  nprobe: int = _field(8, least=1)
  nlist: int = _field(0, least=0)
  device_max_tokens: int = _field(262144, least=0)
  threshold: float = 0.5
  seed: int = 1234


@dataclasses.dataclass(frozen=True)
class RulerSuite:
  """ruler: RULER-style tasks scored on greedy generation (fot_jax/eval/ruler.py checks the names);
  0.856 = RULER's Llama-2-7B at 4K."""
  tasks: Tuple[str, ...] = ("niah_noise", "niah_essay", "multikey", "multivalue", "multiquery", "vt", "fwe")
  lengths: Tuple[int, ...] = _field((1024, 4096, 16384), least=1)
  trials: int = _field(4, least=1)
  threshold: float = 0.856


@dataclasses.dataclass(frozen=True)
class HeadsSuite:
  """heads: copy scores per head on n_prompts prompts of `length` tokens; the `top` layers picked."""
  n_prompts: int = _field(8, least=1)
  length: int = _field(384, least=1)
  top: int = _field(4, least=1)


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
  """Every suite's settings. seed: every suite's; task / split: the held-out documents (ppl, rd) and
  the NIAH haystack ('dictionary_lookup' for dict models); vocab: 'byte', a tokenizer path,
  'dictionary_lookup', '' = the checkpoint's own (never guessed); window: the local window, 0 = the
  checkpoint's; mode / topk: how ppl, passkey and niah read memory ('host': each query's top-k from
  a faiss index on the host, `host_index` flat or ivf with `nprobe` lists searched; teacher-forced
  suites only, fot_jax/host_memory.py); batch rows at a time; chunk query tokens per attention call."""
  seed: int = 0
  task: str = "stdlib"
  split: str = "validation"
  vocab: str = ""
  window: int = _field(0, least=0)
  mode: str = _field("dense", choices=("dense", "topk", "approx_topk", "blocks", "host"))
  topk: int = _field(32, least=1)
  host_index: str = _field("ivf", choices=("flat", "ivf"))
  nprobe: int = _field(8, least=1)
  batch: int = _field(8, least=1)
  chunk: int = _field(8192, least=1)
  ppl: PerplexitySuite = _section(PerplexitySuite)
  rd: RdSuite = _section(RdSuite)
  passkey: GridSuite = _section(GridSuite)
  niah: NiahSuite = _section(NiahSuite)
  dict: DictSuite = _section(DictSuite)
  ruler: RulerSuite = _section(RulerSuite)
  heads: HeadsSuite = _section(HeadsSuite)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = "eval",
                base: Optional["SuiteSettings"] = None) -> "SuiteSettings":
    """The one reader: `base` (default: the defaults) with the fields d gives (a ConfigDict or a
    dict; a section may give some of its fields), each checked; errors name `where.FIELD`."""
    s = read_over(base or cls(), d, where)
    try:
      s.dict.task.validate()
    except ValueError as e:
      raise ValueError(f"{where}.dict.task: {e}") from None
    return s

  def to_dict(self) -> Dict[str, Any]:
    """Every field as JSON holds it: what a suite's result records and a study's settings compare."""
    return json.loads(json.dumps(dataclasses.asdict(self)))


def read_over(base, d: Mapping[str, Any], where: str):
  """`base` (a frozen settings dataclass) with the fields d gives, each checked against its type
  and its field's checks; nested sections are read the same way over base's. An unknown field or a
  bad value fails naming where.FIELD."""
  if not hasattr(d, "keys"):
    raise ValueError(f"{where}: a dict of settings expected, got {d!r}")
  d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
  fields = {f.name: f for f in dataclasses.fields(base)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown}; known: {list(fields)}")
  hints = typing.get_type_hints(type(base))
  out = {}
  for name, value in d.items():
    current = getattr(base, name)
    if dataclasses.is_dataclass(current):
      out[name] = read_over(current, value, f"{where}.{name}")
    else:
      out[name] = _checked(value, hints[name], fields[name].metadata, f"{where}.{name}")
  return dataclasses.replace(base, **out)


def _checked(value, kind, checks: Mapping[str, Any], where: str):
  """value as `kind` (int, float, str, or a tuple of one of them), within the field's checks."""
  if typing.get_origin(kind) is tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or not list(value):
      raise ValueError(f"{where}: must be a non-empty list, got {value!r}")
    return tuple(_checked(v, typing.get_args(kind)[0], checks, where) for v in value)
  if kind in (int, float):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
      raise ValueError(f"{where}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    value = kind(value)
  elif not isinstance(value, kind):
    raise ValueError(f"{where}: must be a {kind.__name__}, got {value!r}")
  if "least" in checks and value < checks["least"]:
    raise ValueError(f"{where}: must be at least {checks['least']}, got {value!r}")
  if "between" in checks and not checks["between"][0] <= value <= checks["between"][1]:
    raise ValueError(f"{where}: must lie in [{checks['between'][0]}, {checks['between'][1]}], got {value!r}")
  if "choices" in checks and value not in checks["choices"]:
    raise ValueError(f"{where}: must be one of {list(checks['choices'])}, got {value!r}")
  return value


def default_config() -> ml_collections.ConfigDict:
  """SuiteSettings' defaults as a ConfigDict (tuples stay tuples: the command line overrides those)."""
  return ml_collections.ConfigDict(dataclasses.asdict(SuiteSettings()))
