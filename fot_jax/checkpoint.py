"""fot_jax checkpoints outside a training run: what `import_hf` writes and
`init_from` / `export_hf` / `from_pretrained` read.

An imported checkpoint is a directory with `fot_jax_model.json` (ModelConfig
fields, the inference window, source metadata) and `params/` (an orbax
checkpoint of the parameter tree, float32), plus the source's tokenizer when it had
one: `tokenizer.model` (SentencePiece) or `tokenizer.json` with its `tokenizer_config.json`
(Hugging Face tokenizers). A training workdir is read too: its latest orbax step under
`checkpoints/` and the `fot_jax_model.json` the trainer writes beside it.

This is fot_jax's own format; the foreign ones (Hugging Face, GGUF) are fot_jax.convert's, which
reads and writes through this module. ConvertError (fot_jax.convert.ConvertError) is defined here.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import shutil
from typing import Optional

import jax
import numpy as np

from fot_jax import jsonio
from fot_jax.jsonio import write_json
from fot_jax.model.config import ModelConfig
from fot_jax.model.init import param_shapes


class ConvertError(ValueError):
  """A user-fixable problem with a checkpoint, a directory or a config."""


def read_json(path: str) -> dict:
  """A JSON object from a file (fot_jax.jsonio.read_json); every problem is one ConvertError
  naming the file."""
  if not os.path.isfile(path):
    raise ConvertError(f"{path}: file not found")
  try:
    out = jsonio.read_json(path, hint="")
  except ValueError as e:  # 'JSON file PATH is not valid JSON (...)'
    raise ConvertError(str(e)) from None
  except OSError as e:
    raise ConvertError(f"{path}: unreadable ({e.strerror or e})") from None
  if not isinstance(out, dict):
    raise ConvertError(f"{path}: expected a JSON object, got {type(out).__name__}")
  return out


def _is_missing_or_empty(path: str) -> bool:
  return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))


def ensure_empty_dir(path: str) -> None:
  """Creates `path`; refuses a file or a non-empty directory (nothing is overwritten)."""
  if not _is_missing_or_empty(path):
    raise ConvertError(f"{path}: exists and is not an empty directory; choose a new output "
                       f"directory or remove it first")
  os.makedirs(path, exist_ok=True)


MODEL_JSON = "fot_jax_model.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # SentencePiece, Hugging Face; searched in this order
HF_TOKENIZER_CONFIG = "tokenizer_config.json"  # names tokenizer.json's bos/eos/pad tokens


def find_tokenizer(directory: str) -> Optional[str]:
  """The tokenizer file a model directory ships, or None."""
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def copy_tokenizer(src: str, out: str) -> str:
  """Copies a tokenizer file (and a tokenizer.json's tokenizer_config.json) into `out`; returns its name."""
  if not os.path.isfile(src):
    raise ConvertError(f"{src}: tokenizer file not found")
  name = TOKENIZER_FILES[1] if src.endswith(".json") else TOKENIZER_FILES[0]
  shutil.copyfile(src, os.path.join(out, name))
  config = os.path.join(os.path.dirname(src), HF_TOKENIZER_CONFIG)
  if name.endswith(".json") and os.path.isfile(config):
    shutil.copyfile(config, os.path.join(out, HF_TOKENIZER_CONFIG))
  return name


@dataclasses.dataclass
class Checkpoint:
  cfg: ModelConfig
  params: dict
  window: Optional[int]  # local window (HF max_position_embeddings); None if unknown
  meta: dict  # the rest of fot_jax_model.json (source, hf token ids, tokenizer)
  path: str

  @property
  def tokenizer_path(self) -> Optional[str]:
    name = self.meta.get("tokenizer")
    if not name:
      return None
    return name if os.path.isabs(name) else os.path.join(self.path, name)


def tokenizer_size(path: str) -> int:
  """The number of ids of a tokenizer file (tokenizer.json with its added tokens, or a SentencePiece
  model), read without the data pipeline's imports."""
  try:
    if path.endswith(".json"):
      from tokenizers import Tokenizer
      return int(Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True))
    import sentencepiece as spm
    return int(spm.SentencePieceProcessor(model_file=path).get_piece_size())
  except Exception as e:  # noqa: BLE001 - whatever the libraries raise on a bad file
    kind = "Hugging Face tokenizer.json" if path.endswith(".json") else "SentencePiece model"
    raise ConvertError(f"{path}: not a readable {kind} ({type(e).__name__}: {e})") from None


def check_tokenizer_fits(path: str, vocab_size: int, model: str) -> None:
  """A tokenizer with more ids than the model's embedding has rows would index rows that do not
  exist (garbage or a crash, depending on the backend): refused, naming both."""
  n = tokenizer_size(path)
  if n > vocab_size:
    raise ConvertError(f"{path}: the tokenizer has {n} tokens but {model}'s embedding has vocab_size="
                       f"{vocab_size} rows; use the model's own tokenizer")


def write_model_json(directory: str, cfg: ModelConfig, window: Optional[int], **meta) -> None:
  """Writes fot_jax_model.json (process 0 only, atomically); the trainer calls this for its workdir."""
  if jax.process_index() != 0:
    return
  write_json(os.path.join(directory, MODEL_JSON), {"model": cfg.to_dict(), "window": window, **meta})


