"""Crash anywhere, lose nothing: SIGKILL a small training run at seeded random moments, resume it
each time with the same command, and compare the end with an uninterrupted run.

  python tests/kill_resume.py --kills 20 --out FILE.json [--in_write 5] [--seed 0] [--workdir DIR]

The run is tests/preempt_run.py (a tiny FoT model, one plan shape) with a checkpoint every
--checkpoint_every steps. Two kinds of kill moment, drawn from --seed:
* random: after the child printed k (0-4) step lines, a uniform delay of up to one step (k=0: up
  to its start-up time, so kills land in imports, compiling and restoring too);
* write: as soon as the j-th (1-3) orbax temporary step folder (`<step>.orbax-checkpoint-tmp...`)
  of the child appears in the checkpoints folder, after a delay of 0 or up to 20 ms.
A kill counts as inside a checkpoint write when, with the child dead, a temporary folder it
created is still there (the write was never finalised): that is checked for every kill, of
either kind. Write kills are drawn until at least --in_write kills landed inside a write.
At the end the same command runs to completion, and the final parameters must equal the
uninterrupted run's bit for bit, and metrics.jsonl must hold every step exactly once with the
same values (all but tokens_per_second, a wall-clock rate). Prints progress, writes a JSON
summary to --out and exits 0 only when everything matched and enough kills landed in writes.
tests/test_kill_resume.py runs the same machinery with 1 kill (inside a checkpoint write).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "tests", "preempt_run.py")
TIMING_FIELDS = ("tokens_per_second",)  # wall-clock rates: never equal between two runs


def command(workdir: str, steps: int, checkpoint_every: int, sleep: float) -> List[str]:
  return [sys.executable, RUN, workdir, "--steps", str(steps), "--checkpoint_every", str(checkpoint_every),
          "--sleep", str(sleep)]


def child_env(cache_dir: str) -> Dict[str, str]:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), TF_CPP_MIN_LOG_LEVEL="2")
  if "JAX_COMPILATION_CACHE_DIR" not in env:  # every resume compiles the same step: compile it once
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.3")
  return env


class Child:
  """The training command in a subprocess; a thread reads its output and times its step lines."""

  def __init__(self, cmd: List[str], env: Dict[str, str]):
    self.t0 = time.time()
    self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
    self.lines: List[str] = []
    self.step_times: List[float] = []  # seconds after start of each "step N/M" line
    self.steps: List[int] = []  # their N
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))
      if line.startswith("[train] step ") and "/" in line.split()[2]:
        self.steps.append(int(line.split()[2].split("/")[0]))
        self.step_times.append(time.time() - self.t0)

  def kill(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
    self.proc.wait()
    self.reader.join(timeout=10)

  def finish(self, timeout: float) -> int:
    try:
      rc = self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise RuntimeError(f"kill_resume: the run did not end within {timeout:.0f}s:\n" + "\n".join(self.lines[-20:]))
    self.reader.join(timeout=10)
    return rc

  def resumed_from(self) -> Optional[int]:
    for line in self.lines:
      if "resumed from step" in line:
        return int(line.rsplit(" ", 1)[1])
    return None

  def cleaned(self) -> Dict[str, int]:
    """What the trainer cleared as it started: unfinished writes deleted, log lines dropped."""
    out = {"unfinished_writes_deleted": 0, "metrics_lines_dropped": 0}
    for line in self.lines:
      if "unfinished checkpoint write(s)" in line:
        out["unfinished_writes_deleted"] += int(line.split("deleting ")[1].split()[0])
      if "metrics.jsonl line(s)" in line:
        out["metrics_lines_dropped"] += int(line.split("dropped ")[1].split()[0])
    return out


def temporary_folders(ckpt_dir: str) -> Dict[str, int]:
  """orbax's unfinished step folders (`<step>.orbax-checkpoint-tmp...`): {name: inode}."""
  out = {}
  try:
    names = os.listdir(ckpt_dir)
  except FileNotFoundError:
    return out
  for n in names:
    if ".orbax-checkpoint-tmp" in n:
      try:
        out[n] = os.stat(os.path.join(ckpt_dir, n)).st_ino
      except FileNotFoundError:  # finalised (renamed) or deleted meanwhile
        pass
  return out


def own_writes(ckpt_dir: str, child: "Child", leftovers: Dict[str, int]) -> List[str]:
  """The child's unfinished writes: temporary folders of steps it trained (a step is saved after
  its line is printed), other than the leftovers of earlier kills, which it deletes as it starts
  (their modification times move while they are deleted, so times cannot tell them apart; a new
  folder given a leftover's name and inode is missed, never counted wrongly)."""
  printed = set(child.steps)
  return sorted(n for n, ino in temporary_folders(ckpt_dir).items()
                if leftovers.get(n) != ino and n.split(".")[0].isdigit() and int(n.split(".")[0]) in printed)


