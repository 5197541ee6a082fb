"""Reading and writing Hugging Face LLaMA directories (config.json + weight files).

Weights are read tensor by tensor from `model.safetensors`, sharded safetensors
with `model.safetensors.index.json`, or `pytorch_model.bin` (sharded with
`pytorch_model.bin.index.json`), in fp32/fp16/bf16, and always returned as
float32 NumPy arrays. Every problem with a file ends in one `ConvertError`
naming that file (or tensor). torch and safetensors are imported here only.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Dict, Iterable, Tuple

import numpy as np

from fot_jax import jsonio
from fot_jax.checkpoint import HF_TOKENIZER_CONFIG, ConvertError, read_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves a tokenizer's chat template


class WeightReader:
  """name -> float32 array over the weight files of one HF directory."""

  def __init__(self, hf_dir: str):
    self.dir = hf_dir
    self.files = {}  # tensor name -> file path
    self._bins = {}  # .bin path -> loaded state dict (read whole, once)
    st_index = os.path.join(hf_dir, "model.safetensors.index.json")
    bin_index = os.path.join(hf_dir, "pytorch_model.bin.index.json")
    if os.path.isfile(st_index):
      self._from_index(st_index)
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
      self._scan([os.path.join(hf_dir, "model.safetensors")])
    elif os.path.isfile(bin_index):
      self._from_index(bin_index)
    elif os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
      self._scan([os.path.join(hf_dir, "pytorch_model.bin")])
    else:
      shards = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
      if not shards:
        raise ConvertError(f"{hf_dir}: no weight file (model.safetensors, model.safetensors.index.json, "
                           f"pytorch_model.bin or pytorch_model.bin.index.json)")
      self._scan(shards)

  def _from_index(self, index_path: str):
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ConvertError(f"{index_path}: has no 'weight_map'")
    for name, fname in weight_map.items():
      path = os.path.join(self.dir, fname)
      if not os.path.isfile(path):
        raise ConvertError(f"{path}: missing weight file (listed in {os.path.basename(index_path)} "
                           f"for tensor {name})")
      self.files[name] = path
    for path in sorted(set(self.files.values())):
      self._keys(path)  # opens each shard once so a truncated one fails here, by name

  def _scan(self, paths: Iterable[str]):
    for path in paths:
      for name in self._keys(path):
        self.files[name] = path

  def _keys(self, path: str):
    if path.endswith(".safetensors"):
      from safetensors import safe_open
      try:
        with safe_open(path, "pt") as f:
          return list(f.keys())
      except Exception as e:  # truncated or corrupt header
        raise ConvertError(f"{path}: unreadable safetensors file, truncated or corrupt ({e})") from None
    return list(self._bin(path))

  def _bin(self, path: str):
    if path not in self._bins:
      import torch
      try:
        try:
          self._bins[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # pre-zip (legacy) files cannot be memory-mapped
          self._bins[path] = torch.load(path, map_location="cpu", weights_only=True)
      except Exception as e:
        raise ConvertError(f"{path}: unreadable PyTorch weight file, truncated or corrupt ({e})") from None
    return self._bins[path]

  def names(self):
    return list(self.files)

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise ConvertError(f"{self.dir}: tensor {name} is missing from the weight files")
    path = self.files[name]
    try:
      if path.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
          t = f.get_tensor(name)
      else:
        t = self._bin(path)[name]
      return t.float().numpy()
    except ConvertError:
      raise
    except Exception as e:
      raise ConvertError(f"{path}: cannot read tensor {name} ({e})") from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*$", re.I)


def parse_size(size) -> int:
  """'5GB' / '200KB' / 1000 -> bytes (powers of 1000, as Hugging Face counts shards)."""
  if isinstance(size, int):
    return size
  m = _SIZE.match(str(size))
  if not m:
    raise ConvertError(f"max_shard_size: cannot read {size!r}; use e.g. 5GB, 500MB or a byte count")
  unit = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}[(m.group(2) or "").upper()]
  return int(float(m.group(1)) * unit)


TORCH_DTYPES = ("float32", "bfloat16", "float16")


def write_safetensors(out_dir: str, tensors: Dict[str, np.ndarray], dtype: str, max_shard_bytes: int) -> Tuple[str, ...]:
  """Writes model.safetensors, or model-0000i-of-0000n.safetensors + index past max_shard_bytes."""
  import torch
  from safetensors.torch import save_file
  if dtype not in TORCH_DTYPES:
    raise ConvertError(f"dtype: must be one of {TORCH_DTYPES}, got {dtype!r}")
  tdtype = getattr(torch, dtype)
  shards, current, size = [], {}, 0
  for name, arr in tensors.items():
    t = torch.from_numpy(np.require(arr, np.float32, ["C", "W"])).to(tdtype)  # torch wants writable
    nbytes = t.numel() * t.element_size()
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = t
    size += nbytes
  shards.append(current)
  meta = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
    jsonio.honour_umask(os.path.join(out_dir, "model.safetensors"))  # save_file makes it 0600
    return ("model.safetensors",)
  names, weight_map, total = [], {}, 0
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(out_dir, fname), metadata=meta)
    jsonio.honour_umask(os.path.join(out_dir, fname))
    names.append(fname)
    for name, t in shard.items():
      weight_map[name] = fname
      total += t.numel() * t.element_size()
  jsonio.write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
  return tuple(names)


def keep_chat_template(src_dir: str, out_dir: str) -> bool:
  """A chat template saved beside a tokenizer as chat_template.jinja (transformers' save_pretrained)
  goes into out_dir's tokenizer_config.json as `chat_template`, which transformers reads too: the
  checkpoint keeps only tokenizer.json and tokenizer_config.json. A template already in that file
  stays. -> whether out_dir's tokenizer_config.json holds a template now."""
  config_path = os.path.join(out_dir, HF_TOKENIZER_CONFIG)
  if not os.path.isfile(config_path):
    return False
  config = read_json(config_path)
  if config.get("chat_template"):
    return True
  template_path = os.path.join(src_dir, CHAT_TEMPLATE_FILE)
  if not os.path.isfile(template_path):
    return False
  with open(template_path, encoding="utf-8") as f:
    config["chat_template"] = f.read()
  jsonio.write_json(config_path, config, indent=2)
  return True
