"""One line for an expected failure at the command line, a traceback for a bug.

Every entry point (fot_jax.main, fot_jax.evaluate, fot_jax.convert, fot_jax.study, fot_jax.ask,
fot_jax.eval.lm_harness, data_pipelines.preview, data_pipelines.train_tokenizer) runs its body
through `expected_errors`: a bad input (a missing file, a config value out of range, a checkpoint
that does not restore) raises one of EXPECTED with a message that names the input and what is
wrong, and the user sees `PROG: message` and exit status 2. Anything else is a bug and keeps its
traceback. FOT_JAX_TRACEBACK=1 shows the traceback of expected failures too.
"""
from __future__ import annotations

import contextlib
import os
import sys

# ValueError covers json.JSONDecodeError, UnicodeDecodeError and convert's ConvertError.
EXPECTED = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
            FileExistsError)
EXIT_STATUS = 2


def one_line(e) -> str:
  """An exception's (or a text's) message on one line, whitespace runs folded."""
  return " ".join(str(e).split()) or type(e).__name__


@contextlib.contextmanager
def expected_errors(prog: str):
  """with expected_errors('fot_jax.main'): ... -> an EXPECTED error exits with `prog: message`."""
  try:
    yield
  except EXPECTED as e:
    if os.environ.get("FOT_JAX_TRACEBACK"):
      raise
    fail(prog, e)


def fail(prog: str, message) -> None:
  """Prints `prog: message` (one line) on stderr and ends with EXIT_STATUS."""
  print(f"{prog}: {one_line(message)}", file=sys.stderr, flush=True)
  if _is_main_program(prog):
    # The process ends here: skip interpreter shutdown, where a tf.data prefetch thread still
    # waiting on a Python generator can block forever (seen after an error raised once the
    # data feeds existed). Imported and called in-process (tests), a SystemExit as usual.
    sys.stdout.flush()
    os._exit(EXIT_STATUS)
  sys.exit(EXIT_STATUS)


def _is_main_program(prog: str) -> bool:
  """Is `prog` the module python -m ran?"""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  return getattr(spec, "name", None) in (prog, prog + ".__main__")
