"""Chat prompts rendered with a checkpoint's own chat template (transformers' `apply_chat_template`).

  chat_prompt("checkpoints/smollm2-135m", [{"role": "user", "content": "Hi"}]) -> the prompt text

The template is the one the tokenizer directory ships: `chat_template` in tokenizer_config.json
(what `python -m fot_jax.convert import_gguf` / `import_hf` write) or a chat_template.jinja beside
it. The text is rendered, not tokenized: the caller encodes it with the model's vocabulary.
transformers is imported on first use, so importing this module stays light.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Dict, List, Optional, Sequence

MODEL_JSON = "fot_jax_model.json"  # fot_jax.checkpoint.MODEL_JSON (not imported: that loads JAX)
HF_TOKENIZER = "tokenizer.json"


def _spec_dir(spec) -> Optional[str]:
  """The directory of a vocabulary spec when it is a tokenizer.json file, else None."""
  spec = str(spec or "")
  return os.path.dirname(os.path.abspath(spec)) if spec.endswith(".json") and os.path.isfile(spec) else None


def _from_model_json(directory: str) -> Optional[str]:
  """The tokenizer directory of an fot_jax checkpoint, in Pretrained.vocabulary's order: the vocabulary
  it trained with ('vocab', a path as given), else the tokenizer it ships ('tokenizer', beside
  fot_jax_model.json); None when that is no tokenizer.json (bytes, SentencePiece, ...)."""
  try:
    with open(os.path.join(directory, MODEL_JSON), encoding="utf-8") as f:
      info = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(info, dict):
    return None
  if info.get("vocab"):
    return _spec_dir(info["vocab"])
  name = info.get("tokenizer")
  return _spec_dir(os.path.join(directory, name)) if isinstance(name, str) and name else None


def tokenizer_dir(source) -> Optional[str]:
  """The directory of the Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) of
  `source`, or None when it has none: a loaded model (`fot_jax.from_pretrained(...)`, its
  vocabulary spec or shipped tokenizer), an fot_jax checkpoint or training workdir (its
  fot_jax_model.json's vocab / tokenizer), a Hugging Face directory, or a tokenizer.json file."""
  ck = getattr(source, "checkpoint", None)
  if ck is not None:  # a Pretrained: the vocabulary it encodes with (Pretrained.vocabulary's order)
    return _spec_dir(ck.meta.get("vocab") or ck.tokenizer_path)
  path = os.fspath(source)
  if os.path.isfile(path):
    return _spec_dir(path)
  if not os.path.isdir(path):
    return None
  if os.path.isfile(os.path.join(path, MODEL_JSON)):
    return _from_model_json(path)
  return os.path.abspath(path) if os.path.isfile(os.path.join(path, HF_TOKENIZER)) else None


@functools.lru_cache(maxsize=8)
def _tokenizer(directory: str):
  from transformers import AutoTokenizer
  try:
    return AutoTokenizer.from_pretrained(directory)
  except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a bad directory
    raise ValueError(f"{directory}: transformers cannot read this tokenizer ({type(e).__name__}: "
                     f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


def load_tokenizer(source):
  """transformers' tokenizer of `source` (see tokenizer_dir), loaded once per directory."""
  directory = tokenizer_dir(source)
  if directory is None:
    name = getattr(getattr(source, "checkpoint", None), "path", source)
    raise ValueError(f"{name}: no Hugging Face tokenizer (tokenizer.json) found for it; a chat template "
                     f"needs one (pass the tokenizer directory instead)")
  return _tokenizer(directory)


def chat_template(source) -> str:
  """The chat template `source` ships (see tokenizer_dir); ValueError naming it when there is none."""
  tok = load_tokenizer(source)
  template = getattr(tok, "chat_template", None)
  if isinstance(template, dict):  # several named templates: transformers' own choice is 'default'
    template = template.get("default")
  if not template:
    raise ValueError(f"{tokenizer_dir(source)}: the tokenizer has no chat template (no chat_template in "
                     f"tokenizer_config.json, no chat_template.jinja); a base model takes plain prompts. "
                     f"A checkpoint imported from GGUF before fot_jax kept templates needs importing again")
  return template


def chat_prompt(source, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True,
                continue_final_message: Optional[bool] = None) -> str:
  """messages ([{'role': 'system' | 'user' | 'assistant', 'content': text}, ...]) -> the prompt text
  the checkpoint's chat template makes of them. add_generation_prompt: end with the assistant's
  turn opening (the model answers next); otherwise the last message is left open to be continued
  (continue_final_message, default: not add_generation_prompt, as lm-evaluation-harness does).
  source: see tokenizer_dir (a directory, a tokenizer.json, or a loaded model)."""
  msgs: List[Dict[str, str]] = [dict(m) for m in messages]
  if not msgs or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
    raise ValueError(f"chat: messages must be a non-empty list of {{'role': str, 'content': str}}, got {messages!r}")
  template = chat_template(source)
  if continue_final_message is None:
    continue_final_message = not add_generation_prompt
  return load_tokenizer(source).apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt,
                                                    continue_final_message=continue_final_message)
