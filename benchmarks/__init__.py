"""Benchmarks for fot_jax (run as modules: python -m benchmarks.<name>)."""
import json


def save_json(path, out: dict) -> dict:
  """Writes a benchmark's results to `path` (its --json; nothing when empty) and returns them."""
  if path:
    with open(path, "w") as f:
      json.dump(out, f, indent=1)
  return out
