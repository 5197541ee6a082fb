"""JSON files that are never half written, and read errors that name the file.

A result written in place and cut by a crash (preemption, OOM kill) leaves a truncated file
that a later read reports only as "Expecting value: line 1 column 1"; `write_json` writes a
temporary file in the same directory and renames it over the target (atomic on POSIX), so a
reader sees the old file or the new one, never a part. The temporary file tempfile.mkstemp makes
is private (mode 0600); `honour_umask` gives the result the mode open() would have (0644 under
the usual umask 022), like the PNGs beside it. Other writers of 0600 files (safetensors'
save_file) use it too.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def umask() -> int:
  """The process's umask, read from /proc without changing it; elsewhere set and restored at once."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def honour_umask(target) -> None:
  """chmod a file (a path or an open descriptor) to 0o666 & ~umask, the mode open() gives a new
  file: for files made private by their writer (mkstemp, safetensors) that are outputs to share."""
  mode = 0o666 & ~umask()
  if isinstance(target, int):
    os.fchmod(target, mode)
  else:
    os.chmod(target, mode)


def write_json(path: str, obj: Any, indent: int = 1, **kwargs) -> None:
  """json.dump(obj) to `path` atomically (temporary file + os.replace)."""
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=indent, **kwargs)
      f.flush()
      os.fsync(f.fileno())
      honour_umask(f.fileno())  # mkstemp's 0600 -> what open() would have made
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


RESULT_HINT = "a run cut while writing it? Delete it to recompute"


def read_json(path: str, what: str = "JSON file", hint: str = RESULT_HINT) -> Any:
  """json.load(path); a missing or malformed file raises an error naming it (ValueError /
  FileNotFoundError, which the command-line entry points print as one line). hint: what to do
  about a malformed file (default: a result's; '' for none, e.g. a config the user wrote)."""
  path = os.fspath(path)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise FileNotFoundError(f"{what} {path} does not exist") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{what} {path} is not valid JSON ({e})" + (f"; {hint}" if hint else "")) from None
