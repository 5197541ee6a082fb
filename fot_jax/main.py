"""fot_jax entry point: python -m fot_jax.main --config=experiments/X.py --workdir=DIR [--mode=train]

Every host runs the same command; process 0 alone logs and writes results.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file (one get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and results go.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "evaluate"],
                          "train: train (or resume) and evaluate; evaluate: evaluate saved checkpoints.")


def main(argv):
  del argv
  if _CONFIG.value is None or _WORKDIR.value is None:
    sys.exit("fot_jax.main: both --config=experiments/FILE.py and --workdir=DIR are required")
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from fot_jax import configs
  config = _CONFIG.value
  try:
    configs.validate(config)
  except ValueError as e:
    sys.exit(f"config error: {e}")
  if config.experiment == "dictionary_lookup":
    from fot_jax import runs
    runs.run_dictionary_lookup(config, _WORKDIR.value, train=_MODE.value == "train")
  elif config.experiment == "lm":
    from fot_jax import runs
    runs.run_lm(config, _WORKDIR.value, train=_MODE.value == "train")


if __name__ == "__main__":
  app.run(main)
