"""Reading a GGUF file (llama.cpp's format) through transformers' GGUF loader.

transformers dequantizes the tensors (with the `gguf` package) and undoes llama.cpp's
q/k row permutation, giving a LlamaForCausalLM state dict and config; its tokenizer
converter rebuilds a Hugging Face tokenizer from the file's metadata. This module only
checks first what fot_jax can take (a 'llama' architecture, tensor types `gguf` can
dequantize), so that any other file ends in one ConvertError naming the problem.
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, Tuple

import numpy as np

from fot_jax.checkpoint import ConvertError
from fot_jax.convert.hf_files import keep_chat_template

GGUF_ARCHITECTURES = ("llama",)  # general.architecture values fot_jax's decoder reproduces


class TensorReader:
  """The WeightReader interface (files / names / get) over tensors already in memory."""

  def __init__(self, tensors: Dict[str, np.ndarray], source: str):
    self.dir = source
    self.tensors = tensors
    self.files = {name: source for name in tensors}

  def names(self):
    return list(self.tensors)

  def get(self, name: str) -> np.ndarray:
    if name not in self.tensors:
      raise ConvertError(f"{self.dir}: tensor {name} is missing")
    return self.tensors[name]


def _field_text(reader, key: str):
  field = reader.fields.get(key)
  if field is None or not field.data:
    return None
  return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def check_gguf(path: str) -> None:
  """Refuses, in one line, a file fot_jax cannot import: unreadable, not LLaMA, or a tensor
  type the installed `gguf` cannot dequantize."""
  if not os.path.isfile(path):
    raise ConvertError(f"{path}: file not found")
  try:
    from gguf import GGUFReader, dequantize
  except ImportError:
    raise ConvertError("GGUF import needs the `gguf` and `accelerate` packages "
                       "(pip install -r requirements.txt)") from None
  try:
    reader = GGUFReader(path)
  except Exception as e:
    raise ConvertError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
  arch = _field_text(reader, "general.architecture")
  name = _field_text(reader, "general.name") or ""
  if arch not in GGUF_ARCHITECTURES or "mistral" in name.lower():  # transformers reads llama+mistral as Mistral
    raise ConvertError(f"{path}: GGUF architecture {arch!r} (model {name!r}) is not supported; fot_jax "
                       f"imports {list(GGUF_ARCHITECTURES)} GGUF files (LLaMA-family dense decoders)")
  smallest = {}  # one tensor of each type, the smallest, to try dequantizing
  for t in reader.tensors:
    if t.tensor_type not in smallest or t.n_bytes < smallest[t.tensor_type].n_bytes:
      smallest[t.tensor_type] = t
  for qtype, t in smallest.items():
    try:
      dequantize(t.data, qtype)
    except NotImplementedError:
      raise ConvertError(f"{path}: tensor {t.name} uses quantization {qtype.name}, which the installed "
                         f"`gguf` package cannot dequantize; convert the model to another type "
                         f"(e.g. Q8_0, Q4_K, F16)") from None


def read_gguf(path: str) -> Tuple[dict, Dict[str, np.ndarray], str]:
  """GGUF file -> (Hugging Face config dict, {HF tensor name: float32 array}, a temporary
  directory holding tokenizer.json and tokenizer_config.json, with the file's chat template when
  it has one; the caller removes it)."""
  check_gguf(path)
  import torch
  import transformers
  directory, fname = os.path.split(os.path.abspath(path))
  try:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=fname, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=fname)
  except (ValueError, NotImplementedError, KeyError, OSError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConvertError(f"{path}: transformers cannot read this GGUF file ({first})") from None
  hf = model.config.to_dict()
  tensors = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  tok_dir = tempfile.mkdtemp(prefix="fot_jax_gguf_tok_")
  tokenizer.save_pretrained(tok_dir)
  if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    raise ConvertError(f"{path}: transformers rebuilt no tokenizer.json from this GGUF file")
  keep_chat_template(tok_dir, tok_dir)  # the file's tokenizer.chat_template, into tokenizer_config.json
  return hf, tensors, tok_dir
