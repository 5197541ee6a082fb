"""Mesh, shardings and the sharded train step on 8 fake CPU devices.

The cases live in tests/multidevice/ (sharded_cases.py; context_parallel_cases.py: sequence
parallelism) and run in a separate pytest process, because the device count is fixed when jax
starts and this suite runs on one; that process starts in the background when this test is
collected (tests/background.py)."""
import os
import sys

from tests import background


def background_command():
  # Unoptimised XLA:CPU code: these cases compile far more than they run (about a third faster).
  flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 " \
          "--xla_llvm_disable_expensive_passes=true"
  cases = [os.path.join(background.ROOT, "tests", "multidevice", f)
           for f in ("sharded_cases.py", "context_parallel_cases.py")]
  return background.pytest_command("--durations=0", *cases), {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, 600


def test_sharded_cases_on_8_fake_cpu_devices():
  rc, out = background.result(sys.modules[__name__])
  print(out[-6000:])
  assert rc == 0, out[-6000:]
  assert " passed" in out and "skipped" not in out
