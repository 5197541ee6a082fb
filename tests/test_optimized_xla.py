"""The numerical equality tests of the attention implementations and the train step, again at
XLA's default optimisation level: the program users run.

The suite compiles unoptimised (tests/conftest.py: it compiles far more than it runs), but
XLA's simplifications change numerics, and once hid a NaN in the blockwise gradients. The tests
marked `optimized_xla` (the attention implementations against dense and the NumPy reference,
forward and gradients; the train step's loss sums and gradient accumulation) run here in a separate pytest process with XLA_FLAGS empty (the defaults)
and a compilation cache of their own, so no program compiled unoptimised is reused.
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("test_attention_impls.py", "test_attention_reference.py", "test_train.py")


def test_marked_equality_tests_pass_at_the_default_optimisation_level():
  with tempfile.TemporaryDirectory(prefix="fot_jax_test_xla_cache_opt_") as cache:
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "optimized_xla",
                           *(os.path.join(ROOT, "tests", f) for f in FILES)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  print(proc.stdout[-3000:], proc.stderr[-2000:])
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  summary = proc.stdout.strip().splitlines()[-1]
  assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
  assert int(summary.split(" passed")[0].split()[-1]) >= 12, summary  # the whole marked group ran
