"""The study's table (study.md) and figures (study_*.png) from its results (study.json's dict)."""
from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from fot_jax import plots
from fot_jax.eval import report
from fot_jax.study.settings import MemoryRetrieval, path_label


def _ft_label(r: Dict) -> str:
  """The table's fine-tune cell: 'frozen', or 'N steps @ L_ft' (+ the memory path's crossbatch)."""
  ft = r.get("settings", {}).get("finetune")
  if not ft:
    return "frozen"
  cb = ft.get("crossbatch")
  return f"{ft['steps']:,} steps @ {ft['length']:,}" + (f", {json.dumps(cb).replace(chr(34), '')}" if cb else "")


def _fmt(x, digits=3):
  if x is None:
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else f"{x:,}"


def _grids(r: Dict) -> Dict[str, Dict]:
  out = {}
  if "passkey" in r:
    out["passkey"] = r["passkey"]
  if "niah" in r:
    out["NIAH single"], out["NIAH multi"] = r["niah"]["single"], r["niah"]["multi"]
  return out


def _grid_names(methods: Dict) -> List[str]:
  names = []
  for r in methods.values():
    names += [g for g in _grids(r) if g not in names]
  return names


def markdown(study: Dict) -> str:
  """One table: perplexity per length, mean accuracy and effective length per retrieval grid, r_d,
  wall time; then accuracy per length for each grid."""
  lengths = study["lengths"]
  methods = study["methods"]
  grid_names = _grid_names(methods)
  head = (["method", "path", "fine-tune"] + [f"ppl {x:,}" for x in lengths] + ["ppl eff. len"]
          + [f"{g} acc / eff. len" for g in grid_names] + ["r_d (d) / 1/d", "train s", "wall s"])
  rows = []
  for name, r in methods.items():
    method = r["method"]  # the entry as the study file wrote it
    row = [name, path_label(method.get("inference", "plain"), MemoryRetrieval.of_method(method)), _ft_label(r)]
    p = r.get("ppl")
    row += [_fmt(v) for v in p["perplexity"]] if p else ["-"] * len(lengths)
    row.append(_fmt(p["effective_length"]) if p else "-")
    for gn in grid_names:
      g = _grids(r).get(gn)
      row.append(f"{np.mean(g['accuracy_per_length']):.2f} / {_fmt(g['effective_length'])}" if g else "-")
    rd = r.get("rd")
    row.append(f"{rd['r_d'][-1]:.3f} ({rd['d'][-1]}) / {1 / rd['d'][-1]:.3f}" if rd else "n/a")
    row.append(f"{r['finetune']['seconds']:.0f}" if r.get("finetune") else "-")
    row.append(f"{r['wall_seconds']:.0f}")
    rows.append(row)
  lines = [f"# Context-extension study: base {study['base']} (window {study['window']:,})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  for g in grid_names:
    lines += ["", f"Accuracy per length, {g} (mean over depths):", "",
              "| method | " + " | ".join(f"{x:,}" for x in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, r in methods.items():
      if g in _grids(r):
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in _grids(r)[g]["accuracy_per_length"]) + " |")
  lines += ["", f"Study wall time {study['wall_seconds']:.0f}s (methods evaluated before are not re-timed). "
            "train s: the fine-tune's training (its last session when resumed); wall s: fine-tune and evaluation."]
  return "\n".join(lines) + "\n"


def _line_styles(plt, methods: Dict) -> Dict[str, Dict]:
  """One colour per method spec (a fine-tuned method shares its frozen twin's), dashed when
  fine-tuned: 15 methods stay readable where the default colour cycle repeats after 10."""
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"] + ["#000000", "#7f7f00", "#004c99", "#993300"]
  family, out = {}, {}
  for n, r in methods.items():
    spec = {k: v for k, v in (r.get("method") or {"name": n}).items() if k not in ("name", "finetune")}
    key = json.dumps(spec, sort_keys=True, default=str)
    family.setdefault(key, colours[len(family) % len(colours)])
    out[n] = {"color": family[key], "ls": "--" if (r.get("method") or {}).get("finetune") else "-"}
  return out


def plot(study: Dict, workdir: str) -> List[str]:
  """study_ppl.png, study_accuracy.png (accuracy against length per method, one panel per grid),
  study_passkey.png / study_niah.png (heatmaps side by side), study_rd.png."""
  plt = plots.pyplot()
  if plt is None:
    return []
  methods = study["methods"]
  files = []
  style = _line_styles(plt, methods)
  with_ppl = {n: r["ppl"] for n, r in methods.items() if "ppl" in r}
  if with_ppl:
    fig, ax = plt.subplots(figsize=(8.0, 4.4))
    for n, p in with_ppl.items():
      ax.plot(p["lengths"], p["perplexity"], marker="o", label=n, **style[n])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("perplexity of the last tokens")
    ax.axvline(study["window"], color="k", ls=":", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, handlelength=3, loc="center left", bbox_to_anchor=(1.01, 0.5))  # long enough to show the dashes
    ax.set_title("Perplexity against length (dotted: base window; dashed: fine-tuned)")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "study_ppl.png"), dpi=110)
    plt.close(fig)
    files.append("study_ppl.png")
  grid_names = _grid_names(methods)
  if grid_names:
    fig, axes = plt.subplots(1, len(grid_names), figsize=(4.6 * len(grid_names), 3.8), squeeze=False)
    for ax, g in zip(axes[0], grid_names):
      for n, r in methods.items():
        if g not in _grids(r):
          continue
        gr = _grids(r)[g]
        ax.plot(gr["lengths"], gr["accuracy_per_length"], marker="o", label=n, **style[n])
      ax.set_xscale("log", base=2)
      ax.set_ylim(-0.03, 1.03)
      ax.set_xlabel("length (tokens)")
      ax.set_ylabel("accuracy")
      ax.set_title(g)
      ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, handlelength=3)  # long enough to show the dashes
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "study_accuracy.png"), dpi=110)
    plt.close(fig)
    files.append("study_accuracy.png")
  for suite in ("passkey", "niah", "rd"):
    runs = {n: r[suite] for n, r in methods.items() if suite in r}
    if runs:
      files += report.plot_suite(suite, runs, workdir, prefix="study_")
  return files
