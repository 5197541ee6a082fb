"""fot_jax checkpoints outside a training run: what `import_hf` writes and
`init_from` / `export_hf` / `from_pretrained` read.

An imported checkpoint is a directory with `fot_jax_model.json` (ModelConfig
fields, the inference window, source metadata) and `params/` (an orbax
checkpoint of the parameter tree, float32), plus the source's tokenizer when it had
one: `tokenizer.model` (SentencePiece) or `tokenizer.json` with its `tokenizer_config.json`
(Hugging Face tokenizers). A training workdir is read too: its latest orbax step under
`checkpoints/` and the `fot_jax_model.json` the trainer writes beside it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Optional

import jax
import numpy as np

from fot_jax.convert.hf_files import ConvertError, ensure_empty_dir, read_json
from fot_jax.model.config import ModelConfig

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


def write_model_json(directory: str, cfg: ModelConfig, window: Optional[int], **meta) -> None:
  """Writes fot_jax_model.json (process 0 only); the trainer calls this for its workdir."""
  if jax.process_index() != 0:
    return
  from fot_jax.convert.mapping import model_config_dict
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, MODEL_JSON), "w") as f:
    json.dump({"model": model_config_dict(cfg), "window": window, **meta}, f, indent=1)


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


def _model_config(info: dict, source: str) -> ModelConfig:
  fields = dict(info.get("model") or {})
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(fields) - known)
  if unknown or not fields:
    raise ConvertError(f"{source}: 'model' must hold ModelConfig fields; unknown {unknown}")
  fields["mem_layers"] = tuple(fields.get("mem_layers", ()))
  cfg = ModelConfig(**fields)
  try:
    cfg.validate()
  except ValueError as e:
    raise ConvertError(f"{source}: {e}") from None
  return cfg


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
  info_path = os.path.join(path, MODEL_JSON)
  if not os.path.isfile(info_path):
    raise ConvertError(f"{info_path}: file not found; {path} is not an fot_jax checkpoint "
                       f"(import one with `python -m fot_jax.convert import_hf`)")
  info = read_json(info_path)
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
  from fot_jax.convert.mapping import expected_shapes
  want = expected_shapes(cfg)
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
