"""Run fot_jax on a Cloud TPU VM pod: every worker runs the same command.

    python -m launch.tpu --name=fot --zone=us-central2-b --accelerator=v4-32 [--dry_run] \\
        up   -- --config=experiments/longllama_3b.py --workdir=gs://BUCKET/longllama_3b
    python -m launch.tpu --name=fot --zone=us-central2-b logs | stop | delete

Actions:
  up      create the TPU VM (or reuse it when it exists), install the project on all
          workers (--install), start the run on all workers, stream worker 0's log
  create  create or reuse;  install  install the project on all workers (--install)
  run     check that every worker imports fot_jax, start `python -m fot_jax.main
          --jax_distributed ARGS` on all workers and stream logs
  logs    stream worker 0's log;  stop  SIGTERM the run on all workers (it checkpoints and
          exits; `run` with the same args resumes);  delete  delete the TPU VM
--install says where the project on the workers (~/fot_jax, a virtual environment in
~/fot_jax/.venv, `pip install -e '.[core,tpu]'`) comes from:
  checkout (default)         this checkout, as a tarball copied to every worker
  git+URL[@REF]              `git fetch URL REF` on every worker (REF: a branch, tag or commit)
  gs://BUCKET/FILE.tar.gz    a tarball of the repository that every worker copies from storage
  check                      install nothing: check that every worker imports fot_jax
--dry_run prints every gcloud command instead of running it. The workdir must be
storage every worker sees (gs://...) so orbax can write checkpoints from all hosts: a
local path is refused before anything starts.
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from typing import List, Optional

from fot_jax import cli

REMOTE_DIR = "~/fot_jax"
REMOTE_PYTHON = ".venv/bin/python"
LOG, PIDFILE = "~/fot_jax_run.log", "~/fot_jax_run.pid"
TARBALL = "/tmp/fot_jax_checkout.tar.gz"
ACTIONS = ("up", "create", "install", "run", "logs", "stop", "delete")
INSTALL_HELP = ("where the workers' project comes from: checkout (this checkout, default), git+URL[@REF], "
                "gs://BUCKET/FILE.tar.gz, or check (install nothing, check that fot_jax imports)")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--name", required=True, help="TPU VM name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default=None)
  p.add_argument("--accelerator", default="v4-32", help="e.g. v4-32, v5p-64, v3-128")
  p.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU VM software version")
  p.add_argument("--spot", action="store_true", help="spot capacity (preemptible; runs resume)")
  p.add_argument("--install", default="checkout", help=INSTALL_HELP)
  p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  return p


def check_workdir(workdir: Optional[str]) -> str:
  """The run's workdir, which every worker must see: gs://BUCKET/PATH, else a ValueError naming it."""
  if not workdir:
    raise ValueError("no --workdir for the run: give --workdir=gs://BUCKET/PATH (storage every worker sees)")
  if not workdir.startswith("gs://") or len(workdir) <= len("gs://"):
    raise ValueError(f"--workdir={workdir}: a TPU pod's workers all write checkpoints to the workdir, so it "
                     f"must be storage they all see: give gs://BUCKET/PATH")
  return workdir


def workdir_arg(main_args: List[str]) -> Optional[str]:
  """The --workdir value among fot_jax.main's arguments (--workdir=X or --workdir X; the last wins)."""
  value = None
  for i, a in enumerate(main_args):
    if a.startswith("--workdir="):
      value = a[len("--workdir="):]
    elif a == "--workdir" and i + 1 < len(main_args):
      value = main_args[i + 1]
  return value


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


def install_source(value: str) -> tuple:
  """--install -> ("checkout",), ("git", URL, REF), ("gs", PATH) or ("check",); a ValueError naming
  anything else."""
  if value in ("checkout", "check"):
    return (value,)
  if value.startswith("git+") and len(value) > len("git+"):
    url, ref = value[len("git+"):], "HEAD"
    if "@" in url.rsplit("/", 1)[-1]:  # URL@REF; an scp-style git@host:path keeps its '@'
      url, ref = url.rsplit("@", 1)
    return ("git", url, ref or "HEAD")
  if value.startswith("gs://") and value.endswith((".tar.gz", ".tgz")):
    return ("gs", value)
  raise ValueError(f"--install={value}: expected checkout, git+URL[@REF], gs://BUCKET/FILE.tar.gz or check")


