"""Does an export reproduce the model? fot_jax's memory inference on the checkpoint against the
independent PyTorch reference (torch_reference.TorchMemoryLlama) on the exported directory, on
the same tokens of real text, window by window with dense memory, judged against tolerances.

Both sides compute in float32 (fot_jax with the checkpoint's parameters at full float32 matmul
precision, whatever compute dtype the checkpoint records; the reference on the export's weights
widened to float32), so what differs is the export itself:
* a float32 export holds the checkpoint's weights exactly: its logits must agree to float32
  rounding, max |Δ logit| <= MAX_LOGIT_DIFF (1e-3; 1.1e-4 measured on SmolLM2-135M fine-tuned
  with FoT over 512 tokens, ~1e-7 on the tests' tiny models);
* a bfloat16 / float16 export rounds every weight (bf16: 8 bits of mantissa), which moves logits
  by ~0.1-0.3 on a real model: judged by what the rounding must not change, the greedy token
  (argmax agreement >= MIN_ARGMAX_AGREE, 0.98; 99.6% measured on SmolLM2, bf16) and the mean NLL
  of the text (|Δ NLL| <= MAX_NLL_DIFF nats, 0.01; 1.8e-4 measured on SmolLM2, bf16).
A wrong export (a tensor mapped to the wrong name, a transposed or tampered weight, other memory
layers or positions) moves logits by far more than any of these.
"""
from __future__ import annotations

import inspect
import os
from typing import Dict, List, Optional

import jax
import numpy as np

from fot_jax.checkpoint import ConvertError, read_json
from fot_jax.convert import mapping
from fot_jax.convert.api import from_pretrained
from fot_jax.inference import token_nll

MAX_LOGIT_DIFF = 1e-3  # float32 exports
MIN_ARGMAX_AGREE = 0.98  # bfloat16 / float16 exports
MAX_NLL_DIFF = 0.01  # bfloat16 / float16 exports, nats per token
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def failures(r: Dict, max_logit_diff: float = MAX_LOGIT_DIFF, min_argmax_agree: float = MIN_ARGMAX_AGREE,
             max_nll_diff: float = MAX_NLL_DIFF) -> List[str]:
  """What in a verify_export result exceeds its tolerance (by the export's dtype); [] if nothing."""
  out = []
  if r["export_dtype"] == "float32":
    if not r["max_abs_logit_diff"] <= max_logit_diff:  # NaN fails too
      out.append(f"max |Δ logit| {r['max_abs_logit_diff']:.3g} exceeds --max_logit_diff={max_logit_diff:g}")
    return out
  if not r["argmax_agree"] >= min_argmax_agree:
    out.append(f"argmax agreement {r['argmax_agree']:.4f} is below --min_argmax_agree={min_argmax_agree:g}")
  nll_diff = abs(r["nll_torch"] - r["nll_fot_jax"])
  if not nll_diff <= max_nll_diff:
    out.append(f"|Δ NLL| {nll_diff:.3g} exceeds --max_nll_diff={max_nll_diff:g}")
  return out


def verify_export(checkpoint: str, export_dir: str, text_path: Optional[str] = None, tokens: int = 512,
                  window: Optional[int] = None, vocab: str = "", max_logit_diff: float = MAX_LOGIT_DIFF,
                  min_argmax_agree: float = MIN_ARGMAX_AGREE, max_nll_diff: float = MAX_NLL_DIFF) -> Dict:
  """-> {'tokens', 'window', 'windows', 'mem_layers', 'export_dtype', 'max_abs_logit_diff',
  'argmax_agree', 'nll_fot_jax', 'nll_torch', 'ok', 'failures'} over bos + the first `tokens - 1`
  tokens of the text, in `vocab` (a vocabulary spec; default the checkpoint's own). `ok` is False
  and `failures` says what exceeded which tolerance when the export is beyond them (module doc:
  a float32 export by max |Δ logit|, a bfloat16/float16 one by argmax agreement and NLL)."""
  from fot_jax.convert.torch_reference import TorchMemoryLlama  # torch: only this command needs it
  if tokens < 2:
    raise ConvertError(f"verify_export: --tokens must be at least 2, got {tokens}")
  if window is not None and window <= 0:
    raise ConvertError(f"verify_export: --window must be positive, got {window}")
  for name, v in (("max_logit_diff", max_logit_diff), ("max_nll_diff", max_nll_diff)):
    if not v >= 0:
      raise ConvertError(f"verify_export: --{name} must be >= 0, got {v}")
  if not 0 <= min_argmax_agree <= 1:
    raise ConvertError(f"verify_export: --min_argmax_agree must be in [0, 1], got {min_argmax_agree}")
  if text_path and not os.path.isfile(text_path):
    raise ConvertError(f"verify_export: --text {text_path}: file not found")
  config_path = os.path.join(export_dir, "config.json")
  if not os.path.exists(config_path):
    raise ConvertError(f"verify_export: {export_dir} has no config.json (not an export_hf directory)")
  config = read_json(config_path)
  mapping.model_config_from_hf(config, config_path)  # a config the reference can read, or one line naming it
  export_dtype = str(config.get("torch_dtype") or config.get("dtype"))
  if export_dtype not in EXPORT_DTYPES:
    raise ConvertError(f"{config_path}: torch_dtype {export_dtype!r} is not one of {EXPORT_DTYPES}: "
                       f"verify_export cannot choose its tolerances")
  model = from_pretrained(checkpoint, dtype="float32")
  ref = TorchMemoryLlama(export_dir)
  if sorted(ref.mem_layers) != sorted(model.cfg.mem_layers):
    raise ConvertError(f"verify_export: {export_dir} has memory layers {sorted(ref.mem_layers)}, "
                       f"{checkpoint} {sorted(model.cfg.mem_layers)}: not its export")
  if ref.vocab_size != model.cfg.vocab_size:
    raise ConvertError(f"verify_export: {export_dir} has vocab_size {ref.vocab_size}, {checkpoint} "
                       f"{model.cfg.vocab_size}: not its export")
  window = int(window or ref.window)
  try:
    text = open(text_path, encoding="utf-8").read() if text_path else inspect.getsource(inspect)
  except (OSError, UnicodeDecodeError) as e:
    raise ConvertError(f"verify_export: --text {text_path}: unreadable ({e})") from None
  vocab = model.vocabulary(vocab)
  ids = [int(vocab.bos_id)] + list(vocab.encode(text))[:tokens - 1]
  if len(ids) < tokens:
    raise ConvertError(f"verify_export: the text gives {len(ids)} tokens, fewer than --tokens={tokens}")
  ids = np.asarray([ids], np.int32)
  with jax.default_matmul_precision("float32"):  # no TF32 / bf16 passes on accelerators
    ours = model.logits_with_memory(ids, window=window)[0]
  theirs = ref.logits_with_memory(ids, window=window)[0]
  targets = ids[0, 1:]
  nll = lambda lg: float(token_nll(lg[:-1], targets).mean())
  r = {"tokens": int(ids.shape[1]), "window": window, "windows": -(-ids.shape[1] // window),
       "mem_layers": sorted(model.cfg.mem_layers), "export_dtype": export_dtype,
       "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
       "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
       "nll_fot_jax": nll(ours), "nll_torch": nll(theirs)}
  r["failures"] = failures(r, max_logit_diff, min_argmax_agree, max_nll_diff)
  r["ok"] = not r["failures"]
  return r