def save(path: str, params, cfg: ModelConfig, window: Optional[int], tokenizer: Optional[str] = None,
         **meta) -> None:
  import orbax.checkpoint as ocp
  ensure_empty_dir(path)
  params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.abspath(os.path.join(path, "params")), params)
  ckpt.wait_until_finished()
  name = copy_tokenizer(tokenizer, path) if tokenizer else None
  write_model_json(path, cfg, window, tokenizer=name, **meta)


def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_pairs(v) -> bool:  # rope_scaling / position_strategy: a dict, or [key, value] pairs
  return isinstance(v, dict) or (isinstance(v, (list, tuple)) and all(
      isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in v))


# ModelConfig's field annotations -> (check, what the error says it must be)
FIELD_TYPES = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "Tuple[int, ...]": (lambda v: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
                        "a list of integers"),
    "Tuple[Tuple[str, Any], ...]": (_is_pairs, "an object"),
}


def check_model_fields(fields: dict, source: str) -> None:
  """Each ModelConfig field of fot_jax_model.json has its type (no "num_layers": "two"): the error
  names the file and the field."""
  for f in dataclasses.fields(ModelConfig):
    if f.name not in fields:
      continue
    annotation, value = str(f.type), fields[f.name]
    optional = annotation.startswith("Optional[")
    if optional:
      annotation = annotation[len("Optional["):-1]
    if value is None and optional:
      continue
    if annotation not in FIELD_TYPES:  # a field of a kind not listed here: ModelConfig checks it
      continue
    check, want = FIELD_TYPES[annotation]
    if value is None or not check(value):
      raise ConvertError(f"{source}: model.{f.name} must be {want}{' or null' if optional else ''}, "
                         f"got {value!r}")


def _model_config(info: dict, source: str) -> ModelConfig:
  fields = info.get("model")
  if not isinstance(fields, dict) or not fields:
    raise ConvertError(f"{source}: 'model' must be an object of ModelConfig fields, got {fields!r}")
  check_model_fields(fields, source)  # types first (unknown keys are ModelConfig.from_dict's)
  try:
    return ModelConfig.from_dict(fields, source)
  except ValueError as e:
    raise ConvertError(str(e)) from None


def check_model_json(info, source: str) -> None:
  """fot_jax_model.json's other fields: window a positive integer (or null), tokenizer and vocab
  strings (or null), hf an object."""
  if not isinstance(info, dict):
    raise ConvertError(f"{source}: expected a JSON object, got {type(info).__name__}")
  window = info.get("window")
  if window is not None and (not _is_int(window) or window <= 0):
    raise ConvertError(f"{source}: window must be a positive integer or null, got {window!r}")
  for field in ("tokenizer", "vocab"):
    if info.get(field) is not None and not isinstance(info[field], str):
      raise ConvertError(f"{source}: {field} must be a string or null, got {info[field]!r}")
  if info.get("hf") is not None and not isinstance(info["hf"], dict):
    raise ConvertError(f"{source}: hf must be an object, got {info['hf']!r}")


def _params_dir(path: str) -> str:
  """The orbax directory that holds the parameters under `path`."""
  if os.path.isdir(os.path.join(path, "params")):
    return os.path.join(path, "params")
  manager_dir = os.path.join(path, "checkpoints")
  steps = [int(s) for s in os.listdir(manager_dir) if s.isdigit()] if os.path.isdir(manager_dir) else []
  if steps:
    return os.path.join(manager_dir, str(max(steps)), "state")
  raise ConvertError(f"{path}: no fot_jax parameters (neither params/ from import_hf nor "
                     f"checkpoints/STEP/ from a training run)")


def load(path: str) -> Checkpoint:
  """Reads an imported checkpoint or a training workdir (its latest step)."""
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise ConvertError(f"{path}: " + ("is a file, not an fot_jax checkpoint directory" if os.path.exists(path)
                                      else "checkpoint directory does not exist"))
  info_path = os.path.join(path, MODEL_JSON)
  if not os.path.isfile(info_path):
    raise ConvertError(f"{info_path}: file not found; {path} is not an fot_jax checkpoint "
                       f"(import one with `python -m fot_jax.convert import_hf`)")
  info = read_json(info_path)
  check_model_json(info, info_path)
  cfg = _model_config(info, info_path)
  params_dir = _params_dir(path)
  try:
    tree = ocp.StandardCheckpointer().restore(params_dir)
  except Exception as e:
    raise ConvertError(f"{params_dir}: unreadable orbax checkpoint ({type(e).__name__}: {e})") from None
  params = tree["params"] if params_dir.endswith("state") else tree
  check_params(params, cfg, params_dir)
  meta = {k: v for k, v in info.items() if k not in ("model", "window")}
  return Checkpoint(cfg, params, info.get("window"), meta, path)


def check_params(params, cfg: ModelConfig, source: str) -> None:
  """Raises ConvertError naming the first parameter whose presence or shape differs from `cfg`."""
  want = param_shapes(cfg)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  have = {tuple(getattr(k, "key", k) for k in p): tuple(np.shape(x)) for p, x in flat}
  for path in sorted(set(want) | set(have)):
    name = "/".join(path)
    if path not in have:
      raise ConvertError(f"{source}: parameter {name} {want[path]} is missing; the model config "
                         f"does not match the checkpoint")
    if path not in want:
      raise ConvertError(f"{source}: parameter {name} {have[path]} is not in the model the config "
                         f"describes; the model config does not match the checkpoint")
    if have[path] != want[path]:
      raise ConvertError(f"{source}: parameter {name} has shape {have[path]} but the model config "
                         f"expects {want[path]}; make the model config match the checkpoint")
