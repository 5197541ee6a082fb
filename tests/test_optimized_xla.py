"""The numerical equality tests of the attention implementations and the train step, again at
XLA's default optimisation level: the program users run.

The suite compiles unoptimised (tests/conftest.py: it compiles far more than it runs), but
XLA's simplifications change numerics, and once hid a NaN in the blockwise gradients. The tests
marked `optimized_xla` (the attention implementations against dense and the NumPy reference,
forward and gradients; the train step's loss sums and gradient accumulation) run here in a
separate pytest process with XLA_FLAGS empty (the defaults) and a compilation cache of their own,
so no program compiled unoptimised is reused. That process starts in the background when this
test is collected (tests/background.py).
"""
import atexit
import os
import re
import shutil
import sys
import tempfile

from tests import background

FILES = ("test_attention_impls.py", "test_attention_reference.py", "test_train.py")


def background_command():
  cache = tempfile.mkdtemp(prefix="fot_jax_test_xla_cache_opt_")
  atexit.register(shutil.rmtree, cache, ignore_errors=True)
  env = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache}
  files = [os.path.join(background.ROOT, "tests", f) for f in FILES]
  return background.pytest_command("-m", "optimized_xla", *files), env, 900


def test_marked_equality_tests_pass_at_the_default_optimisation_level():
  rc, out = background.result(sys.modules[__name__])
  print(out[-5000:])
  assert rc == 0, out[-6000:]
  summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed)", line)][-1]
  assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
  assert int(summary.split(" passed")[0].split()[-1]) >= 12, summary  # the whole marked group ran