def kill_once(cmd, env, ckpt_dir: str, kind: str, rng: np.random.Generator, startup_s: float, step_s: float,
              timeout: float) -> Dict:
  """Starts the command, kills it (SIGKILL) at a `kind` moment; -> what happened."""
  leftovers = temporary_folders(ckpt_dir)
  child = Child(cmd, env)
  deadline = time.time() + timeout
  if kind == "write":
    j = int(rng.integers(1, 4))  # the j-th write of this process: the run moves on between kills
    delay = 0.0 if rng.random() < 0.5 else float(rng.uniform(0, 0.02))
    seen = set()
    while child.proc.poll() is None and time.time() < deadline:
      seen.update(own_writes(ckpt_dir, child, leftovers))
      if len(seen) >= j:
        break
      time.sleep(0.001)
  else:
    k = int(rng.integers(0, 5))
    delay = float(rng.uniform(0, startup_s if k == 0 else step_s))
    while child.proc.poll() is None and len(child.step_times) < k and time.time() < deadline:
      time.sleep(0.002)
  if kind != "write" and k == 0:  # a start-up time measured cold (compiling) may overshoot: the first step ends it
    until = time.time() + delay
    while child.proc.poll() is None and not child.step_times and time.time() < until:
      time.sleep(0.002)
  else:
    time.sleep(delay)
  finished = child.proc.poll() is not None
  child.kill()
  left = own_writes(ckpt_dir, child, leftovers)
  return {"kind": kind, "delay_s": round(delay, 4), "seconds": round(time.time() - child.t0, 2),
          "first_step_s": child.step_times[0] if child.step_times else None,
          "resumed_from": child.resumed_from(), "steps_printed": len(child.step_times), **child.cleaned(),
          "in_write": bool(left), "left": left, "ended_before_kill": finished,
          "exit": child.proc.returncode, "tail": child.lines[-3:] if finished else []}


def read_metrics(path: str) -> List[Dict]:
  with open(path) as f:
    return [json.loads(line) for line in f]


