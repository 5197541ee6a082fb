"""Mesh, shardings and the sharded train step on 8 fake CPU devices.

The cases live in tests/multidevice/ (sharded_cases.py; context_parallel_cases.py: sequence
parallelism) and run in a separate pytest
process, because the device count is fixed when jax starts and this suite runs on one."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_cases_on_8_fake_cpu_devices():
  # Unoptimised XLA:CPU code: these cases compile far more than they run (about a third faster).
  flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 " \
          "--xla_llvm_disable_expensive_passes=true"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cases = [os.path.join(ROOT, "tests", "multidevice", f) for f in ("sharded_cases.py", "context_parallel_cases.py")]
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", *cases],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  print(proc.stdout[-4000:], proc.stderr[-2000:])
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout
