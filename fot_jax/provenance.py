"""Where a result came from: the code's commit, the machine and the package versions.

Results JSON record this (`provenance`), so a figure quoted in docs/results.md or the README can be traced to the
commit and the kind of machine that produced it (docs/demo_figures.py prints it next to the
figures). Nothing here fails: a field that cannot be read is None.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def _git(*args):
  try:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    return out.stdout.strip() if out.returncode == 0 else None
  except (OSError, subprocess.SubprocessError):
    return None


def cpu_model():
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or None


def _version(name):
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def provenance() -> dict:
  """{commit, dirty (uncommitted changes to tracked files), date, machine, cpu, cores,
  accelerators, python, packages}."""
  status = _git("status", "--porcelain", "--untracked-files=no")
  try:
    import jax
    devices = sorted({f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()})
  except Exception:  # provenance never fails a run
    devices = None
  return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(), "accelerators": devices,
          "python": platform.python_version(), "packages": {p: _version(p) for p in PACKAGES}}
