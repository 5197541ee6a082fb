"""One persistent XLA compilation cache for the whole test run.

Many tests compile the same programs (a train step of the same tiny config in several tests, a
run and its resumed twin, the subprocesses of the main job and the multi-device cases); with a
cache the second compile is a disk read (docs/tests.md: test_data_train.py + test_train.py 128 s
-> 84-90 s on 2 cores).
The cache is new for every run (a temporary directory, removed at the end), so no test ever reads
a program compiled from other code; subprocesses inherit it through the environment. Set
JAX_COMPILATION_CACHE_DIR yourself to keep one between runs.
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
