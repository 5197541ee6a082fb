"""Evaluation suite entry point.

  python -m fot_jax.evaluate --checkpoint PATH --suite=ppl,rd,passkey,niah,dict --workdir W \\
      [--mem_layers=8,16,24|all|none|auto:N] [--eval.ppl.memory_tokens='(0,2048)' --eval.task=stdlib ...]
  python -m fot_jax.evaluate compare W1 W2 ... [--workdir OUT]

PATH is an fot_jax checkpoint (a training arm's workdir, or what `convert import_hf` /
`import_gguf` wrote), a Hugging Face LLaMA directory or a LLaMA GGUF file. --mem_layers
evaluates the same weights with other memory layers (0-based; 'all', or 'none' for no memory;
'auto:N' picks N with the retrieval-head probe, run first on the model without memory layers,
with the eval.heads settings). Each suite writes W/eval/<suite>.json and its PNG plot(s);
W/eval/report.md gathers them. `compare` puts several workdirs' results in one table per suite
and on shared plots (OUT/compare.md, default ./eval_compare).
Settings and their defaults: fot_jax/eval/settings.py SuiteSettings. Flags and settings are checked
before JAX or TensorFlow is imported (a bad input ends in one line at once).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import dataclasses  # noqa: E402
import json  # noqa: E402

from fot_jax import cli  # noqa: E402
from fot_jax.eval import settings as eval_settings, report  # noqa: E402
from fot_jax.model.config import ModelConfig  # noqa: E402

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "fot_jax checkpoint or Hugging Face directory.")
_SUITE = flags.DEFINE_string("suite", ",".join(eval_settings.SUITES), "Comma-separated suites: "
                             + ", ".join(eval_settings.SUITES))
_WORKDIR = flags.DEFINE_string("workdir", None, "Results go to WORKDIR/eval/ (compare: WORKDIR/compare.md).")
_NAME = flags.DEFINE_string("name", None, "Run name in tables and plots (default: the checkpoint's folder).")
_MEM_LAYERS = flags.DEFINE_string("mem_layers", None, "Memory layers over the checkpoint's: comma-separated "
                                  "0-based layers, 'all', 'none' or 'auto:N' (the N layers with the best "
                                  "retrieval heads, fot_jax/eval/heads.py; default: the checkpoint's).")
_OVERRIDES = flags.DEFINE_string("model_overrides", None, "ModelConfig fields over the checkpoint's, as JSON, e.g. "
                                 "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}, "
                                 "\"attention_impl\": \"blockwise\"}' (a RoPE method with a window as long as the prompt).")
try:  # config_flags parses the --eval.FIELD overrides here, at definition, not inside app.run
  _EVAL = config_flags.DEFINE_config_dict("eval", eval_settings.default_config(), "Suite settings.")
except (KeyError, AttributeError) as e:
  cli.fail("fot_jax.evaluate", cli.override_error(e, sys.argv))


def _model_overrides(text):
  """--model_overrides JSON -> a dict of ModelConfig fields (checked against the dataclass)."""
  if not text:
    return {}
  try:
    out = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--model_overrides: not JSON ({e}): {text!r}") from None
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  if not isinstance(out, dict) or set(out) - fields:
    raise ValueError(f"--model_overrides: a JSON object of ModelConfig fields expected; unknown: "
                     f"{sorted(set(out) - fields) if isinstance(out, dict) else out!r}")
  if "mem_layers" in out:
    raise ValueError("--model_overrides: give memory layers with --mem_layers")
  return out


def main(argv):
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  args = argv[1:]
  with cli.expected_errors("fot_jax.evaluate"):
    if args and args[0] == "compare":
      if len(args) < 2:
        raise ValueError("compare: give one or more workdirs: python -m fot_jax.evaluate compare W1 W2 ...")
      report.compare(args[1:], _WORKDIR.value or "eval_compare")
      return
    if args:
      raise ValueError(f"unexpected arguments {args}; the only command is `compare`")
    if not _CHECKPOINT.value or not _WORKDIR.value:
      raise ValueError("--checkpoint=PATH and --workdir=DIR are required")
    suites = [s.strip() for s in _SUITE.value.split(",") if s.strip()]
    layers = None if _MEM_LAYERS.value is None else cli.parse_mem_layers(_MEM_LAYERS.value, auto=True)
    overrides = _model_overrides(_OVERRIDES.value)
    settings = eval_settings.SuiteSettings.from_dict(_EVAL.value)  # the one read of --eval.*
    # the suites load JAX and TensorFlow (seconds): only once the flags have passed their checks
    from fot_jax.eval import heads, suite as suite_lib
    if isinstance(layers, str) and layers.startswith("auto"):  # the probe runs on the model first
      h = settings.heads
      layers = heads.resolve_auto_layers(layers, _CHECKPOINT.value, settings.vocab, h.n_prompts, h.length,
                                         settings.seed)
    if layers is not None:
      overrides["mem_layers"] = layers
    suite_lib.run(_CHECKPOINT.value, suites, _WORKDIR.value, settings, _NAME.value, **overrides)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flag_parser("fot_jax.evaluate", "checkpoint"))