def compare(workdir: str, reference: str, steps: int) -> Dict:
  """Final parameters (bit for bit) and metrics.jsonl (every step once, same values) against the
  uninterrupted run; -> {'params_identical', 'metrics_identical', 'problems': [...]}."""
  problems = []
  got, want = np.load(os.path.join(workdir, "final_params.npz")), np.load(os.path.join(reference,
                                                                                       "final_params.npz"))
  params_ok = sorted(got.files) == sorted(want.files)
  if not params_ok:
    problems.append(f"parameter names differ: {sorted(set(got.files) ^ set(want.files))}")
  for k in want.files if params_ok else []:
    try:
      np.testing.assert_array_equal(got[k], want[k])
    except AssertionError as e:
      params_ok = False
      problems.append(f"parameter {k} differs: {str(e).strip().splitlines()[-1]}")
  rows, ref = read_metrics(os.path.join(workdir, "metrics.jsonl")), read_metrics(os.path.join(reference,
                                                                                           "metrics.jsonl"))
  seen = [r["step"] for r in rows]
  metrics_ok = seen == list(range(1, steps + 1))
  if not metrics_ok:
    problems.append(f"metrics.jsonl steps are {seen}, not 1..{steps} once each")
  for a, b in zip(rows, ref):
    a, b = ({k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in (a, b))
    if a != b:
      metrics_ok = False
      problems.append(f"metrics of step {b['step']} differ: {a} != {b}")
  return {"params_identical": params_ok, "metrics_identical": metrics_ok, "problems": problems[:20]}


def kill_and_resume(workdir: str, kills: int, in_write: int = 5, seed: int = 0, steps: int = 0,
                    checkpoint_every: int = 2, sleep: float = 0.25, timeout: float = 600,
                    log=None) -> Dict:
  """The whole experiment in `workdir` (its `killed` and `reference` subfolders); -> the summary."""
  log = log or (lambda msg: print(msg, flush=True))
  steps = steps or 4 * kills + 10  # a kill moves the run on by ~2 steps (at most 6): rarely finishes early
  t_start = time.time()
  killed, reference = os.path.join(workdir, "killed"), os.path.join(workdir, "reference")
  for d in (killed, reference):
    shutil.rmtree(d, ignore_errors=True)
  env = child_env(os.path.join(workdir, "xla_cache"))
  rng = np.random.default_rng(seed)

  ref = Child(command(reference, steps, checkpoint_every, sleep), env)
  if ref.finish(timeout) != 0:
    raise RuntimeError("kill_resume: the uninterrupted run failed:\n" + "\n".join(ref.lines[-20:]))
  startup_s = ref.step_times[0] if ref.step_times else 5.0
  step_s = float(np.median(np.diff(ref.step_times))) if len(ref.step_times) > 1 else 0.2
  log(f"kill_resume: uninterrupted run: {steps} steps in {time.time() - ref.t0:.1f}s "
      f"(first step after {startup_s:.1f}s, then {step_s:.3f}s a step)")

  cmd, ckpt_dir = command(killed, steps, checkpoint_every, sleep), os.path.join(killed, "checkpoints")
  records: List[Dict] = []
  landed = 0
  while len(records) < kills or landed < in_write:
    if len(records) >= kills + 4 * in_write:
      break  # write kills that keep missing: reported, not retried forever
    remaining, needed = kills - len(records), in_write - landed
    kind = "write" if needed > 0 and (needed >= remaining or rng.random() < 0.5) else "random"
    rec = kill_once(cmd, env, ckpt_dir, kind, rng, startup_s, step_s, timeout)
    records.append(rec)
    landed += rec["in_write"]
    if rec["first_step_s"]:  # start-up with the compile cache warm: the bound of the next start-up kills
      startup_s = min(startup_s, rec["first_step_s"])
    where = "inside a checkpoint write" if rec["in_write"] else "outside checkpoint writes"
    log(f"kill {len(records)}: {kind} moment, SIGKILL after {rec['seconds']:.2f}s "
        f"(resumed from {rec['resumed_from']}, {rec['steps_printed']} steps printed): {where}"
        + (f" {rec['left']}" if rec["left"] else ""))
    if rec["ended_before_kill"]:
      log(f"kill_resume: the run ended (exit {rec['exit']}) before its kill: {rec['tail']}")
      break

  last = Child(cmd, env)
  rc = last.finish(timeout)
  if rc != 0:
    raise RuntimeError(f"kill_resume: the last resume failed (exit {rc}):\n" + "\n".join(last.lines[-20:]))
  log(f"kill_resume: the last resume (from step {last.resumed_from()}) ran to step {steps}")
  cleaned = records + [last.cleaned()]
  result = compare(killed, reference, steps)
  identical = result["params_identical"] and result["metrics_identical"]
  summary = {"kills": len(records), "kills_inside_checkpoint_writes": landed,
             "write_kills_drawn": sum(r["kind"] == "write" for r in records),
             "kills_during_startup": sum(r["steps_printed"] == 0 for r in records),
             "unfinished_writes_deleted": sum(r["unfinished_writes_deleted"] for r in cleaned),
             "metrics_lines_dropped": sum(r["metrics_lines_dropped"] for r in cleaned),
             "required_inside_writes": in_write, "steps": steps, "checkpoint_every": checkpoint_every,
             "step_sleep_s": sleep, "seed": seed, "identical": identical, **result,
             "wall_s": round(time.time() - t_start, 1), "records": records}
  log(f"kill_resume: {len(records)} kills, {landed} inside checkpoint writes, {summary['kills_during_startup']} "
      f"during start-up; the resumes deleted {summary['unfinished_writes_deleted']} unfinished writes and dropped "
      f"{summary['metrics_lines_dropped']} metrics lines; parameters "
      f"{'bit-identical' if result['params_identical'] else 'DIFFER'}, metrics "
      f"{'identical' if result['metrics_identical'] else 'DIFFER'}; {summary['wall_s']:.0f}s")
  for p in result["problems"]:
    log(f"  {p}")
  return summary


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description="SIGKILL a small training run at random moments, resume it, "
                                          "compare with an uninterrupted run.")
  p.add_argument("--kills", type=int, default=20)
  p.add_argument("--in_write", type=int, default=5, help="at least this many kills inside checkpoint writes")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps", type=int, default=0, help="training steps (default 4 x kills + 10)")
  p.add_argument("--checkpoint_every", type=int, default=2)
  p.add_argument("--sleep", type=float, default=0.25, help="seconds of sleep per step's batch")
  p.add_argument("--workdir", default="", help="where the runs go (default: a temporary folder, removed)")
  p.add_argument("--out", default="", help="JSON summary")
  a = p.parse_args(argv)
  if a.kills < 0 or a.in_write < 0 or a.in_write > a.kills:
    print(f"kill_resume: --kills {a.kills} --in_write {a.in_write}: need 0 <= in_write <= kills", file=sys.stderr)
    return 2
  workdir = a.workdir or tempfile.mkdtemp(prefix="kill_resume_")
  try:
    summary = kill_and_resume(workdir, a.kills, a.in_write, a.seed, a.steps, a.checkpoint_every, a.sleep)
  finally:
    if not a.workdir:
      shutil.rmtree(workdir, ignore_errors=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(summary, f, indent=1)
  return 0 if summary["identical"] and summary["kills_inside_checkpoint_writes"] >= a.in_write else 1


if __name__ == "__main__":
  sys.exit(main())
