"""Compile cheaply: one persistent XLA compilation cache for the whole test run, and unoptimised
XLA:CPU code.

Many tests compile the same programs (a train step of the same tiny config in several tests, a
run and its resumed twin, the subprocesses of the main job and the multi-device cases); with a
cache the second compile is a disk read (docs/tests.md: test_data_train.py + test_train.py 128 s
-> 84-90 s on 2 cores).
The cache is new for every run (a temporary directory, removed at the end), so no test ever reads
a program compiled from other code; subprocesses inherit it through the environment. Set
JAX_COMPILATION_CACHE_DIR yourself to keep one between runs.

Most tests compile far more than they run, so LLVM's optimisations are turned off (as the
multi-device cases already were): side by side on 2 cores, four test files went 148 s -> 133 s,
the compile-bound ones 22% faster and the one real training (test_learning.py) 28 s -> 40 s.
A test run with XLA_FLAGS already set keeps them as they are.
"""
import atexit
import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # before jax is imported: jax reads these at import
  _cache = tempfile.mkdtemp(prefix="fot_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"  # a cheaper compile is not worth its write
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_collection_finish(session):
  """Start the suites that run in a process of their own (tests/background.py) as soon as their
  test is collected: they use the core this process leaves idle while it compiles."""
  if session.config.option.collectonly:
    return
  from tests import background
  for module in {item.module for item in session.items if hasattr(item, "module")}:
    if hasattr(module, "background_command"):
      background.start(module)


def pytest_sessionfinish(session):
  from tests import background
  background.stop_all()
