"""An experiment's results: results.json in its workdir and, on stdout, the table of one metric
against memory size per arm (the LM and dictionary-lookup runners). Low in the package, beside
jsonio and plots, so a runner writes its results without climbing back through its own layer."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from fot_jax import jsonio


def save_and_tabulate(results: Dict[str, Any], workdir: str, arms: List[str], metric: str, title: str) -> None:
  """results.json, and a table of `metric` against memory tokens per arm on stdout."""
  jsonio.write_json(os.path.join(workdir, "results.json"), results, default=str)
  width = max(9, *(len(a) for a in arms))
  header = f"{'memory tokens':>14} | " + " | ".join(f"{a:>{width}}" for a in arms)
  lines = [header, "-" * len(header)]
  for i, m in enumerate(results[arms[0]]["memory_tokens"]):
    lines.append(f"{m:>14,} | " + " | ".join(f"{results[a][metric][i]:>{width}.3f}" for a in arms))
  print(f"\n{title}:\n" + "\n".join(lines))
  print(f"wall time {results['wall_seconds']:.0f}s; results in {os.path.join(workdir, 'results.json')}")
