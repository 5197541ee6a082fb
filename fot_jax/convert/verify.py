"""Does an export reproduce the model? fot_jax's memory inference on the checkpoint against the
independent PyTorch reference (torch_reference.TorchMemoryLlama) on the exported directory, on
the same tokens of real text, window by window with dense memory."""
from __future__ import annotations

import inspect
import os
from typing import Dict, Optional

import numpy as np


def verify_export(checkpoint: str, export_dir: str, text_path: Optional[str] = None, tokens: int = 512,
                  window: Optional[int] = None, vocab: str = "") -> Dict:
  """-> {'tokens', 'window', 'windows', 'max_abs_logit_diff', 'argmax_agree', 'nll_fot_jax',
  'nll_torch'} over bos + the first `tokens - 1` tokens of the text, in `vocab` (a vocabulary spec;
  default the checkpoint's own).
  A bfloat16 export differs from the float32 checkpoint by rounding: judge it by argmax agreement
  and NLL, a float32 one by the logit difference."""
  import fot_jax
  from fot_jax.convert.hf_files import ConvertError
  from fot_jax.convert.torch_reference import TorchMemoryLlama
  from fot_jax.eval.perplexity import _nll
  if tokens < 2:
    raise ConvertError(f"verify_export: --tokens must be at least 2, got {tokens}")
  if not os.path.exists(os.path.join(export_dir, "config.json")):
    raise ConvertError(f"verify_export: {export_dir} has no config.json (not an export_hf directory)")
  model = fot_jax.from_pretrained(checkpoint)
  ref = TorchMemoryLlama(export_dir)
  if sorted(ref.mem_layers) != sorted(model.cfg.mem_layers):
    raise ConvertError(f"verify_export: {export_dir} has memory layers {sorted(ref.mem_layers)}, "
                       f"{checkpoint} {sorted(model.cfg.mem_layers)}: not its export")
  window = int(window or ref.window)
  text = open(text_path, encoding="utf-8").read() if text_path else inspect.getsource(inspect)
  vocab = model.vocabulary(vocab)
  ids = [int(vocab.bos_id)] + list(vocab.encode(text))[:tokens - 1]
  if len(ids) < tokens:
    raise ConvertError(f"verify_export: the text gives {len(ids)} tokens, fewer than --tokens={tokens}")
  ids = np.asarray([ids], np.int32)
  ours = model.logits_with_memory(ids, window=window)[0]
  theirs = ref.logits_with_memory(ids, window=window)[0]
  targets = ids[0, 1:]
  nll = lambda lg: float(_nll(lg[:-1], targets).mean())
  return {"tokens": int(ids.shape[1]), "window": window, "windows": -(-ids.shape[1] // window),
          "mem_layers": sorted(model.cfg.mem_layers), "export_dtype": str(ref.config.get("torch_dtype") or ref.config.get("dtype")),
          "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
          "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
          "nll_fot_jax": nll(ours), "nll_torch": nll(theirs)}

