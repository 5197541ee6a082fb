"""Expand an experiment's get_sweep() into named runs, each with its own workdir.

    python -m launch.sweep --config=experiments/analysis_184m_c4.py --workdir=runs/analysis [--dry_run]
    python -m launch.sweep --config=... --workdir=gs://bucket/analysis --tpu=NAME --zone=ZONE \\
        [--install=checkout|git+URL[@REF]|gs://BUCKET/FILE.tar.gz|check] [--dry_run]

Locally the runs go one after another (`python -m fot_jax.main ... --sweep_run=NAME
--workdir=WORKDIR/NAME`); a run that finished resumes to its end at once, so the same
command continues an interrupted sweep. With --tpu (a TPU VM that exists: `python -m
launch.tpu ... create`) the workdir must be gs://... (every worker writes checkpoints
there; a local path is refused), the project is installed on every worker first as
launch/tpu.py's --install says (default: this checkout; `check` only checks that fot_jax
imports), then each run goes to the pod (run, stream logs), one after another.
--dry_run prints the commands.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from typing import List

from fot_jax import cli, configs


def run_commands(config: str, workdir: str, python: str = "python", extra: List[str] = ()) -> List[List[str]]:
  """One fot_jax.main command per run of the sweep."""
  cmds = []
  for run in configs.sweep_runs(config):
    cmds.append([python, "-m", "fot_jax.main", f"--config={config}", f"--sweep_run={run['name']}",
                 f"--workdir={workdir.rstrip('/')}/{run['name']}", *extra])
  return cmds


def main(argv=None) -> int:
  with cli.expected_errors("launch.sweep"):  # a bad input: `launch.sweep: message`, exit status 2
    return _main(argv)


def _main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="runs go to WORKDIR/NAME (gs://... with --tpu)")
  parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  parser.add_argument("--tpu", help="run on this TPU VM (see launch/tpu.py) instead of locally; launch/tpu.py's "
                      "flags (--zone, --project, --install) apply")
  args, rest = parser.parse_known_args(argv)
  if args.tpu:
    from launch import tpu
    tpu.check_workdir(args.workdir)
    tpu_args, extra = tpu.parser().parse_known_args(["--name", args.tpu] + rest)
    tpu.install_source(tpu_args.install)  # a bad --install fails before anything runs
    cmds = run_commands(args.config, args.workdir, tpu.REMOTE_PYTHON, extra)
    tpu.install(tpu_args, args.dry_run)  # once, before the first run
    for cmd in cmds:
      for step in tpu.run_commands(tpu_args, cmd):
        tpu.execute(step, args.dry_run)
    return 0
  cmds = run_commands(args.config, args.workdir, sys.executable, rest)
  for cmd in cmds:
    print("$ " + shlex.join(cmd), flush=True)
    if not args.dry_run:
      code = subprocess.call(cmd)
      if code:
        print(f"run failed with status {code}; the same command resumes the sweep", flush=True)
        return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
