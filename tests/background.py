"""Test suites that need a pytest process of their own (another device count, other XLA flags),
started in the background as soon as the run has collected their test (tests/conftest.py).

The main process spends most of the suite compiling, on one core; on a 2-core machine the other
core is then idle, and these suites (about 2.5 minutes together) run on it. Their test only waits
for the result and asserts on it. A test module opts in with a `background_command()` returning
(argv, extra environment, timeout in seconds)."""
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNNING = {}  # module name -> (Popen, output file, start time, timeout)


def pytest_command(*args):
  """argv of a pytest run of the checkout's tests (quiet, no cache)."""
  return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def start(module) -> None:
  """Start `module.background_command()` once (a no-op when it already runs)."""
  name = module.__name__
  if name in _RUNNING:
    return
  argv, extra_env, timeout = module.background_command()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env)
  out = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nobody reads it until the end
  proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
  _RUNNING[name] = (proc, out, time.monotonic(), timeout)


def result(module):
  """(return code, output) of the module's background suite, started now if it was not yet."""
  start(module)
  proc, out, t0, timeout = _RUNNING[module.__name__]
  try:
    rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    rc = f"timed out after {timeout} s"
  out.seek(0)
  return rc, out.read()


def stop_all() -> None:
  """Kill what still runs (a run stopped early: -x, ^C)."""
  for proc, out, _, _ in _RUNNING.values():
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    out.close()
  _RUNNING.clear()
