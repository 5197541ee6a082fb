"""A clone of the repository is all a user has: no tracked file may point outside it."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md")


def _tracked_files():
  try:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if f]
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
    skip = {".git", ".venv", "runs", "checkpoints", "__pycache__"}
    return [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, files in os.walk(ROOT)
            for f in files if not dirs.__setitem__(slice(None), [x for x in dirs if x not in skip])]


def test_no_file_refers_outside_the_repository():
  me = os.path.relpath(__file__, ROOT)
  bad = []
  for f in _tracked_files():
    if f == me or not f.endswith((".py", ".md", ".cfg", ".toml", ".txt", ".sh", "Makefile", ".yaml", ".yml")):
      continue
    path = os.path.join(ROOT, f)
    if not os.path.isfile(path):
      continue
    with open(path, errors="replace") as fh:
      for n, line in enumerate(fh, 1):
        if OUTSIDE.search(line):
          bad.append(f"{f}:{n}: {line.strip()[:100]}")
  assert not bad, "files pointing outside the repository:\n" + "\n".join(bad)
