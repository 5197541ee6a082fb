"""python -m fot_jax.study --config=experiments/study_*.py[:METHOD,METHOD] --workdir=W

The study file is loaded and read into StudySettings (fot_jax.study.settings: every field, method and
fine-tune checked) before JAX or TensorFlow is imported, so a bad input ends in one line
`fot_jax.study: ...`, exit status 2, at once; the run takes the settings read here."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fot_jax import cli  # noqa: E402
from fot_jax.study.settings import StudySettings  # noqa: E402


PROG = "fot_jax.study"


def main(argv):
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  with cli.expected_errors(PROG):
    if len(argv) > 1:
      raise ValueError(f"unexpected arguments {argv[1:]}")
    spec = config_flags.get_config_filename(f["config"]) if f["config"].present else ""
    path = spec.split(":", 1)[0]  # FILE or FILE:ARG (ARG goes to get_config)
    if not path or not f.workdir:
      raise ValueError("--config=experiments/study_*.py and --workdir=DIR are required")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--config: no study file at {path}")
    config = f.config
    try:
      getattr(config, "methods", None)  # ml_collections defers a study file's own IOError to here
    except OSError as e:
      raise ValueError(f"--config={spec}: the study file failed to load: {e}") from None
    try:
      study = StudySettings.from_dict(config)
    except ValueError as e:
      raise ValueError(f"{spec}: {e}") from None
    # the run loads JAX and TensorFlow (seconds): only once the study file has passed its checks
    from fot_jax.study.run import run
    run(study, f.workdir)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Study file (one get_config()).")
  flags.DEFINE_string("workdir", None, "Where the base, per-method results, table and figures go.")
  app.run(main, flags_parser=cli.flag_parser(PROG))
