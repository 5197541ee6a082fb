"""fot_jax entry point: python -m fot_jax.main --config=experiments/X.py --workdir=DIR [--mode=train]

Every host runs the same command; process 0 alone logs and writes results.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import jax  # noqa: E402  (imported only: no backend starts before --mode=plan's fake devices are set)
from absl import logging  # noqa: E402

from fot_jax import cli, configs, parallel, plan  # noqa: E402
from fot_jax.runners import dictionary  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file (one get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and results go.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "evaluate", "plan"],
                          "train: train (or resume) and evaluate; evaluate: evaluate saved checkpoints; "
                          "plan: parameters, FLOPs and per-device memory of the compiled train step "
                          "on the configured mesh, compiled for fake CPU devices (allocates nothing), "
                          "and the largest buffers live at its peak (--plan_top).")
_PLAN_DEVICES = flags.DEFINE_integer("plan_devices", 0, "--mode=plan: devices to plan for (default: the "
                                     "product of the mesh sizes; needed when one size is -1).")
_PLAN_TOP = flags.DEFINE_integer("plan_top", 10, "--mode=plan: how many of the largest buffers live at the "
                                 "step's peak to list (0: none, and no XLA dump).")
_PLAN_JSON = flags.DEFINE_string("plan_json", None, "--mode=plan: also write the plan to this JSON file (every "
                                 "printed figure, the printed text, the command and its provenance; "
                                 "docs/plan_figures.py fills docs/scale_out.md from such files).")
_SWEEP_RUN = flags.DEFINE_string("sweep_run", None, "A run name from the experiment file's get_sweep(): "
                                  "applies its overrides (launch/sweep.py passes it).")
_DISTRIBUTED = flags.DEFINE_bool("jax_distributed", False, "Start jax.distributed with cluster "
                                  "auto-detection (TPU pods, SLURM); launch/tpu.py sets it on every worker.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "Multi-process without auto-detection "
                                   "(GPU/CPU clusters): host:port of process 0. TPU pods need nothing.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --coordinator_address.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --coordinator_address.")


def _plan_devices(config) -> int:
  """Devices for --mode=plan; must be known before jax starts (fake CPU devices)."""
  sizes = [int(config.mesh.get(a, 1)) for a in ("data", "fsdp", "tensor", "context")] if "mesh" in config else [1]
  dcn = [int(config.mesh.get(f"dcn_{a}", 1)) for a in ("data", "fsdp", "tensor", "context")] if "mesh" in config else [1]
  if _PLAN_DEVICES.value:
    return _PLAN_DEVICES.value
  if -1 in sizes:
    raise ValueError("--mode=plan: a mesh size is -1; give the device count with --plan_devices=N")
  n = 1
  for v in sizes + dcn:
    n *= v
  return n


_REMOVE_AT_END = []  # --mode=plan's XLA dump folder (an error exits with os._exit: no atexit)


def main(argv):
  del argv
  with cli.expected_errors("fot_jax.main"):  # a bad input: `fot_jax.main: message`, exit status 2
    try:
      _main()
    finally:
      for path in _REMOVE_AT_END:
        shutil.rmtree(path, ignore_errors=True)


def _experiment_config():
  """The --config experiment (with its --config.* overrides); a missing or unloadable file is a
  FileNotFoundError naming it (config_flags defers its IOError to the first access)."""
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":", 1)[0]  # FILE or FILE:ARG
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config={path}: no such experiment file")
  config = _CONFIG.value
  try:
    config.get("experiment")
  except OSError as e:
    cause = e.__cause__ or e
    raise FileNotFoundError(f"--config={path}: the experiment file does not load ({cause})") from None
  return config


def _main():
  if _CONFIG.value is None or (_WORKDIR.value is None and _MODE.value != "plan"):
    raise ValueError("both --config=experiments/FILE.py and --workdir=DIR are required")
  config = _experiment_config()
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    if _SWEEP_RUN.value:
      sweep = {r["name"]: r for r in configs.sweep_runs(
          config_flags.get_config_filename(flags.FLAGS["config"]).split(":", 1)[0])}
      if _SWEEP_RUN.value not in sweep:
        raise ValueError(f"--sweep_run={_SWEEP_RUN.value}: not a run of get_sweep(); runs: {sorted(sweep)}")
      configs.apply_overrides(config, sweep[_SWEEP_RUN.value])
    if _MODE.value == "plan":  # fake CPU devices: must be set before jax initialises its backend
      os.environ["JAX_PLATFORMS"] = "cpu"
      jax.config.update("jax_platforms", "cpu")  # jax read JAX_PLATFORMS when imported, above
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                 f" --xla_force_host_platform_device_count={_plan_devices(config)}")
      plan_dump = None
      if _PLAN_TOP.value > 0:  # XLA's buffer assignment and live ranges, read back by xla_buffers.largest_buffers
        given = re.findall(r"--xla_dump_to=(\S+)", os.environ["XLA_FLAGS"])
        plan_dump = given[-1] if given else tempfile.mkdtemp(prefix="fot_jax_plan_xla_")  # a given one is kept
        if not given:
          _REMOVE_AT_END.append(plan_dump)
        os.environ["XLA_FLAGS"] += f" --xla_dump_to={plan_dump} --xla_dump_hlo_as_text"
    exp = configs.resolve(config, check_data=_MODE.value != "plan")  # a plan reads no data
  except ValueError as e:
    raise ValueError(f"config error: {e}") from e
  if _MODE.value == "plan":
    try:
      p = plan.plan(exp, plan_dump, _PLAN_TOP.value)
    except ValueError as e:
      raise ValueError(f"config error: {e}") from e
    print(plan.format_plan(p), flush=True)
    if _PLAN_JSON.value:
      plan.write_plan_json(_PLAN_JSON.value, p, sys.argv)
    return
  parallel.initialize_distributed(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  train = _MODE.value == "train"
  if exp.kind == "dictionary_lookup":
    dictionary.run(exp, _WORKDIR.value, train=train)
  else:  # the LM experiments read SeqIO data: TensorFlow loads here, not for the dictionary task
    from fot_jax.runners import baselines, lm
    (lm.run if exp.kind == "lm" else baselines.run)(exp, _WORKDIR.value, train=train)

if __name__ == "__main__":
  app.run(main, flags_parser=cli.flag_parser("fot_jax.main"))
