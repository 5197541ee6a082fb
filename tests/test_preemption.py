"""SIGTERM mid-run saves a checkpoint and exits 0; the same command resumes to the
same parameters as an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import preempt_run  # noqa: E402


def _command(workdir):
  return [sys.executable, os.path.join(ROOT, "tests", "preempt_run.py"), str(workdir)]


def test_sigterm_checkpoints_and_the_same_command_resumes(tmp_path):
  env = dict(os.environ, FOT_STEP_SLEEP="0.5", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  workdir = tmp_path / "preempted"
  proc = subprocess.Popen(_command(workdir), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  assert "SIGTERM: saved step" in out
  saved = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  assert saved and 2 <= saved[-1] < preempt_run.STEPS, (saved, out)
  assert not (workdir / "final_params.npz").exists()
  # The same command continues from the saved step to the end.
  proc = subprocess.run(_command(workdir), env=dict(env, FOT_STEP_SLEEP="0"), cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"resumed from step {saved[-1]}" in proc.stdout
  steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  assert steps[-1] == preempt_run.STEPS
  # An uninterrupted run (in this process) ends with the same parameters.
  reference = preempt_run.run(str(tmp_path / "reference"))
  assert len(reference["history"]) == preempt_run.STEPS
  resumed = np.load(workdir / "final_params.npz")
  ref = np.load(tmp_path / "reference" / "final_params.npz")
  assert sorted(resumed.files) == sorted(ref.files)
  for k in ref.files:
    np.testing.assert_array_equal(resumed[k], ref[k])
