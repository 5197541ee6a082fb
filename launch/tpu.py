"""Run fot_jax on a Cloud TPU VM pod: every worker runs the same command.

    python -m launch.tpu --name=fot --zone=us-central2-b --accelerator=v4-32 [--dry_run] \\
        up   -- --config=experiments/longllama_3b.py --workdir=gs://BUCKET/longllama_3b
    python -m launch.tpu --name=fot --zone=us-central2-b logs | stop | delete

Actions:
  up      create the TPU VM (or reuse it when it exists), install the project on all
          workers, start the run on all workers, stream worker 0's log
  create  create or reuse;  install  copy this checkout and pip install on all workers
  run     start `python -m fot_jax.main --jax_distributed ARGS` on all workers and stream logs
  logs    stream worker 0's log;  stop  SIGTERM the run on all workers (it checkpoints and
          exits; `run` with the same args resumes);  delete  delete the TPU VM
--dry_run prints every gcloud command instead of running it. The workdir must be
storage every worker sees (gs://...) so orbax can write checkpoints from all hosts.
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from typing import List

REMOTE_DIR = "~/fot_jax"
REMOTE_PYTHON = ".venv/bin/python"
LOG, PIDFILE = "~/fot_jax_run.log", "~/fot_jax_run.pid"
TARBALL = "/tmp/fot_jax_checkout.tar.gz"
ACTIONS = ("up", "create", "install", "run", "logs", "stop", "delete")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--name", required=True, help="TPU VM name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default=None)
  p.add_argument("--accelerator", default="v4-32", help="e.g. v4-32, v5p-64, v3-128")
  p.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU VM software version")
  p.add_argument("--spot", action="store_true", help="spot capacity (preemptible; runs resume)")
  p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  return p


def workers(accelerator: str) -> int:
  """Hosts of a TPU slice: v2/v3/v4/v5p count TensorCores, 8 per host."""
  m = re.fullmatch(r"v(2|3|4|5p)-(\d+)", accelerator)
  if not m:
    raise ValueError(f"--accelerator={accelerator}: expected vN-CORES such as v4-32 (v2, v3, v4, v5p)")
  return max(int(m.group(2)) // 8, 1)


def _gcloud(args, *words) -> List[str]:
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", *words, f"--zone={args.zone}"]
  return cmd + ([f"--project={args.project}"] if args.project else [])


def _ssh(args, command: str, worker: str = "all") -> List[str]:
  return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={command}")


def create_commands(args) -> List[List[str]]:
  """Describe (reuse when it exists) or create. The first command's failure means 'create'."""
  describe = _gcloud(args, "describe", args.name, "--format=value(state)")
  create = _gcloud(args, "create", args.name, f"--accelerator-type={args.accelerator}",
                   f"--version={args.version}") + (["--spot"] if args.spot else [])
  return [describe, create]


def install_commands(args) -> List[List[str]]:
  setup = (f"mkdir -p {REMOTE_DIR} && tar xzf ~/fot_jax_checkout.tar.gz -C {REMOTE_DIR} && cd {REMOTE_DIR} && "
           f"(test -x {REMOTE_PYTHON} || python3 -m venv .venv) && "
           f"{REMOTE_PYTHON} -m pip install -q -e '.[core,tpu]' "  # no torch/faiss/pytest on workers
           f"-f https://storage.googleapis.com/jax-releases/libtpu_releases.html")
  return [["tar", "czf", TARBALL, "--exclude=.git", "--exclude=.venv", "--exclude=runs", "."],
          _gcloud(args, "scp", TARBALL, f"{args.name}:~/fot_jax_checkout.tar.gz", "--worker=all"),
          _ssh(args, setup)]


def run_commands(args, main_cmd: List[str]) -> List[List[str]]:
  """Start main_cmd on every worker (detached, pid saved for `stop`), then stream worker 0."""
  cmd = list(main_cmd)
  if "--jax_distributed" not in cmd:
    cmd.append("--jax_distributed")
  start = (f"cd {REMOTE_DIR} && nohup {shlex.join(cmd)} > {LOG} 2>&1 < /dev/null & "
           f"echo $! > {PIDFILE}")
  return [_ssh(args, start), logs_command(args)]


def logs_command(args) -> List[str]:
  # Ends when the run's process exits, so a sweep moves on to its next run.
  return _ssh(args, f"tail -n +1 --pid=$(cat {PIDFILE}) -f {LOG}", worker="0")


def stop_command(args) -> List[str]:
  return _ssh(args, f"kill -TERM $(cat {PIDFILE})")


def delete_command(args) -> List[str]:
  return _gcloud(args, "delete", args.name, "--quiet")


def execute(cmd: List[str], dry_run: bool, check: bool = True) -> int:
  print("$ " + shlex.join(cmd), flush=True)
  if dry_run:
    return 0
  code = subprocess.call(cmd)
  if check and code:
    raise SystemExit(f"command failed with status {code}: {shlex.join(cmd)}")
  return code


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  rest = []
  if "--" in argv:
    i = argv.index("--")
    argv, rest = argv[:i], argv[i + 1:]
  p = parser()
  p.add_argument("action", choices=ACTIONS)
  args = p.parse_args(argv)
  try:
    n = workers(args.accelerator)
  except ValueError as e:
    sys.exit(f"launch error: {e}")
  main_cmd = [REMOTE_PYTHON, "-m", "fot_jax.main", *rest]
  if args.action in ("up", "run") and not rest:
    sys.exit("launch error: give the fot_jax.main arguments after --, e.g. -- --config=experiments/X.py "
             "--workdir=gs://BUCKET/X")
  print(f"# TPU VM {args.name}: {args.accelerator}, {n} worker(s), zone {args.zone}", flush=True)
  if args.action in ("up", "create"):
    describe, create = create_commands(args)
    if args.dry_run:
      print("# reuse the TPU VM when this succeeds, otherwise create it:")
      execute(describe, True)
      execute(create, True)
    elif execute(describe, False, check=False):
      execute(create, False)
  if args.action in ("up", "install"):
    for cmd in install_commands(args):
      execute(cmd, args.dry_run)
  if args.action in ("up", "run"):
    for cmd in run_commands(args, main_cmd):
      execute(cmd, args.dry_run)
  if args.action == "logs":
    execute(logs_command(args), args.dry_run)
  if args.action == "stop":
    execute(stop_command(args), args.dry_run)
  if args.action == "delete":
    execute(delete_command(args), args.dry_run)
  return 0


if __name__ == "__main__":
  sys.exit(main())