REMOTE_TARBALL = "~/fot_jax_checkout.tar.gz"
# The project and its TPU dependencies in ~/fot_jax/.venv (no torch/faiss/pytest on workers).
_PIP = (f"cd {REMOTE_DIR} && (test -x {REMOTE_PYTHON} || python3 -m venv .venv) && "
        f"{REMOTE_PYTHON} -m pip install -q -e '.[core,tpu]' "
        f"-f https://storage.googleapis.com/jax-releases/libtpu_releases.html")


def check_command(args) -> List[str]:
  """Every worker imports fot_jax from ~/fot_jax/.venv (fails on a worker where it does not)."""
  return _ssh(args, f"cd {REMOTE_DIR} && {REMOTE_PYTHON} -c 'import fot_jax'")


def not_installed(args) -> str:
  """The one line for a failed check_command."""
  return (f"fot_jax does not import on every worker of TPU VM {args.name} ({REMOTE_DIR}/{REMOTE_PYTHON}); "
          f"install it with --install=checkout (this checkout), --install=git+URL@REF or "
          f"--install=gs://BUCKET/FILE.tar.gz, e.g. python -m launch.tpu --name={args.name} --zone={args.zone} install")


def install_commands(args) -> List[List[str]]:
  """The commands that put the project on every worker, from --install (check: the check alone)."""
  source = install_source(args.install)
  if source[0] == "check":
    return [check_command(args)]
  if source[0] == "git":
    _, url, ref = source
    fetch = (f"mkdir -p {REMOTE_DIR} && cd {REMOTE_DIR} && (test -d .git || git init -q) && "
             f"git fetch -q {shlex.quote(url)} {shlex.quote(ref)} && git checkout -q -f FETCH_HEAD && ")
    return [_ssh(args, fetch + _PIP)]
  unpack = f"mkdir -p {REMOTE_DIR} && tar xzf {REMOTE_TARBALL} -C {REMOTE_DIR} && "
  if source[0] == "gs":
    return [_ssh(args, f"gcloud storage cp {shlex.quote(source[1])} {REMOTE_TARBALL} && " + unpack + _PIP)]
  return [["tar", "czf", TARBALL, "--exclude=.git", "--exclude=.venv", "--exclude=runs", "."],
          _gcloud(args, "scp", TARBALL, f"{args.name}:{REMOTE_TARBALL}", "--worker=all"),
          _ssh(args, unpack + _PIP)]


def check_installed(args, dry_run: bool) -> None:
  """Runs check_command; where it fails, a ValueError (one line: how to install)."""
  if execute(check_command(args), dry_run, check=False):
    raise ValueError(not_installed(args))


def install(args, dry_run: bool) -> None:
  """Runs install_commands (--install=check: check_installed)."""
  if install_source(args.install)[0] == "check":
    check_installed(args, dry_run)
    return
  for cmd in install_commands(args):
    execute(cmd, dry_run)


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
  with cli.expected_errors("launch.tpu"):  # a bad input: `launch.tpu: message`, exit status 2
    return _main(argv)


def _main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  rest = []
  if "--" in argv:
    i = argv.index("--")
    argv, rest = argv[:i], argv[i + 1:]
  p = parser()
  p.add_argument("action", choices=ACTIONS)
  args = p.parse_args(argv)
  n = workers(args.accelerator)
  install_source(args.install)  # a bad --install fails before anything runs
  main_cmd = [REMOTE_PYTHON, "-m", "fot_jax.main", *rest]
  if args.action in ("up", "run"):
    if not rest:
      raise ValueError("give the fot_jax.main arguments after --, e.g. -- --config=experiments/X.py "
                       "--workdir=gs://BUCKET/X")
    check_workdir(workdir_arg(rest))
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
    install(args, args.dry_run)
  if args.action == "run":  # `up` has just installed; a bare `run` checks what is there
    check_installed(args, args.dry_run)
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
