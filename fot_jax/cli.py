"""One line for an expected failure at the command line, a traceback for a bug.

Every entry point (fot_jax.main, fot_jax.evaluate, fot_jax.convert, fot_jax.study, fot_jax.ask,
fot_jax.eval.lm_harness, data_pipelines.preview, data_pipelines.train_tokenizer, launch.tpu,
launch.sweep) runs its body
through `expected_errors`: a bad input (a missing file, a config value out of range, a checkpoint
that does not restore) raises one of EXPECTED with a message that names the input and what is
wrong, and the user sees `PROG: message` and exit status 2. Anything else is a bug and keeps its
traceback. FOT_JAX_TRACEBACK=1 shows the traceback of expected failures too.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys

# ValueError covers json.JSONDecodeError, UnicodeDecodeError and convert's ConvertError.
EXPECTED = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
            FileExistsError)
EXIT_STATUS = 2


def parse_auto(spec: str) -> int:
  """'auto:N' -> N (a positive integer); anything else raises one ValueError line."""
  text = str(spec).strip().lower()
  head, _, n = text.partition(":")
  if head != "auto" or not n.strip().isdigit() or int(n) < 1:
    raise ValueError(f"--mem_layers={spec}: expected auto:N with N a positive number of layers")
  return int(n)


def parse_mem_layers(text, auto: bool = False):
  """A command line's memory layers: '6,17,18,20' -> a tuple of 0-based layers, 'none' / '' -> (),
  'all' -> 'all' (fot_jax.from_pretrained reads it as every layer), and with `auto` 'auto:N' as it is
  (the retrieval-head probe resolves it; N checked here, so a bad one fails before a model loads).
  Anything else raises one ValueError line, quoting the text as given."""
  given, text = text, str(text).strip().lower()
  if text in ("", "none"):
    return ()
  if text == "all":
    return "all"
  if auto and text.startswith("auto"):
    parse_auto(text)
    return text
  try:
    layers = tuple(int(x) for x in text.split(","))
  except ValueError:
    layers = ()
  if not layers or min(layers) < 0:
    raise ValueError(f"--mem_layers: expected comma-separated 0-based layer numbers, 'all', 'none'"
                     f"{' or auto:N' if auto else ''}, got {given!r}")
  return layers


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


def _flag_arg(argv, name: str) -> str:
  """The value of --NAME on the command line ('' if none)."""
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      return a[len(name) + 3:]
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


_DID_YOU_MEAN = re.compile(r'Did you mean "([^"]+)" instead of "([^"]+)"')


def override_error(e: BaseException, argv) -> str:
  """A config override naming a field that does not exist (ml_collections raises KeyError /
  AttributeError from inside absl's parsing, three chained tracebacks): one line naming the
  override and the field, with ml_collections' suggestion."""
  text = " ".join(str(e).replace("\\n", " ").split()).strip("'\"")
  m = _DID_YOU_MEAN.search(text)
  wrong = m.group(2) if m else text.split("'")[1] if text.count("'") >= 2 else text
  given = [a for a in argv if a.startswith("--") and "." in a.split("=", 1)[0]
           and wrong in a.split("=", 1)[0].split(".")]
  where = given[0] if given else "a --FLAG.FIELD override"
  return (f"{where}: no field {wrong!r} in the config" + (f"; did you mean {m.group(1)!r}?" if m else ""))


def flag_parser(prog: str, config_flag: str = "config"):
  """absl's flag parsing (app.run(main, flags_parser=cli.flag_parser(PROG))) with one line
  `PROG: message` (exit 2) for what fails inside it: a --config.FIELD override naming no field
  (with ml_collections' 'did you mean'), a bad flag value, or the experiment file raising while
  it loads (e.g. FILE:ARG naming an argument its get_config() does not take).
  FOT_JAX_TRACEBACK=1 keeps the traceback."""
  from absl import flags

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - only flag parsing and the experiment file's code run here
      if os.environ.get("FOT_JAX_TRACEBACK"):
        raise
      cause = e
      while isinstance(cause, flags.Error) and cause.__cause__ is not None:
        cause = cause.__cause__
      if isinstance(cause, (KeyError, AttributeError)) and (_DID_YOU_MEAN.search(str(cause)) or
                                                            any(a.startswith("--") and "." in a.split("=", 1)[0]
                                                                for a in argv)):
        text = override_error(cause, argv)
      elif isinstance(e, flags.Error):  # a bad value; the file's TypeError / ValueError come wrapped
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        text = lines[0] + (" " + lines[-1] if len(lines) > 1 else "")
      else:
        # an override ml_collections could not apply names itself in the error (e.g. a list item, phases.0)
        named = [a for a in argv if a.startswith(f"--{config_flag}.")
                 and f"'{a.split('=', 1)[0][len(config_flag) + 3:]}'" in str(e)]
        if named:
          text = f"{named[0]}: this override could not be applied ({type(e).__name__}: {e})"
          if any(part.isdigit() for part in named[0].split("=", 1)[0].split(".")):
            text += ("; ml_collections overrides name dict fields, not list items (such as phases.0): change "
                     "a list in the experiment file")
        else:
          text = (f"--{config_flag}={_flag_arg(argv, config_flag)}: loading the experiment file raised "
                  f"{type(e).__name__}: {e}")
      if "get_config() takes 0 positional arguments" in text:
        text += f"; {_flag_arg(argv, config_flag).split(':', 1)[0]} takes no ':ARG' after its path"
      fail(prog, text)
  return parse
